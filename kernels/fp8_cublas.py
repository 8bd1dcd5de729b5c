"""cuBLAS's block-scaled FP8 GEMM (``torch._scaled_mm``, sm_90): the operand layouts it
takes and whether this GPU and torch build run it.

``x [M, K] @ dequantize(q, scales).T`` with ``x`` quantized per token and 128 columns
(`kernels/fp8.quantize_groups`: codes ``a``, scales ``a_s [M, K/128]``) is, in cuBLAS's
terms, activation scales per 1x128 and weight scales per row and 128 columns (1x128): the
same products as the Triton kernel's. torch checks the scales' layouts: ``a_s`` M-major
(stride ``(1, M)``), the weight's ``[K/128, N]`` contiguous (its transpose N-major), M a
multiple of 4. The weight's layout is made once at load (`keep_n_major`), and only where
a trial product ran on that GPU (`block_scaled_gemm_error`): a build without it (CUDA
before 12.9, another architecture) keeps the Triton kernels.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["block_scaled_gemm_error", "keep_n_major"]


def keep_n_major(scales: torch.Tensor) -> torch.Tensor:
    """``scales`` (a 2-D weight's ``[N, KB]``, on a GPU that runs the GEMM at this shape)
    with its values also laid out N-major, ``[KB, N]`` contiguous, as ``scales.n_major``:
    made once at load so no step copies it. Returns ``scales``; a copy of ``scales`` does
    not carry it (the Triton kernels take the weight then)."""
    if hasattr(scales, "n_major"):  # kept already (use_fp8 on the device, then the load's pass)
        return scales
    if scales.dim() == 2 and scales.is_cuda and block_scaled_gemm_error(scales.device.index, *scales.shape) is None:
        scales.n_major = scales.t().contiguous()
    return scales


@functools.lru_cache(maxsize=None)
def block_scaled_gemm_error(device_index: int | None, n: int, kb: int) -> str | None:
    """None if a 32-row product with a weight of ``n`` rows and ``kb`` 128-column blocks
    runs on this GPU, else why not (the caller logs it). Called at load, never under a
    graph capture."""
    if n % 16:
        return f"{n} weight rows: cuBLAS's FP8 GEMM wants a multiple of 16"
    major = torch.cuda.get_device_capability(device_index)[0]
    if major != 9:
        return f"compute capability {major}.x: measured on sm_90 only"
    dev = torch.device("cuda", device_index)
    a = torch.zeros(32, kb * 128, device=dev).to(torch.float8_e4m3fn)
    w = torch.zeros(n, kb * 128, device=dev).to(torch.float8_e4m3fn)
    a_s = torch.ones(kb, 32, device=dev).t()  # [M, KB], stride (1, M)
    w_s = torch.ones(kb, n, device=dev)       # [KB, N]
    try:
        torch._scaled_mm(a, w.t(), scale_a=a_s, scale_b=w_s, out_dtype=torch.bfloat16)
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
        return str(e).splitlines()[0][:200]
    return None
