"""MoE tiles at prefill sizes on one GPU (issue 31 item 3: in an 8x2048 prefill the down
kernel ran at 0.51 of its matmul floor and gate_up at 0.65, 56.8 + 89.7 ms of 271).

    python bench/probes/moe_prefill_tiles.py [--tokens 2048,16384]

Qwen3-30B-A3B experts (128, top-8, hidden 2048, I 768), bf16, random weights and routing.
For each token count, every config below through ``fused_experts_triton``'s general path
(``_config`` replaced): relative error against ``fused_experts_ref`` on the same inputs,
time (CUDA events, median of 10 after 2 warm-ups), TFLOP/s and the fraction of the bf16
matmul floor measured in the same run. A table last; JSON to $OUT/moe_prefill_tiles.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cuda_timing import median_ms  # noqa: E402  (bench/)

from phalanx.kernels.gpu import moe as gm
from phalanx.kernels.moe import fused_experts_ref, route

E, K_TOP, HID, INTER = 128, 8, 2048, 768
# (BLOCK_M, N1, K1, N2, K2, warps, stages)
CONFIGS = [(64, 64, 64, 128, 64, 4, 3), (128, 128, 64, 128, 64, 8, 3), (128, 128, 64, 256, 64, 8, 3),
           (128, 64, 64, 256, 64, 8, 3), (128, 128, 64, 256, 64, 8, 4), (128, 128, 64, 256, 64, 8, 2),
           (128, 256, 64, 256, 64, 8, 3), (128, 128, 64, 256, 32, 8, 3), (128, 128, 64, 256, 128, 8, 3),
           (256, 128, 64, 256, 64, 8, 3)]


def timed(fn, reps: int = 10) -> float:
    return median_ms(fn, reps, warm=2) * 1e3  # us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=lambda v: [int(x) for x in v.split(",")], default=[2048, 8192, 16384])
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    rate = 2 * 8192**3 / timed(lambda: a @ a) / 1e6  # TFLOP/s
    del a
    dt = torch.bfloat16
    w13 = (torch.randn(E, 2 * INTER, HID, generator=g, device="cuda") / HID**0.5).to(dt)
    w2 = (torch.randn(E, HID, INTER, generator=g, device="cuda") / INTER**0.5).to(dt)
    rows, original = [], gm._config
    try:
        for T in args.tokens:
            x = torch.randn(T, HID, generator=g, device="cuda").to(dt)
            weights, ids = route(torch.randn(T, E, generator=g, device="cuda"), K_TOP, True, dt)
            ref = fused_experts_ref(x, weights, ids, w13, w2).float()
            flops = 2 * T * K_TOP * HID * 3 * INTER
            for bm, n1, k1, n2, k2, w, st in CONFIGS:
                cfg = dict(BLOCK_M=bm, N1=n1, K1=k1, N2=n2, K2=k2, warps=w, stages=st)
                gm._config = lambda _p, _e, cfg=cfg: cfg
                fn = lambda: gm.fused_experts_triton(x, weights, ids, w13, w2, path="general")  # noqa: E731
                try:
                    err = ((fn().float() - ref).norm() / ref.norm()).item()
                    us = timed(fn)
                except Exception as e:  # a tile past shared memory or registers
                    rows.append(dict(T=T, cfg=cfg, error=f"{type(e).__name__}: {e}"[:160]))
                    continue
                rows.append(dict(T=T, cfg=cfg, err=err, us=us, tflops=flops / us / 1e6,
                                 of_floor=flops / rate / 1e6 / us))
    finally:
        gm._config = original
    with open(os.path.join(os.environ.get("OUT", "."), "moe_prefill_tiles.json"), "w") as f:
        json.dump(dict(matmul_tflops=rate, rows=rows), f, indent=1)
    print(f"bf16 matmul {rate:.0f} TFLOP/s")
    print("| T | BLOCK_M, N1, K1, N2, K2, warps, stages | err | us | TFLOP/s | of floor |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        c = ", ".join(str(v) for v in r["cfg"].values())
        if "error" in r:
            print(f"| {r['T']} | {c} | {r['error']} | | | |")
        else:
            print(f"| {r['T']} | {c} | {r['err']:.1e} | {r['us']:.0f} | {r['tflops']:.0f} | {r['of_floor']:.2f} |")


if __name__ == "__main__":
    main()
