"""What the decode step's Triton kernels cost in registers, spills and shared memory on
sm_90, and whether their loads are pipelined: compiled on this machine, no GPU needed.

    python bench/probes/kernel_resources.py [--batches 1,16,64,128] [--out F.json]

The Qwen3-30B-A3B layer shapes (hidden 2048, 32 query / 4 KV heads of 128, 128 experts
of 768, top 8), bf16 and FP8 (block-scaled) weights, context 1024 in pages of 16. Every
kernel the wrappers launch at each batch is compiled for sm_90a through `offline_sm90`
and listed once per distinct compile. Columns: registers per thread, spill stack
(bytes per thread; > 0 means spills), shared memory per block, resident blocks per SM
(registers, shared memory, threads), cp.async (loads staged through shared memory by
the pipeliner) and MMA instructions in the PTX, and the allowance of each async wait
(copies left in flight; a pipelined loop has one above 0).

The GPU machine runs triton 3.6; to see its code, run this under a venv with that
version (a wheel lies in the local package mirror). Batch 0 rows: prefill attention of 8 prompts
of 2048 new tokens after a cached prefix of 2048.

    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0 torch==2.13.0 numpy
    mkdir -p /tmp/site36 && ln -sfn "$PWD" /tmp/site36/phalanx
    PYTHONPATH=/tmp/site36 /tmp/t36/bin/python bench/probes/kernel_resources.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from offline_sm90 import offline_target  # noqa: E402  (bench/)

from phalanx.kernels.attention import AttentionMetadata  # noqa: E402
from phalanx.kernels.gpu import attention, gemv, moe, moe_fp8, moe_fp8_decode, prefill_attention  # noqa: E402
from phalanx.kernels.gpu.fp8_linear import fp8_linear_triton  # noqa: E402

HID, NQ, NKV, HD, E, INTER, TOPK, PAGE, CTX = 2048, 32, 4, 128, 128, 768, 8, 16, 1024
BF16 = torch.bfloat16


def _experts(fp8: bool):
    """Expert stacks as the engine holds them (contents never read: nothing runs). FP8:
    codes and per-row scales over K blocks of 128 (`kernels/fp8.py`)."""
    dtype = torch.float8_e4m3fn if fp8 else BF16
    w13 = torch.empty(E, 2 * INTER, HID, dtype=dtype)
    w2 = torch.empty(E, HID, INTER, dtype=dtype)
    if not fp8:
        return w13, None, w2, None
    return w13, torch.empty(E, 2 * INTER, HID // 128), w2, torch.empty(E, HID, INTER // 128)


def launch_cases(batch: int) -> list[tuple[str, object]]:
    """(label, launch) for every kernel of a decode step at `batch` whose code depends on
    it, and the variants off by default that wait for a GPU to rank them."""
    pages = CTX // PAGE * 4  # block tables as wide as the decode graphs' (4096 positions)
    kc = torch.empty(batch * pages, NKV, PAGE, HD, dtype=BF16)
    q = torch.empty(batch, NQ, HD, dtype=BF16)
    lens = torch.full((batch,), CTX, dtype=torch.int32)
    tables = torch.zeros(batch, pages, dtype=torch.int32)

    def attend(width_tables=tables, **cfg):
        return lambda: attention.decode_attention_triton(q, kc, kc, lens, width_tables, HD ** -0.5, config=cfg)

    wide = torch.zeros(batch, 40960 // PAGE, dtype=torch.int32)  # a server's default max_model_len

    x = torch.empty(batch, HID, dtype=BF16)
    ids = (torch.arange(batch * TOPK) % E).view(batch, TOPK).to(torch.int32)
    weights = torch.full((batch, TOPK), 1.0 / TOPK)
    w13, _, w2, _ = _experts(False)
    q13, s13, q2, s2 = _experts(True)
    cases = [("attention", attend()),
             ("attention ahead", attend(prefetch=True)),
             ("attention wide tables", attend(wide)),
             ("experts bf16", lambda: moe.fused_experts_triton(x, weights, ids, w13, w2)),
             ("experts fp8", lambda: moe_fp8.fused_experts_fp8_triton(x, weights, ids, q13, s13, q2, s2))]
    if batch > 4:  # past the small path: the weight-rows candidate (`moe_fp8.DECODE_WEIGHT_ROWS`)
        cases.append(("experts fp8 weight rows",
                      lambda: moe_fp8_decode.fused_experts_fp8_decode_triton(x, weights, ids, q13, s13, q2, s2)))
    for name, (n, k) in (("qkv", (NQ * HD + 2 * NKV * HD, HID)), ("o", (HID, NQ * HD))):
        qw, sw = torch.empty(n, k, dtype=torch.float8_e4m3fn), torch.empty(n, k // 128)
        a = torch.empty(batch, k, dtype=BF16)
        if batch <= 4:
            cases += [(f"{name} bf16", lambda a=a, n=n, k=k: gemv.gemv_triton(a, torch.empty(n, k, dtype=BF16))),
                      (f"{name} fp8", lambda a=a, qw=qw, sw=sw: gemv.gemv_triton(a, qw, scales=sw))]
        else:
            cases.append((f"{name} fp8", lambda a=a, qw=qw, sw=sw: fp8_linear_triton(a, qw, sw)))
    return cases


def prefill_cases(seqs: int = 8, new: int = 2048, prefix: int = 2048) -> list[tuple[str, object]]:
    """Prefill attention of `seqs` prompts of `new` tokens after a cached `prefix`, the
    prefix tiles' page ids inline and a tile ahead (listed as batch 0)."""
    pages = (prefix + new) // PAGE
    meta = AttentionMetadata(
        query_start_loc=torch.arange(seqs + 1, dtype=torch.int32) * new,
        seq_lens=torch.full((seqs,), prefix + new, dtype=torch.int32),
        block_tables=torch.zeros(seqs, pages, dtype=torch.int32),
        slot_mapping=torch.full((seqs * new,), -1, dtype=torch.int64), max_query_len=new,
        max_seq_len=prefix + new)
    kc = torch.empty(seqs * pages, NKV, PAGE, HD, dtype=BF16)
    q = torch.empty(seqs * new, NQ, HD, dtype=BF16)
    kn = torch.empty(seqs * new, NKV, HD, dtype=BF16)

    def prefill(ahead: bool):
        cfg = prefill_attention._prefill_config(new, HD, prefetch=ahead)
        return lambda: prefill_attention.prefill_attention_triton(q, kc, kc, meta, HD ** -0.5, kn, kn, config=cfg)

    return [("prefill prefix", prefill(False)), ("prefill ahead", prefill(True))]


