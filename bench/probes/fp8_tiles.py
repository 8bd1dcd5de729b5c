"""Tile sweep of the FP8 kernels (issue 33) at the Qwen3-30B-A3B shapes, one H200.

    python bench/probes/fp8_tiles.py [--only linear-decode,linear-mid,linear-prefill,experts-decode,experts-mid,experts-prefill]
                                     [--variants "[dict(EVEN=True), dict(EVEN=True, stages=4)]"]

(An experts variant with ``WROWS=True`` runs `moe_fp8_decode`'s kernels with its other keys.)

(``-prefill16``: the prefill shapes with bf16 activations, weights dequantized in registers.)

Every variant's output is checked against the reference of its mode (relative error, a
variant above 2e-2 is marked BAD) and timed by CUDA-graph replay; the bf16 kernel at the
same shape is timed beside it. Prints, per case, the variants fastest first; JSON to
$OUT/fp8_tiles.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fp8_kernels_gpu import HID, INTER, LINEARS, NE, TOPK, _acts_deq, _experts_acts_ref, _rel, _time_us, _weight  # noqa: E402

LIN_DECODE = [dict(BLOCK_N=n, stages=st, warps=w, SCALE_AFTER=sa)
              for n in (16, 32, 64) for st in (4, 6) for w in (2, 4) for sa in (False, True)]
# Batch 16 < M <= 128 (decode at batch 64 / 128): FP8 dots (a_fp8, the default there) in N
# tiles of 16-64 rows (o has 2048 rows: 32 programs at 64), K shared by 1-8 programs a tile
# (SPLIT_K, the last merging); a_fp8=False (weights dequantized in registers) lost at every
# tile in the thirty-third session's run.
LIN_MID = [dict(a_fp8=True, BLOCK_N=n, stages=st, warps=4, SCALE_AFTER=False, SPLIT_K=sk)
           for n in (16, 32, 64) for sk in (1, 2, 4, 8) for st in (3, 5)]
# The experts at decode batches 16-128 (4-8 pairs per expert): FP8 dots (activations
# quantized, gate_up quantizing its output; N1 one group) against the default dequantize-
# in-registers tiles.
EXP_MID = ([dict(A_FP8=False, SCALE_AFTER=False, BLOCK_M=16, N1=128, N2=128, warps=4, stages=3)]
           + [dict(A_FP8=True, SCALE_AFTER=False, BLOCK_M=bm, N1=128, N2=n2, warps=w, stages=st)
              for bm in (16, 32, 64) for n2 in (128, 256) for w, st in ((4, 3), (8, 3), (4, 4))])
LIN_PREFILL = [dict(BLOCK_M=bm, BLOCK_N=bn, warps=w, stages=st)
               for bm, bn, w, st in [(64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3), (128, 128, 4, 3),
                                     (128, 256, 8, 3), (64, 256, 8, 3), (128, 64, 4, 4)]]
EXP_DECODE = [dict(N1=n1, N2=n2, stages=st, warps=w, SCALE_AFTER=sa)
              for n1, n2 in ((64, 64), (32, 32), (128, 128), (64, 128)) for st in (3, 5) for w in (4,)
              for sa in (False, True)]
LIN_PREFILL16 = [dict(BLOCK_M=bm, BLOCK_N=bn, warps=w, stages=st, SCALE_AFTER=False)
                 for bm, bn, w, st in [(64, 128, 4, 3), (128, 128, 8, 3), (64, 256, 8, 3), (128, 64, 4, 4)]]
EXP_PREFILL16 = [dict(BLOCK_M=bm, N1=n1, N2=n2, warps=w, stages=st, SCALE_AFTER=False)
                 for bm, n1, n2, w, st in [(64, 64, 128, 4, 3), (64, 128, 256, 8, 3), (64, 128, 128, 8, 3),
                                           (128, 128, 128, 8, 3)]]
EXP_PREFILL = [dict(BLOCK_M=bm, N2=n2, warps=w, stages=st)
               for bm, n2, w, st in [(64, 128, 8, 3), (64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3),
                                     (64, 256, 8, 3), (128, 256, 8, 3)]]


VARIANTS: list[dict] = []  # --variants: these configs instead of each case's list


def _measure(case: str, variant: dict, fn, ref, bf16_us: float) -> list[dict]:
    """One variant's row; none when it does not compile or launch (e.g. shared memory)."""
    try:
        return [dict(case=case, variant=variant, err=_rel(fn(), ref), us=_time_us(fn), bf16_us=bf16_us)]
    except Exception as e:  # a tile that does not fit: reported, the sweep goes on
        print(f"{case} {variant}: {type(e).__name__}", flush=True)
        return []


