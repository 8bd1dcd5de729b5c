"""Does programmatic dependent launch (PDL) shorten a chain of small kernels in a CUDA
graph? A probe for the B=1 decode step, which is ~600 small kernels (bench/NOTES.md).

    python bench/probes/pdl_gpu.py [--kernels 48] [--n 2048] [--k 2048]

A chain of GEMVs y_{i+1} = W_i y_i (distinct bf16 W_i, so nothing stays in L2), each
one Triton launch, captured in one CUDA graph, in three variants:
  plain     ordinary launches;
  pdl       launched with PDL, `gdc_launch_dependents` first and `gdc_wait` before the
            first read of y (the previous kernel's output);
  pdl+pre   as pdl, with the program's W tile loaded before `gdc_wait` (weights never
            depend on an earlier kernel, so their reads overlap the previous kernel).
Each variant's output is checked against torch. Prints µs per kernel against the
weight-read floor and writes JSON to $OUT/pdl_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # older triton: the probe reports plain launches only
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def _gemv(w_ptr, x_ptr, y_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr,
          PDL: tl.constexpr, PREFETCH: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, K)
    if PDL:
        gdc_launch_dependents()
    if PREFETCH:
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :])
    if PDL:
        gdc_wait()
    if not PREFETCH:
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :])
    x = tl.load(x_ptr + cols).to(tl.float32)
    y = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty))


def chain(ws, xs, pdl: bool, prefetch: bool, block_n: int) -> None:
    n, k = ws[0].shape
    for i, w in enumerate(ws):
        _gemv[(n // block_n,)](w, xs[i], xs[i + 1], n, K=k, BLOCK_N=block_n, PDL=pdl,
                               PREFETCH=prefetch, num_warps=8, launch_pdl=pdl)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", type=int, default=48)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--block-n", type=int, default=8)
    args = ap.parse_args()
    if args.n != args.k or args.n % args.block_n:
        ap.error("a chain needs square GEMVs (--n == --k) and --block-n dividing --n")
    g = torch.Generator(device="cuda").manual_seed(0)
    scale = args.k ** -0.5
    ws = [torch.randn(args.n, args.k, device="cuda", generator=g).mul_(scale).bfloat16()
          for _ in range(args.kernels)]
    xs = [torch.randn(args.k, device="cuda", generator=g).bfloat16()]
    xs += [torch.empty(args.n, device="cuda", dtype=torch.bfloat16) for _ in ws]
    ref = xs[0].float()
    for w in ws:
        ref = (w.float() @ ref).bfloat16().float()
    floor_us = args.n * args.k * 2 / 4.2e12 * 1e6
    variants = [("plain", False, False)]
    if gdc_wait is not None:
        variants += [("pdl", True, False), ("pdl+pre", True, True)]
    rows = []
    for name, pdl, pre in variants:
        try:
            chain(ws, xs, pdl, pre, args.block_n)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain(ws, xs, pdl, pre, args.block_n)
            for x in xs[1:]:
                x.zero_()
            graph.replay()
            torch.cuda.synchronize()
            err = ((xs[-1].float() - ref).norm() / ref.norm()).item()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(5):
                graph.replay()
            start.record()
            for _ in range(50):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            us = start.elapsed_time(end) * 1e3 / 50 / args.kernels
            rows.append(dict(variant=name, us_per_kernel=us, floor_us=floor_us, rel_err=err))
        except Exception as exc:  # report, keep probing the other variants
            rows.append(dict(variant=name, error=f"{type(exc).__name__}: {exc}"[:300]))
    with open(os.path.join(os.environ.get("OUT", "."), "pdl_gpu.json"), "w") as f:
        json.dump(dict(args=vars(args), triton=triton.__version__, rows=rows), f, indent=2)
    print(f"triton {triton.__version__}, {args.kernels} GEMVs {args.n}x{args.k} bf16 in one graph")
    print(f"{'variant':9} {'us/kernel':>10} {'floor us':>9} {'of floor':>9} {'rel err':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:9} {r['error']}")
        else:
            print(f"{r['variant']:9} {r['us_per_kernel']:10.2f} {r['floor_us']:9.2f} "
                  f"{r['floor_us'] / r['us_per_kernel']:9.2f} {r['rel_err']:9.1e}")


if __name__ == "__main__":
    main()