def compile_rows(batches: list[int]) -> list[dict]:
    """One row per (batch, case, kernel compile); a compile listed once per case."""
    rows = []
    with offline_target() as records:
        for b in batches + [0]:
            for label, launch in launch_cases(b) if b else prefill_cases():
                start, seen = len(records), set()
                launch()
                for r in records[start:]:
                    if r.hash not in seen:
                        seen.add(r.hash)
                        rows.append(dict(batch=b, case=label, blocks_per_sm=r.blocks_per_sm,
                                         **dataclasses.asdict(r)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16,64,128")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "kernel_resources.json"))
    args = ap.parse_args()
    import triton
    rows = compile_rows([int(v) for v in args.batches.split(",")])
    with open(args.out, "w") as f:
        json.dump(dict(triton=triton.__version__, rows=rows), f, indent=1)
    print(f"triton {triton.__version__}, sm_90a; JSON: {args.out}")
    print(f"{'batch':>5} {'case':<16} {'kernel':<26} {'grid':>16} {'w':>2} {'st':>2} {'regs':>4} {'spill':>5} "
          f"{'smem':>6} {'blk/SM':>6} {'cp.async':>8} {'mma':>4} {'wgmma':>5}  waits")
    for r in rows:
        print(f"{r['batch']:>5} {r['case']:<16} {r['name'][:26]:<26} {str(r['grid']):>16} {r['warps']:>2} {r['stages']:>2} "
              f"{r['regs']:>4} {r['stack']:>5} {r['shared']:>6} {r['blocks_per_sm']:>6} {r['cp_async']:>8} "
              f"{r['mma']:>4} {r['wgmma']:>5}  {','.join(map(str, r['waits'])) or '-'}")


if __name__ == "__main__":
    main()
