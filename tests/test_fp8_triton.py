"""FP8 Triton kernels (`kernels/gpu/fp8_*.py`, `moe_fp8.py`) against torch references,
on CPU under Triton's interpreter (the subprocess scheme of test_kernels_triton.py).

Inputs are fresh random float32 values; weights are quantized with the checkpoint
format's `quantize_blocks`. Each decode-mode check compares with the library reference
(weights dequantized); each prefill-mode check with a reference that quantizes the
activations the way the kernel does (`quantize_groups`), so both must agree to float32
accumulation order.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from interpreter_checks import reference_test, rel_err, results_fixture, run_kernel_checks

from phalanx.kernels.gpu.fp8_quant import f16_rows

TOL = 1e-4


def _weight(g: torch.Generator, *shape: int):
    from phalanx.kernels.fp8 import expand_block_scales, quantize_blocks

    q, blocks = quantize_blocks(torch.randn(*shape, generator=g) * 0.05)
    return q, expand_block_scales(blocks, shape[-2])


def _deq_acts(x: torch.Tensor) -> torch.Tensor:
    """x as the FP8 kernels see it once quantized per token and 128 columns."""
    from phalanx.kernels.fp8 import dequantize, quantize_groups

    q, s = quantize_groups(x)
    return dequantize(q, s, torch.float32)


def check_quantize_groups_codes_equal(g: torch.Generator) -> float:
    """Codes and scales bit-equal to torch's rounding, including values whose rounding
    carries into the exponent (the interpreter's own fp8 cast gets those wrong)."""
    from phalanx.kernels.fp8 import quantize_groups
    from phalanx.kernels.gpu.fp8_quant import quantize_groups_triton

    x = torch.randn(9, 300, generator=g) * torch.logspace(-4, 2, 300)
    x[2, :128] = torch.linspace(-448, 448, 128)  # every binade, amax exactly 448
    x[3, 5] = 125.9 * x[3, :128].abs().max() / 448  # 125.9 -> 128 after scaling
    q, s = quantize_groups_triton(x)
    rq, rs = quantize_groups(x)
    bad = (q.view(torch.uint8) != rq.view(torch.uint8)).sum() + (s != rs).sum()
    # the layout cuBLAS's block-scaled GEMM takes: the same values, rows padded to a
    # multiple of 4 with zero rows (codes 0, scale 1), the scales with stride (1, 12)
    qm, sm = quantize_groups_triton(x, m_major=True)
    bad += (qm[:9].view(torch.uint8) != rq.view(torch.uint8)).sum() + (sm[:9] != rs).sum()
    bad += (qm[9:].view(torch.uint8) != 0).sum() + (sm[9:] != 1).sum()
    bad += 0 if sm.shape == (12, rs.shape[1]) and sm.stride() == (1, 12) else 1
    return float(bad)


def check_fp8_linear_decode(g: torch.Generator) -> float:
    from phalanx.kernels.fp8 import dequantize, f16_grid, fp8_linear, fp8_linear_ref
    from phalanx.kernels.gpu.fp8_linear import fp8_linear_triton

    errs = []
    for m, n, k in [(1, 70, 200), (5, 256, 384), (16, 33, 128), (40, 64, 256)]:
        q, s = _weight(g, n, k)
        x, bias = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
        errs.append(rel_err(fp8_linear(x, q, s, bias), fp8_linear_ref(x, q, s, bias)))
        errs.append(rel_err(fp8_linear(x, q, s), fp8_linear_ref(x, q, s)))
        scaled_after = fp8_linear_triton(x, q, s, bias, config=dict(SCALE_AFTER=True, BLOCK_N=16))
        errs.append(rel_err(scaled_after, F.linear(f16_grid(x), dequantize(q, s, torch.float32), bias)))
    return max(errs)


def check_fp8_linear_prefill(g: torch.Generator) -> float:
    from phalanx.kernels.fp8 import dequantize
    from phalanx.kernels.gpu.fp8_linear import fp8_linear_triton

    errs = []
    for m, n, k in [(17, 70, 200), (130, 200, 256)]:
        q, s = _weight(g, n, k)
        x, bias = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
        ref = F.linear(_deq_acts(x), dequantize(q, s, torch.float32), bias)
        errs.append(rel_err(fp8_linear_triton(x, q, s, bias, a_fp8=True), ref))
    return max(errs)


def check_fp8_linear_split_k(g: torch.Generator) -> float:
    """K shared by 2-4 programs a tile, the last merging (4 over 3 K blocks: one program
    gets none), in both modes, with and without bias."""
    from phalanx.kernels.fp8 import dequantize, fp8_linear_ref
    from phalanx.kernels.gpu.arrivals import all_zero
    from phalanx.kernels.gpu.fp8_linear import fp8_linear_triton

    errs = []
    for (m, n, k), split in [((5, 70, 384), 2), ((40, 33, 384), 4), ((70, 64, 520), 3)]:
        q, s = _weight(g, n, k)
        x, bias = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
        cfg = dict(BLOCK_M=16 if m <= 16 else 64, BLOCK_N=16, SPLIT_K=split)
        errs.append(rel_err(fp8_linear_triton(x, q, s, bias, a_fp8=False, config=cfg),
                            fp8_linear_ref(x, q, s, bias)))
        ref = F.linear(_deq_acts(x), dequantize(q, s, torch.float32))
        errs.append(rel_err(fp8_linear_triton(x, q, s, a_fp8=True, config=cfg), ref))
    return max(errs) if all_zero() else float("inf")


def _moe_case(g: torch.Generator, t: int, e_local: int = 6, e_global: int = 8, hid: int = 200,
              inter: int = 160, top_k: int = 3):
    from phalanx.kernels.moe import make_expert_map

    x = torch.randn(t, hid, generator=g)
    ids = torch.stack([torch.randperm(e_global, generator=g)[:top_k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, top_k, generator=g), dim=-1)
    w13, s13 = _weight(g, e_local, 2 * inter, hid)
    w2, s2 = _weight(g, e_local, hid, inter)
    emap = make_expert_map(e_global, list(range(1, e_local + 1)))  # experts 0 and 7 elsewhere
    return x, w, ids, w13, s13, w2, s2, emap


def check_fused_experts_fp8_decode(g: torch.Generator) -> float:
    from phalanx.kernels.fp8 import dequantize, f16_grid
    from phalanx.kernels.gpu.moe_fp8 import fused_experts_fp8_triton
    from phalanx.kernels.moe import fused_experts, fused_experts_ref

    errs = []
    for t in (1, 4, 20, 64):
        x, w, ids, w13, s13, w2, s2, emap = _moe_case(g, t)
        out = fused_experts(x, w, ids, w13, w2, emap, (s13, s2))
        ref = fused_experts_ref(x, w, ids, dequantize(w13, s13, x.dtype), dequantize(w2, s2, x.dtype), emap)
        errs.append(rel_err(out, ref))
        scaled_after = fused_experts_fp8_triton(x, w, ids, w13, s13, w2, s2, emap,
                                                config=dict(SCALE_AFTER=True, N1=32, N2=128))
        errs.append(rel_err(scaled_after, _experts_fp8_acts_ref(x, w, ids, w13, s13, w2, s2, emap,
                                                                acts=f16_grid)))
    return max(errs)


def check_fused_experts_fp8_small_f16(g: torch.Generator) -> float:
    """The small path (<= SMALL_MAX_PAIRS pairs) with its codes dotted in float16 against
    the float32 reference over `f16_grid` activations, and bit-equal to the general path
    in the same mode with the same tiles (batch invariance across the threshold; under
    the interpreter only with equal tiles, as for bf16 stacks)."""
    from phalanx.kernels.fp8 import f16_grid
    from phalanx.kernels.gpu.moe_decode import fused_experts_small_triton
    from phalanx.kernels.gpu.moe_fp8 import fused_experts_fp8_triton

    errs = []
    for t in (1, 3):
        x, w, ids, w13, s13, w2, s2, emap = _moe_case(g, t, hid=256, inter=128)
        for split in (True, False):
            small = fused_experts_small_triton(x, w, ids, w13, w2, emap, scales=(s13, s2), fp8_f16=True,
                                               cfg=dict(N1=64, N2=64, split=split))
            errs.append(rel_err(small, _experts_fp8_acts_ref(x, w, ids, w13, s13, w2, s2, emap,
                                                             acts=f16_grid)))
            general = fused_experts_fp8_triton(x, w, ids, w13, s13, w2, s2, emap,
                                               config=dict(SCALE_AFTER=True, N1=64, N2=64))
            errs.append(0.0 if torch.equal(small, general) else 1.0)
    return max(errs)


def check_f16_grid_exact_for_16_bit_values(g: torch.Generator) -> float:
    """`f16_grid` (the SCALE_AFTER mode's activations) keeps bf16 and fp16 values as they
    are, across 40 binades in a row; the Triton `f16_rows` gives the same float16 values."""
    from phalanx.kernels.fp8 import f16_grid

    sign = torch.randint(0, 2, (6, 256), generator=g) * 2.0 - 1.0
    x = sign * torch.exp2(torch.rand(6, 256, generator=g) * 26 - 26)  # 26 binades in a row
    x[1] *= 2.0 ** 100
    x[2] *= 2.0 ** -100
    x[3, :128] = 0.0
    x[4:] *= 2.0 ** 6  # 2^-20 .. 2^6: fp16's range (rows 4-5 also run as fp16)
    errs = []
    for dtype in (torch.bfloat16, torch.float16):
        v = x[4:] if dtype == torch.float16 else x
        v = v.to(dtype).float()
        errs.append(float((f16_grid(v) != v).sum()))
        y = torch.empty_like(v[:, :128])
        _f16_rows_kernel[(v.shape[0],)](v[:, :128].contiguous(), y, K=128)
        errs.append(float((y != f16_grid(v)[:, :128]).sum()))
    return max(errs)


@triton.jit
def _f16_rows_kernel(x_ptr, y_ptr, K: tl.constexpr):
    r = tl.program_id(0)
    a16, p = f16_rows(tl.load(x_ptr + r * K + tl.arange(0, K))[None, :])
    tl.store(y_ptr + r * K + tl.arange(0, K)[None, :], a16.to(tl.float32) * p[:, None])


def _experts_fp8_acts_ref(x, w, ids, w13, s13, w2, s2, emap, acts=None) -> torch.Tensor:
    """The prefill mode's arithmetic: x and silu(g) * u quantized per 128 columns
    (`acts`: another rounding of both, e.g. `f16_grid`)."""
    from phalanx.kernels.fp8 import dequantize

    _deq = acts or _deq_acts
    w13d, w2d = dequantize(w13, s13, torch.float32), dequantize(w2, s2, torch.float32)
    xq = _deq(x)
    out = torch.zeros_like(x)
    local = emap[ids]
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(local[t, slot])
            if e < 0:
                continue
            gu = w13d[e] @ xq[t]
            gate, up = gu.chunk(2)
            h = _deq((F.silu(gate) * up)[None])[0]
            out[t] += (w2d[e] @ h) * w[t, slot]
    return out


def check_fused_experts_fp8_prefill(g: torch.Generator) -> float:
    from phalanx.kernels.gpu.moe_fp8 import fused_experts_fp8_triton

    errs = []
    for t in (3, 40):
        x, w, ids, w13, s13, w2, s2, emap = _moe_case(g, t)
        out = fused_experts_fp8_triton(x, w, ids, w13, s13, w2, s2, emap, a_fp8=True)
        errs.append(rel_err(out, _experts_fp8_acts_ref(x, w, ids, w13, s13, w2, s2, emap)))
    return max(errs)


def check_fused_experts_fp8_weight_rows(g: torch.Generator) -> float:
    """`moe_fp8_decode` (the weight rows as the MMA's M, FP8 activations) against the
    prefill mode's arithmetic, several tiles and token counts that leave padding rows;
    through `moe_fp8`'s switch too."""
    from phalanx.kernels.gpu import moe_fp8
    from phalanx.kernels.gpu.moe_fp8_decode import fused_experts_fp8_decode_triton

    errs = []
    for t, cfg in ((1, {}), (7, dict(N2=64)), (24, dict(BLOCK_T=32, stages=2))):
        x, w, ids, w13, s13, w2, s2, emap = _moe_case(g, t, hid=256, inter=256)
        ref = _experts_fp8_acts_ref(x, w, ids, w13, s13, w2, s2, emap)
        errs.append(rel_err(fused_experts_fp8_decode_triton(x, w, ids, w13, s13, w2, s2, emap, config=cfg), ref))
    # the switch takes every 16-bit decode batch, the small path's (T = 1 here) too
    small = _moe_case(g, 1, hid=256, inter=256)
    for xc, wc, idc, *rest in ((x, w, ids, w13, s13, w2, s2, emap), small):
        xb = xc.to(torch.bfloat16)
        moe_fp8.DECODE_WEIGHT_ROWS = {}
        try:
            switched = moe_fp8.fused_experts_fp8_triton(xb, wc, idc, *rest)
        finally:
            moe_fp8.DECODE_WEIGHT_ROWS = False
        errs.append(0.0 if torch.equal(switched, fused_experts_fp8_decode_triton(xb, wc, idc, *rest)) else 1.0)
    return max(errs)


def check_fused_experts_fp8_even_equal(g: torch.Generator) -> float:
    """The experts' EVEN tiles (no masks, the row strides as constants; a config key for
    the GPU to rank) give the default tiles' bits, prefill (FP8 dots) and decode (codes
    dotted in float16) modes, at shapes that divide the tiles; 1.0 if any differs."""
    from phalanx.kernels.gpu.moe_fp8 import fused_experts_fp8_triton

    bad = 0
    for t, a_fp8, mode in ((40, True, {}), (5, False, dict(SCALE_AFTER=True)), (5, False, {})):
        x, w, ids, w13, s13, w2, s2, emap = _moe_case(g, t, hid=256, inter=128)
        run = [fused_experts_fp8_triton(x, w, ids, w13, s13, w2, s2, emap, a_fp8=a_fp8,
                                        config=dict(mode, **even)) for even in ({}, dict(EVEN=True))]
        bad += 0 if torch.equal(*run) else 1
    return float(bad)


if __name__ == "__main__":
    run_kernel_checks(globals())

interpreter_results = results_fixture(__file__)
test_fp8_kernel_matches_reference = reference_test(globals(), TOL)
