"""Decode attention tiles on one GPU (issue 33 point 5 / issue 31: at batch 64 the split
kernel read the KV cache at 0.62 of the copy rate on one H200, 0.77 on one H100).

    python bench/probes/decode_attention_tiles.py [--ctx 1024] [--batches 1,64,128]
        [--width 4096] [--default-only]

Qwen3-30B-A3B attention shape (32 query heads, 4 KV heads, head_dim 128, pages of 16,
block tables `--width` positions wide: 4096 as the decode bench's graphs by default; a
server's graphs take its max_model_len, the model's 40960 unless set), bf16, every sequence
at `ctx`. For each batch, every (positions per split, BLOCK_N, warps, stages, page ids
loaded inline or a tile ahead): the
relative error against the float32 reference on fresh random inputs, then the time of one
call replayed in a CUDA graph (median of 30 after 5 warm-ups), and the KV bytes read over
that time against the measured copy rate. The default config is the row marked *. A
table last; JSON to $OUT/decode_attention_tiles_<width>.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cuda_timing import median_ms  # noqa: E402  (bench/)

from phalanx.kernels.attention import decode_attention_ref  # noqa: E402
from phalanx.kernels.gpu import attention  # noqa: E402
from phalanx.kernels.gpu import decode_plan  # noqa: E402

NQ, NKV, HD, PAGE, WIDTH = 32, 4, 128, 16, 4096
# BLOCK_N, warps, (stages, page ids a tile ahead): without the prefetch 4 stages compile to
# the code of 3 (bench/probes/kernel_resources.py), so they are not timed
TILES = [(bn, w, st, pf) for bn, w in itertools.product((32, 64, 128), (4, 8))
         for st, pf in ((2, False), (3, False), (3, True), (4, True))]


def copy_rate() -> float:
    a = torch.empty(1 << 28, device="cuda", dtype=torch.uint8)
    b = torch.empty_like(a)
    return 2 * a.numel() / (median_ms(lambda: b.copy_(a), 10) / 1e3)  # bytes/s


def graphed_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay) * 1e3


def timed(row: dict, fn, ref: torch.Tensor, floor_us: float) -> dict:
    """``row`` with the error of fn() against ``ref`` and its graphed time, or the error
    raised (a tile past shared memory, say)."""
    try:
        row["err"] = ((fn().float() - ref).norm() / ref.norm()).item()
        row["us"] = graphed_us(fn)
        row["of_copy"] = floor_us / row["us"]
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:160]
    return row


def batch_rows(b: int, ctx: int, rate: float, g: torch.Generator, sweep: bool = True,
               width: int = WIDTH) -> list[dict]:
    pages = width // PAGE
    tables = torch.randperm(b * pages, generator=g, device="cuda").view(b, pages).to(torch.int32)
    kc = torch.randn(b * pages, NKV, PAGE, HD, generator=g, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(b, NQ, HD, generator=g, device="cuda", dtype=torch.bfloat16)
    sl = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    scale = HD ** -0.5
    ref = decode_attention_ref(q.float(), kc.float(), vc.float(), sl, tables, scale)
    default_bn = decode_plan._decode_block_n(b, HD)
    default = decode_plan._decode_partition(b, NKV, NQ, HD, width, default_bn)
    default_pipe = (3, True) if attention.PAGE_PREFETCH else (2, False)
    floor_us = 2 * b * ctx * NKV * HD * 2 / rate * 1e6
    rows = []
    for part in sorted({default, 64, 128, 256, 512, 1024} if sweep else {default}):
        for bn, w, st, pf in TILES:
            if part % bn:
                continue
            cfg = dict(BLOCK_N=bn, warps=w, stages=st, prefetch=pf)
            fn = lambda: attention.decode_attention_triton(q, kc, vc, sl, tables, scale,  # noqa: E731
                                                           partition=part, config=cfg)
            is_default = part == default and (bn, w, st, pf) == (default_bn, 4, *default_pipe)
            if sweep or is_default:
                rows.append(timed(dict(batch=b, part=part, cfg=cfg, default=is_default), fn, ref, floor_us))

    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 64, 128])
    ap.add_argument("--default-only", action="store_true", help="time only the default tiles")
    ap.add_argument("--width", type=int, default=WIDTH,
                    help="block table width in positions (the engine's: max_model_len)")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rate = copy_rate()
    rows = [r for b in args.batches for r in batch_rows(b, args.ctx, rate, g, not args.default_only, args.width)]
    with open(os.path.join(os.environ.get("OUT", "."), f"decode_attention_tiles_{args.width}.json"), "w") as f:
        json.dump(dict(copy_bytes_per_s=rate, ctx=args.ctx, width=args.width, rows=rows), f, indent=1)
    print(f"copy {rate / 1e12:.2f} TB/s, ctx {args.ctx}, tables {args.width} positions; best 6 per "
          "batch and the default (*)")
    print("| batch | part | BLOCK_N, warps, stages, prefetch | err | us | of copy |")
    print("|---|---|---|---|---|---|")
    for b in args.batches:
        ok = sorted((r for r in rows if r["batch"] == b and "us" in r), key=lambda r: r["us"])
        for r in ok[:6] + [r for r in ok[6:] if r["default"]]:
            c = r["cfg"]
            print(f"| {b} | {r['part']}{'*' if r['default'] else ''} | {c['BLOCK_N']}, {c['warps']}, "
                  f"{c['stages']}, {'ahead' if c['prefetch'] else 'inline'} | {r['err']:.1e} | "
                  f"{r['us']:.1f} | {r['of_copy']:.2f} |")
    bad = [r for r in rows if "error" in r or r.get("err", 0) > 2e-2]
    print(f"{len(rows)} configs, {len(bad)} failed or off: " + "; ".join(
        f"b{r['batch']} p{r['part']} {r['cfg']}: {r.get('error', r.get('err'))}" for r in bad[:6]))


if __name__ == "__main__":
    main()
