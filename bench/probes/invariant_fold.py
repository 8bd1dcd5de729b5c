"""What the batch-invariant mode's few-row projections cost, part by part, on one GPU.

    python bench/probes/invariant_fold.py [--layers 24] [--rows 1] [--reps 50]

A chain of `--layers` projections in one CUDA graph (a weight per layer, so that the
weights stream from HBM as in a decode step), Qwen3-30B-A3B shapes (qkv 2048 -> 5120,
router 2048 -> 128), bf16, at `--rows` rows. Variants: the default path's GEMV with the
norm folded in; the mode's norm kernel then its GEMM; the mode's GEMM with the norm
folded in (``invariant_gemm.FOLD_MAX_M`` 16); the GEMM alone; each with PDL on for
every kernel (``set_pdl(True)``, the GEMM's "gemm" included) and off. Also checks that the folded and
unfolded forms give equal bits. Prints µs per projection and the byte floor; JSON to
$OUT/invariant_fold.json (or ./invariant_fold.json).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from phalanx.kernels.batch_invariant import batch_invariant
from phalanx.kernels.gpu import invariant_gemm
from phalanx.kernels.gpu.pdl import set_pdl
from phalanx.kernels.norm_linear import norm_linear


def chain_us(fn, layers: int, reps: int) -> float:
    """µs per call of ``fn(layer)`` replayed in a CUDA graph of ``layers`` calls."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            for i in range(layers):
                fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(layers):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(args.rows, 2048, generator=g, device=dev).to(bf)
    res = torch.randn(args.rows, 2048, generator=g, device=dev).to(bf)
    nw = (1 + 0.1 * torch.randn(2048, generator=g, device=dev)).to(bf)
    rows = []
    for name, n in (("qkv", 5120), ("router", 128)):
        ws = [(0.02 * torch.randn(n, 2048, generator=g, device=dev)).to(bf) for _ in range(args.layers)]
        floor_us = n * 2048 * 2 / 3.35e12 * 1e6  # H100 SXM HBM3 peak; H200: 4.8e12
        old = invariant_gemm.FOLD_MAX_M
        with batch_invariant(True):
            invariant_gemm.FOLD_MAX_M = 16
            folded = norm_linear(x, res, nw, 1e-6, ws[0], want_normed=True)
            invariant_gemm.FOLD_MAX_M = 0
            plain = norm_linear(x, res, nw, 1e-6, ws[0], want_normed=True)
            invariant_gemm.FOLD_MAX_M = old
        equal = all(torch.equal(a, b) for a, b in zip(folded, plain))
        variants = {
            "default (GEMV, norm folded)": (False, None, lambda i: norm_linear(x, res, nw, 1e-6, ws[i])),
            "mode: norm kernel + GEMM": (True, 0, lambda i: norm_linear(x, res, nw, 1e-6, ws[i])),
            "mode: GEMM, norm folded": (True, 16, lambda i: norm_linear(x, res, nw, 1e-6, ws[i])),
            "mode: GEMM alone": (True, 0, lambda i: invariant_gemm.invariant_linear_triton(x, ws[i])),
        }
        for label, (mode, fold, fn) in variants.items():
            for pdl in (True, False):
                prev = set_pdl(pdl)
                invariant_gemm.FOLD_MAX_M = old if fold is None else fold
                with batch_invariant(mode):
                    us = chain_us(fn, args.layers, args.reps)
                invariant_gemm.FOLD_MAX_M = old
                set_pdl(prev)
                rows.append(dict(proj=name, variant=label, pdl=pdl, us=us, floor_us=floor_us,
                                 folded_equals_unfolded=equal))
    out = os.path.join(os.environ.get("OUT", "."), "invariant_fold.json")
    with open(out, "w") as f:
        json.dump({"args": vars(args), "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"wrote {out}")
    print(f"{'proj':8} {'variant':30} {'pdl':>5} {'us':>8} {'floor us':>9}  bits equal")
    for r in rows:
        print(f"{r['proj']:8} {r['variant']:30} {str(r['pdl']):>5} {r['us']:8.2f} {r['floor_us']:9.2f}  "
              f"{r['folded_equals_unfolded']}")


if __name__ == "__main__":
    main()
