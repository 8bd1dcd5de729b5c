"""FP8 kernels on the GPU (issue 33): correctness against the torch references per shape
and dtype, and time against the bf16 kernels and the floors, Qwen3-30B-A3B shapes.

    python bench/fp8_kernels_gpu.py [--dtypes bfloat16,float16] [--ms 1,16,64,128,16384]

Rows: the dense projections (qkv 5120x2048, o 2048x4096) through `kernels.fp8.fp8_linear`
and the experts (128 x [1536, 2048] / [2048, 768], top-8) through `kernels.moe.fused_experts`
with scales, at M (tokens) 1, 16, 64, 128 and 16384 (prefill 8 x 2048). Each row checks:

- err: relative error (Frobenius) against the reference of the mode the kernel ran in:
  decode (weights dequantized in registers) against `fp8_linear_ref` / the experts
  reference over the dequantized stacks, in the same dtype; prefill (FP8 activations)
  against a float32 reference that quantizes the activations the same way;
- err_vs_unquantized: against the dequantized weights with unquantized activations (the
  activations' quantization error, prefill rows only);

and times (CUDA-graph replay, `triton.testing.do_bench_cudagraph`) the FP8 kernel, the
bf16 path over the dequantized weights (cuBLAS `F.linear` / phalanx's bf16 Triton experts),
and the floor: bytes (FP8 weights + their per-row scales + activations) over the measured
copy bandwidth, or FLOPs over the measured FP8 matmul rate (`torch._scaled_mm`, 8192^3),
whichever is larger. Prints a table last; JSON to $OUT/fp8_kernels_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

HID, INTER, NE, TOPK = 2048, 768, 128, 8
LINEARS = {"qkv": (5120, HID), "o": (HID, 4096)}


def ceilings() -> dict:
    from decode_fp8 import fp8_matmul_rate
    from decode_gpu import measure_ceilings
    ceil = measure_ceilings()
    return dict(ceil, bf16_matmul_flops_per_s=ceil["matmul_flops_per_s"],
                fp8_matmul_flops_per_s=fp8_matmul_rate())


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


def _time_us(fn) -> float:
    from triton.testing import do_bench_cudagraph
    return do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3


def _weight(shape, g):
    """FP8 codes and per-row scales as the engine loads them (`use_fp8`: 2-D scales also
    N-major, so the linears past 16 rows take cuBLAS's block-scaled GEMM)."""
    from phalanx.kernels.fp8 import expand_block_scales, quantize_blocks
    from phalanx.kernels.fp8_cublas import keep_n_major
    q, blocks = quantize_blocks(torch.randn(*shape, device="cuda", generator=g) * 0.02)
    return q, keep_n_major(expand_block_scales(blocks, shape[-2]))


def _acts_deq(x: torch.Tensor) -> torch.Tensor:
    from phalanx.kernels.fp8 import dequantize, quantize_groups
    q, s = quantize_groups(x)
    return dequantize(q, s, torch.float32)


def linear_rows(dtype, ms, ceil, g) -> list[dict]:
    from phalanx.kernels.fp8 import dequantize, fp8_linear, fp8_linear_ref
    from phalanx.kernels.gpu.fp8_linear import SKINNY_MAX_M

    rows = []
    for name, (n, k) in LINEARS.items():
        q, s = _weight((n, k), g)
        wd = dequantize(q, s, dtype)
        for m in ms:
            x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
            out = fp8_linear(x, q, s)
            unq = F.linear(x.float(), wd.float())
            if m > SKINNY_MAX_M:
                err = _rel(out, F.linear(_acts_deq(x), wd.float()))
            else:
                err = _rel(out, fp8_linear_ref(x, q, s))
            nbytes = n * k + n * s.shape[1] * 4 + (m * k + m * n) * x.element_size()
            floor = max(nbytes / ceil["copy_bytes_per_s"], 2 * m * n * k / ceil["fp8_matmul_flops_per_s"])
            rows.append(dict(kernel=f"linear {name}", dtype=str(dtype)[6:], m=m, err=err,
                             err_vs_unquantized=_rel(out, unq) if m > SKINNY_MAX_M else None,
                             fp8_us=_time_us(lambda: fp8_linear(x, q, s)),
                             bf16_us=_time_us(lambda: F.linear(x, wd)), floor_us=floor * 1e6))
    return rows


def _experts_acts_ref(x, w, ids, w13d, w2d) -> torch.Tensor:
    """The prefill mode's arithmetic in float32 (x and silu(g) * u quantized per group)."""
    xq, out = _acts_deq(x), torch.zeros(x.shape, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        gate, up = (xq[tok] @ w13d[e].float().t()).chunk(2, dim=-1)
        h = _acts_deq(F.silu(gate) * up) @ w2d[e].float().t()
        out.index_add_(0, tok, h * w[tok, slot, None].float())
    return out


def moe_rows(dtype, ms, ceil, g) -> list[dict]:
    from phalanx.kernels.fp8 import dequantize
    from phalanx.kernels.gpu.moe import fused_experts_triton
    from phalanx.kernels.moe import fused_experts, fused_experts_ref, route

    w13, s13 = _weight((NE, 2 * INTER, HID), g)
    w2, s2 = _weight((NE, HID, INTER), g)
    w13d, w2d = dequantize(w13, s13, dtype), dequantize(w2, s2, dtype)
    rows = []
    for m in ms:
        x = torch.randn(m, HID, device="cuda", generator=g).to(dtype)
        w, ids = route(torch.randn(m, NE, device="cuda", generator=g), TOPK, True, dtype)
        out = fused_experts(x, w, ids, w13, w2, None, (s13, s2))
        prefill = m * TOPK / NE > 16
        ref = (_experts_acts_ref(x, w, ids, w13d, w2d) if prefill
               else fused_experts_ref(x, w, ids, w13d, w2d))
        touched = NE * (1 - (1 - TOPK / NE) ** m)
        per_expert = 3 * HID * INTER + 4 * (2 * INTER * HID // 128 + HID * INTER // 128)
        nbytes = touched * per_expert + 2 * m * HID * x.element_size()
        floor = max(nbytes / ceil["copy_bytes_per_s"],
                    2 * m * TOPK * 3 * HID * INTER / ceil["fp8_matmul_flops_per_s"])
        rows.append(dict(kernel="experts", dtype=str(dtype)[6:], m=m, err=_rel(out, ref),
                         err_vs_unquantized=_rel(out, fused_experts_ref(x, w, ids, w13d, w2d)) if prefill else None,
                         fp8_us=_time_us(lambda: fused_experts(x, w, ids, w13, w2, None, (s13, s2))),
                         bf16_us=_time_us(lambda: fused_experts_triton(x, w, ids, w13d, w2d)),
                         floor_us=floor * 1e6))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--ms", default="1,16,64,128,16384")
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    ceil = ceilings()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        rows += linear_rows(dtype, ms, ceil, g) + moe_rows(dtype, ms, ceil, g)
    out = os.path.join(os.environ.get("OUT", "."), "fp8_kernels_gpu.json")
    with open(out, "w") as f:
        json.dump(dict(ceilings=ceil, rows=rows, device=torch.cuda.get_device_name()), f, indent=2)
    print(f"copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, FP8 matmul "
          f"{ceil['fp8_matmul_flops_per_s'] / 1e12:.0f} TFLOP/s, bf16 {ceil['bf16_matmul_flops_per_s'] / 1e12:.0f}")
    print(f"{'kernel':12} {'dtype':8} {'M':>6} {'err':>9} {'err unq':>8} {'fp8 us':>9} {'bf16 us':>9} "
          f"{'x bf16':>7} {'floor us':>9} {'of floor':>8}")
    for r in rows:
        unq = f"{r['err_vs_unquantized']:8.1e}" if r["err_vs_unquantized"] is not None else f"{'-':>8}"
        print(f"{r['kernel']:12} {r['dtype']:8} {r['m']:6d} {r['err']:9.1e} {unq} {r['fp8_us']:9.1f} "
              f"{r['bf16_us']:9.1f} {r['bf16_us'] / r['fp8_us']:7.2f} {r['floor_us']:9.1f} "
              f"{r['floor_us'] / r['fp8_us']:8.2f}")


if __name__ == "__main__":
    main()
