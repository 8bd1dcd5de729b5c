"""Does the installed torch's `torch._scaled_mm` run block-scaled FP8 (activations 1x128,
weights 1x128 per row or 128x128) on this GPU, and how fast, against phalanx's Triton FP8
linear and cuBLAS bf16, at the Qwen3-30B-A3B qkv / o shapes (issue 33: the FP8 prefill
linears ran at 0.7x cuBLAS bf16 on one H100).

    python bench/probes/scaled_mm_blockwise.py [--ms 64,128,1024,16384]

Every route computes ``x @ dequantize(q, s).T`` with x quantized per token and 128
columns (`fp8_quant.quantize_groups_triton`, timed inside each FP8 route); the
relative error is against float32 over the dequantized operands. cuBLAS's layouts
(torch's ScaledBlas checks): activation scales ``[M, K/128]`` M-major; per-row weight
scales ``[N, K/128]`` N-major; 128x128 weight scales ``[N/128, K/128]`` row-major. A
route torch or cuBLAS refuses prints its error. JSON to $OUT/scaled_mm_blockwise.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fp8_kernels_gpu import LINEARS, _rel, _time_us, _weight  # noqa: E402  (bench/)

from phalanx.kernels.fp8 import BLOCK, dequantize  # noqa: E402
from phalanx.kernels.gpu.fp8_linear import fp8_linear_triton  # noqa: E402
from phalanx.kernels.gpu.fp8_quant import quantize_groups_triton  # noqa: E402


def m_major(s: torch.Tensor) -> torch.Tensor:
    """``s [R, KB]`` with the same values, stride (1, R)."""
    return s.t().contiguous().t()


def routes(q: torch.Tensor, s: torch.Tensor) -> dict:
    """name -> fn(x) for the FP8 routes over weight codes ``q [N, K]``, per-row scales ``s``
    (the second is what `fp8_linear_triton` runs by default, `CUBLAS_BLOCKWISE`)."""
    per_row = m_major(s).t()                       # scale_b.t() is [N, K/128], N-major
    blocks = s[::BLOCK].contiguous().t()           # scale_b.t() is [N/128, K/128], row-major

    def scaled(scale_b):
        def fn(x):
            a, a_s = quantize_groups_triton(x)
            return torch._scaled_mm(a, q.t(), scale_a=m_major(a_s), scale_b=scale_b,
                                    out_dtype=torch.bfloat16)
        return fn

    return {"triton fp8": lambda x: fp8_linear_triton(x, q, s, config={}),  # a config: Triton
            "scaled_mm 1x128/row": scaled(per_row),
            "scaled_mm 1x128/128x128": scaled(blocks)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="64,128,1024,16384")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {torch.cuda.get_device_name()}", flush=True)
    rows = []
    for name, (n, k) in LINEARS.items():
        q, s = _weight((n, k), g)
        wd = dequantize(q, s, torch.bfloat16)
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            a, a_s = quantize_groups_triton(x)
            ref = dequantize(a, a_s, torch.float32) @ wd.float().t()
            bf16_us = _time_us(lambda: F.linear(x, wd))
            for route, fn in routes(q, s).items():
                try:
                    err, us = _rel(fn(x), ref), _time_us(lambda: fn(x))
                except Exception as e:  # refused by torch or cuBLAS: say why, go on
                    print(f"{name} M={m} {route}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
                    continue
                rows.append(dict(linear=name, m=m, route=route, err=err, us=us, bf16_us=bf16_us))
    out = os.path.join(os.environ.get("OUT", "."), "scaled_mm_blockwise.json")
    with open(out, "w") as f:
        json.dump(dict(torch=torch.__version__, device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print(f"{'linear':6} {'M':>6} {'route':26} {'us':>9} {'bf16 us':>8} {'x bf16':>7} {'err':>8}")
    for r in rows:
        print(f"{r['linear']:6} {r['m']:6d} {r['route']:26} {r['us']:9.1f} {r['bf16_us']:8.1f} "
              f"{r['bf16_us'] / r['us']:7.2f} {r['err']:8.1e}")


if __name__ == "__main__":
    main()