def _print_case(case: str, rows: list[dict]) -> None:
    mine = sorted((r for r in rows if r["case"] == case), key=lambda r: r["us"])
    if not mine:
        return
    print(f"{case}: bf16 {mine[0]['bf16_us']:.1f} us", flush=True)
    for r in mine[:4] + mine[-1:]:
        bad = " BAD" if r["err"] > 2e-2 else ""
        print(f"   {r['us']:8.1f} us  x bf16 {r['bf16_us'] / r['us']:5.2f}  err {r['err']:.1e}{bad}  {r['variant']}",
              flush=True)


def linear_cases(kind: str, g) -> list[dict]:
    from phalanx.kernels.fp8 import dequantize, fp8_linear_ref
    from phalanx.kernels.gpu.fp8_linear import fp8_linear_triton

    rows = []
    ms, variants, a_fp8 = {"decode": ((1, 16, 64, 128), LIN_DECODE, False), "prefill": ((16384,), LIN_PREFILL, True),
                           "prefill16": ((16384,), LIN_PREFILL16, False), "mid": ((64, 128), LIN_MID, None)}[kind]
    variants = VARIANTS or variants
    for name, (n, k) in LINEARS.items():
        q, s = _weight((n, k), g)
        wd = dequantize(q, s, torch.bfloat16)
        for m in ms:
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            refs = {True: F.linear(_acts_deq(x), wd.float()), False: fp8_linear_ref(x, q, s)}
            bf16 = _time_us(lambda: F.linear(x, wd))
            for v in variants:
                af = v["a_fp8"] if a_fp8 is None else a_fp8
                cfg = {key: val for key, val in v.items() if key != "a_fp8"}
                cfg["BLOCK_M"] = v.get("BLOCK_M", 16 if m <= 16 else 64 if m <= 64 else 128)
                fn = lambda cfg=cfg, af=af: fp8_linear_triton(x, q, s, a_fp8=af, config=cfg)  # noqa: E731
                rows += _measure(f"linear {name} M={m}", dict(cfg, a_fp8=af), fn, refs[af], bf16)
            _print_case(f"linear {name} M={m}", rows)
    return rows


def experts_cases(kind: str, g) -> list[dict]:
    from phalanx.kernels.fp8 import dequantize
    from phalanx.kernels.gpu.moe import fused_experts_triton
    from phalanx.kernels.gpu.moe_fp8 import fused_experts_fp8_triton
    from phalanx.kernels.gpu.moe_fp8_decode import fused_experts_fp8_decode_triton
    from phalanx.kernels.moe import fused_experts_ref, route

    w13, s13 = _weight((NE, 2 * INTER, HID), g)
    w2, s2 = _weight((NE, HID, INTER), g)
    w13d, w2d = dequantize(w13, s13, torch.bfloat16), dequantize(w2, s2, torch.bfloat16)
    rows = []
    ms, variants = {"decode": ((16, 64, 128), EXP_DECODE), "prefill": ((16384,), EXP_PREFILL),
                    "prefill16": ((16384,), EXP_PREFILL16), "mid": ((16, 64, 128), EXP_MID)}[kind]
    variants = VARIANTS or variants
    for m in ms:
        x = torch.randn(m, HID, device="cuda", generator=g).to(torch.bfloat16)
        w, ids = route(torch.randn(m, NE, device="cuda", generator=g), TOPK, True, torch.bfloat16)
        refs = {True: _experts_acts_ref(x, w, ids, w13d, w2d), False: fused_experts_ref(x, w, ids, w13d, w2d)}
        bf16 = _time_us(lambda: fused_experts_triton(x, w, ids, w13d, w2d))
        for v in variants:
            if v.get("WROWS"):  # the weight rows as the MMA's M (`moe_fp8_decode`), FP8 activations
                cfg = {key: val for key, val in v.items() if key != "WROWS"}
                fn = lambda cfg=cfg: fused_experts_fp8_decode_triton(x, w, ids, w13, s13, w2, s2,  # noqa: E731
                                                                     config=cfg)
                rows += _measure(f"experts T={m}", v, fn, refs[True], bf16)
                continue
            af = v.get("A_FP8", kind == "prefill")
            fn = lambda v=v, af=af: fused_experts_fp8_triton(x, w, ids, w13, s13, w2, s2,  # noqa: E731
                                                             a_fp8=af, config=v)
            rows += _measure(f"experts T={m}", v, fn, refs[af], bf16)
        _print_case(f"experts T={m}", rows)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="linear-decode,linear-prefill,experts-decode,experts-prefill")
    ap.add_argument("--variants", default="",
                    help="a Python list of config dicts (keys of the kernels' `config`) timed instead of "
                         "each case's built-in list, e.g. \"[{}, dict(stages=4)]\"")
    args = ap.parse_args()
    if args.variants:  # a list of literals and dict(...) calls only
        VARIANTS.extend(eval(args.variants, {"__builtins__": {}, "dict": dict}))
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for what in args.only.split(","):
        group, kind = what.split("-")
        rows += (linear_cases if group == "linear" else experts_cases)(kind, g)
        with open(os.path.join(os.environ.get("OUT", "."), "fp8_tiles.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
