"""Prefill attention tiles and KV sources on one GPU (issue 31 item 3: the prefill kernel was
at 0.36 of its matmul floor, 19.9% of an 8x2048 prefill).

    python bench/probes/prefill_attention_tiles.py [--seqs 8] [--length 2048] [--prefix 1024]

Qwen3-30B-A3B attention shape (32 query heads, 4 KV heads, head_dim 128, pages of 16),
bf16. For each case (``seqs`` fresh prompts of ``length``; the same with a cached prefix of
``prefix`` before ``length - prefix`` new tokens; one prompt of ``length``; single short
prompts), every tile config (with a prefix: its page ids inline and a tile ahead) with and
without the contiguous new-token rows
(``k_new``/``v_new``): the relative
error against the float32 reference on fresh random inputs, then the time (CUDA events,
median of 20 after 3 warm-ups) and TFLOP/s, beside torch SDPA over each sequence (its
fastest backend; fresh prompts only) and the floor at the measured bf16 matmul rate. A
table last; JSON to $OUT/prefill_attention_tiles.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cuda_timing import median_ms  # noqa: E402  (bench/)
import torch.nn.functional as F

from phalanx.kernels.attention import AttentionMetadata, prefill_attention_ref  # noqa: E402
from phalanx.kernels.gpu.prefill_attention import prefill_attention_triton  # noqa: E402

NQ, NKV, HD, PAGE = 32, 4, 128, 16
CONFIGS = [(128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3), (16, 64, 4, 2)]


def timed(fn, reps: int = 20) -> float:
    return median_ms(fn, reps, warm=3) * 1e3  # us


def matmul_rate() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / timed(lambda: a @ a, 10) / 1e6  # TFLOP/s


def make_case(seqs: int, length: int, prefix: int, g: torch.Generator):
    """Paged cache holding every position, q for the new ones, k_new/v_new = their rows."""
    pages_per = -(-length // PAGE)
    perm = torch.randperm(seqs * pages_per, generator=g, device="cuda")
    tables = perm.view(seqs, pages_per).to(torch.int32)
    kc = torch.randn(seqs * pages_per, NKV, PAGE, HD, generator=g, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    new = length - prefix
    q = torch.randn(seqs * new, NQ, HD, generator=g, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(prefix, length, device="cuda")
    pages = tables[:, pos // PAGE].long()  # [seqs, new]
    k_new = kc[pages, :, pos % PAGE].reshape(seqs * new, NKV, HD).contiguous()
    v_new = vc[pages, :, pos % PAGE].reshape(seqs * new, NKV, HD).contiguous()
    meta = AttentionMetadata(
        query_start_loc=torch.arange(0, seqs * new + 1, new, device="cuda", dtype=torch.int32),
        seq_lens=torch.full((seqs,), length, device="cuda", dtype=torch.int32), block_tables=tables,
        slot_mapping=torch.full((seqs * new,), -1, device="cuda", dtype=torch.int64),
        max_query_len=new, max_seq_len=length)
    return q, kc, vc, k_new, v_new, meta


def case_rows(name, seqs, length, prefix, rate, g):
    q, kc, vc, k_new, v_new, meta = make_case(seqs, length, prefix, g)
    scale = HD ** -0.5
    new = length - prefix
    flops = 4 * NQ * HD * seqs * new * (prefix + (new + 1) / 2)
    floor_us = flops / rate / 1e6
    ref = prefill_attention_ref(q, kc, vc, meta, scale).float()
    rows = []
    # with a prefix, also its tiles' page ids a tile ahead (3 stages at least)
    tiles = [dict(BLOCK_M=bm, BLOCK_N=bn, warps=w, stages=st, prefetch=False) for bm, bn, w, st in CONFIGS]
    if prefix:
        ahead = {tuple(dict(t, prefetch=True, stages=max(3, t["stages"])).items()) for t in tiles}
        tiles += [dict(t) for t in sorted(ahead)]
    for cfg in tiles:
        for rows_src in ("pages", "k_new"):
            extra = (k_new, v_new) if rows_src == "k_new" else (None, None)
            fn = lambda: prefill_attention_triton(q, kc, vc, meta, scale, *extra, config=cfg)  # noqa: E731
            try:
                err = ((fn().float() - ref).norm() / ref.norm()).item()
                us = timed(fn)
            except Exception as e:  # a tile that does not fit shared memory, say
                rows.append(dict(case=name, cfg=cfg, src=rows_src, error=f"{type(e).__name__}: {e}"[:200]))
                continue
            rows.append(dict(case=name, cfg=cfg, src=rows_src, err=err, us=us,
                             tflops=flops / us / 1e6, of_floor=floor_us / us))
    if prefix == 0:
        qs = q.view(seqs, new, NQ, HD).transpose(1, 2)
        ks = k_new.view(seqs, new, NKV, HD).transpose(1, 2)
        vs = v_new.view(seqs, new, NKV, HD).transpose(1, 2)
        sdpa = lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)  # noqa: E731
        out = sdpa().transpose(1, 2).reshape_as(q).float()
        us = timed(sdpa)
        rows.append(dict(case=name, cfg="torch sdpa", src="dense", err=((out - ref).norm() / ref.norm()).item(),
                         us=us, tflops=flops / us / 1e6, of_floor=floor_us / us))
    return rows, floor_us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--short", type=lambda v: [int(x) for x in v.split(",")], default=[],
                    help="also single fresh prompts of these lengths")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rate = matmul_rate()
    cases = [(f"{args.seqs}x{args.length}", args.seqs, args.length, 0),
             (f"{args.seqs}x{args.length} prefix {args.prefix}", args.seqs, args.length, args.prefix),
             (f"1x{args.length}", 1, args.length, 0)]
    cases += [(f"1x{n}", 1, n, 0) for n in args.short]
    rows, floors = [], {}
    for name, seqs, length, prefix in cases:
        r, floors[name] = case_rows(name, seqs, length, prefix, rate, g)
        rows += r
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "prefill_attention_tiles.json"), "w") as f:
        json.dump(dict(matmul_tflops=rate, floors_us=floors, rows=rows), f, indent=1)
    print(f"bf16 matmul {rate:.0f} TFLOP/s")
    print("| case | tiles (M, N, warps, stages, prefix page ids) | KV rows | err | us | TFLOP/s | of floor |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cfg = r["cfg"] if isinstance(r["cfg"], str) else "{BLOCK_M}, {BLOCK_N}, {warps}, {stages}, {ids}".format(
            ids="ahead" if r["cfg"]["prefetch"] else "inline", **r["cfg"])
        if "error" in r:
            print(f"| {r['case']} | {cfg} | {r['src']} | {r['error']} | | | |")
        else:
            print(f"| {r['case']} | {cfg} | {r['src']} | {r['err']:.1e} | {r['us']:.1f} | {r['tflops']:.0f} "
                  f"| {r['of_floor']:.2f} |")


if __name__ == "__main__":
    main()
