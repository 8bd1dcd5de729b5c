"""Triton MoE experts over block-scaled FP8 weights: the sorted grouped GEMMs of
:mod:`phalanx.kernels.gpu.moe` with FP8 weight tiles.

Small batches (``T * k <= moe.SMALL_MAX_PAIRS``) take `moe_decode`'s two-launch path with
its weight tiles dequantized the same way.

Contract: :func:`phalanx.kernels.moe.fused_experts` with ``w13_scale`` / ``w2_scale``
(the reference dequantizes the stacks, `kernels/fp8.py`). Same steps as the bf16 path
(align, gate_up with SwiGLU, down scaled by the routing weight, deterministic combine:
`moe._align` and `moe.combine_pairs` are shared); the GEMMs read ``w13 [E, 2I, H]`` and
``w2 [E, H, I]`` as ``float8_e4m3fn`` codes with per-row scales ``[E, rows, ceil(K/128)]``
over K blocks of 128. Two modes, chosen from the rows per expert:

* decode (``BLOCK_M`` 16), and float32 compute: weights dequantized in registers exactly as the reference
  does, dotted with the activations as they are (bound by the weight stream, which FP8
  halves); every rounding as in the bf16 kernels;
  or (``SCALE_AFTER``) the codes dotted in float16 with the activations on the float16
  grid (exact for bf16) and each 128-column block's sum scaled: the reference's products
  without its rounding of each weight to bf16;
* prefill (more rows per expert, bf16/fp16): FP8 tensor-core dots. ``x`` is quantized per token
  and 128-column group once (`fp8_quant`); gate_up's epilogue quantizes ``silu(g) * u``
  per row and 128 columns (its N tile is one group), so down reads FP8 too.

No host sync: CUDA-graph capturable; no specialisation on ``P`` (engine/warmup.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import dot_precision
from .fp8_linear import fp8_block_dot, scales_ahead
from .fp8_quant import FP8_MAX, GROUP, quantize_group_tile, quantize_groups_triton
from . import moe_decode, moe_fp8_decode
from .moe import SMALL_MAX_PAIRS, _align, block_pairs, combine_pairs

__all__ = ["fused_experts_fp8_triton"]


@triton.jit
def _load(ptrs, mask, EVEN: tl.constexpr):
    """The values at ``ptrs``, 0 where ``mask`` is false; with EVEN (the shapes divide the
    tiles and every row pointer is in bounds) unmasked."""
    if EVEN:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit(do_not_specialize=["P"])
def _fp8_gate_up_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, inter_ptr, is_ptr, sorted_ptr, bexp_ptr,
    P, K_TOP, HID, I, E, sx_t, sxs_t, sw_e, sw_n, sws_e, sws_n, si_r, sis_r,
    A_FP8: tl.constexpr, SCALE_AFTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREC: tl.constexpr, FP8_MAX_C: tl.constexpr, EVEN: tl.constexpr, SW_N: tl.constexpr, SWS_N: tl.constexpr,
):
    # w13[e] is [2I, HID] (gate rows 0..I-1, up rows I..2I-1); scales [2I, HID/128].
    b = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.load(bexp_ptr + b).to(tl.int64)
    if e >= E:
        return
    rows, pair, rm = block_pairs(sorted_ptr, b, P, BLOCK_M)
    if EVEN:  # `_load`: a padding row reads token 0 (never stored); strides as constants
        tok = tl.where(rm, pair // K_TOP, 0).to(tl.int64)
        w_n, s_n = SW_N, SWS_N
    else:
        tok = (pair // K_TOP).to(tl.int64)
        w_n, s_n = sw_n, sws_n
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < I
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tok[:, None] * sx_t
    w_gate = w_ptr + e * sw_e + n[None, :].to(tl.int64) * w_n
    w_up = w_gate + I * w_n
    s_gate = ws_ptr + e * sws_e + n.to(tl.int64) * s_n
    s_up = s_gate + I * s_n
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    sg_ahead = scales_ahead(s_gate, 0, nm, HID, BLOCK_K, SCALE_AFTER)
    su_ahead = scales_ahead(s_up, 0, nm, HID, BLOCK_K, SCALE_AFTER)
    for kb in range(0, tl.cdiv(HID, BLOCK_K)):
        k = kb * BLOCK_K + kk
        km = k < HID
        a = _load(x_rows + k[None, :], rm[:, None] & km[None, :], EVEN)
        a_s = _load(xs_ptr + tok * sxs_t + kb, rm, EVEN) if A_FP8 else rm
        wm = km[:, None] & nm[None, :]
        wg = _load(w_gate + k[:, None], wm, EVEN)
        wu = _load(w_up + k[:, None], wm, EVEN)
        if SCALE_AFTER:  # this block's scales came a block ahead; load the next block's
            sg, su = sg_ahead, su_ahead
            sg_ahead = scales_ahead(s_gate, kb + 1, nm, HID, BLOCK_K, True)
            su_ahead = scales_ahead(s_up, kb + 1, nm, HID, BLOCK_K, True)
        else:
            sg = _load(s_gate + kb, nm, EVEN)
            su = _load(s_up + kb, nm, EVEN)
        acc_g = fp8_block_dot(acc_g, a, a_s, wg, sg, A_FP8, SCALE_AFTER, PREC)
        acc_u = fp8_block_dot(acc_u, a, a_s, wu, su, A_FP8, SCALE_AFTER, PREC)
    out_rows = inter_ptr + rows[:, None].to(tl.int64) * si_r + n[None, :]
    if A_FP8:  # BLOCK_N is one 128-column group: quantize silu(g) * u for down
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        q, scale = quantize_group_tile(h, FP8_MAX_C)
        tl.store(out_rows, q, mask=rm[:, None] & nm[None, :])
        tl.store(is_ptr + rows.to(tl.int64) * sis_r + nb, scale, mask=rm)
    else:
        ty = inter_ptr.dtype.element_ty
        g = acc_g.to(ty).to(tl.float32)
        u = acc_u.to(ty).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)
        tl.store(out_rows, (s * u).to(ty), mask=rm[:, None] & nm[None, :])


@triton.jit(do_not_specialize=["P"])
def _fp8_down_kernel(
    inter_ptr, is_ptr, w_ptr, ws_ptr, pair_out_ptr, sorted_ptr, bexp_ptr, tw_ptr,
    P, HID, I, E, si_r, sis_r, sw_e, sw_n, sws_e, sws_n, so_r,
    A_FP8: tl.constexpr, SCALE_AFTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREC: tl.constexpr, EVEN: tl.constexpr, SW_N: tl.constexpr, SWS_N: tl.constexpr,
):
    # w2[e] is [HID, I]; scales [HID, I/128]. Output row = pair id, scaled by its weight.
    b = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.load(bexp_ptr + b).to(tl.int64)
    if e >= E:
        return
    rows, pair, rm = block_pairs(sorted_ptr, b, P, BLOCK_M)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < HID
    kk = tl.arange(0, BLOCK_K)
    a_rows = inter_ptr + rows[:, None].to(tl.int64) * si_r
    if EVEN:  # `_load`; a padding row of `inter` (unwritten) stays in its own row, never stored
        w_rows = w_ptr + e * sw_e + n[None, :].to(tl.int64) * SW_N
        s_rows = ws_ptr + e * sws_e + n.to(tl.int64) * SWS_N
    else:
        w_rows = w_ptr + e * sw_e + n[None, :].to(tl.int64) * sw_n
        s_rows = ws_ptr + e * sws_e + n.to(tl.int64) * sws_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    s_ahead = scales_ahead(s_rows, 0, nm, I, BLOCK_K, SCALE_AFTER)
    for kb in range(0, tl.cdiv(I, BLOCK_K)):
        k = kb * BLOCK_K + kk
        km = k < I
        a = _load(a_rows + k[None, :], rm[:, None] & km[None, :], EVEN)
        a_s = _load(is_ptr + rows.to(tl.int64) * sis_r + kb, rm, EVEN) if A_FP8 else rm
        w = _load(w_rows + k[:, None], km[:, None] & nm[None, :], EVEN)
        if SCALE_AFTER:  # as in gate_up: the scales a block ahead
            w_s = s_ahead
            s_ahead = scales_ahead(s_rows, kb + 1, nm, I, BLOCK_K, True)
        else:
            w_s = _load(s_rows + kb, nm, EVEN)
        acc = fp8_block_dot(acc, a, a_s, w, w_s, A_FP8, SCALE_AFTER, PREC)
    ty = pair_out_ptr.dtype.element_ty
    wt = tl.load(tw_ptr + pair, mask=rm, other=0.0).to(ty).to(tl.float32)
    h = acc.to(ty).to(tl.float32) * wt[:, None]
    tl.store(pair_out_ptr + pair[:, None].to(tl.int64) * so_r + n[None, :], h.to(ty),
             mask=rm[:, None] & nm[None, :])


# Decode (<= 16 rows an expert; the small path too, so a token's bits do not depend on
# which side of its threshold the batch falls): the codes dotted in float16
# and each block's sum scaled (`fp8_block_dot`'s SCALE_AFTER) instead of each code
# dequantized as the reference does: per code half a conversion instead of 1.5 conversions
# and a multiply (sm_90 SASS of gate_up: F2FP + HADD2 + FMUL 880 -> 296 a K block). One
# H100, 24 layers, with the scales a block ahead: 1.017x the dequantizing tiles at batch
# 64, 0.99x at batch 1 (the small path), tokens agreeing with the bf16 twin as often or
# more (bench/NOTES.md); `decode_gpu.py --quantization fp8 --baselines fp8dequant` runs
# the dequantizing tiles beside it.
DECODE_F16 = True

# Every 16-bit decode batch (the small path's too, so that a token's bits do not depend
# on its batch) with the weight rows as the MMA's M and FP8 activations
# (`moe_fp8_decode`, wgmma on the codes): False, True (its defaults) or its config keys.
# Off: 1.008-1.014x on one H100 at batch 16-128, at 2.5x the error; for an H200 to rank
# (`decode_gpu.py --quantization fp8 --baselines fp8wrows`, batch 1 included).
DECODE_WEIGHT_ROWS: dict | bool = False

# Down's own decode tile keys (N2, warps2, stages2) over the decode config's, which gives
# down (codes in float16) 64-row N tiles and 4 stages: one H100, 24 layers, 1.005-1.009x
# the decode step of N2 128 with 3 stages at batch 16-128, down 1,883 against 1,946 µs a
# step at 64 (bench/NOTES.md). `decode_gpu.py --baselines fp8down128` runs the old tile.
DECODE_DOWN: dict = {}


def _config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> dict:
    """Decode (few rows per expert) and float32 compute: dequantize-in-register tiles
    (the codes in float16 with `DECODE_F16`, not for float32); prefill: FP8 dots, gate_up's
    N tile one 128-column group (it quantizes its output per group). Tiles: the fastest
    of bench/probes/fp8_tiles.py on one H200 (bench/NOTES.md)."""
    if num_pairs / max(1, num_experts) <= 16 or dtype == torch.float32:
        f16 = DECODE_F16 and dtype != torch.float32
        down = {"N2": 64, "stages2": 4, **DECODE_DOWN} if f16 else {"N2": 128}  # measured in the float16 mode
        return dict(A_FP8=False, SCALE_AFTER=f16, BLOCK_M=16, N1=128, warps=4, stages=3, **down)
    return dict(A_FP8=True, SCALE_AFTER=False, BLOCK_M=64, N1=GROUP, N2=256, warps=8, stages=3)


def _even(cfg: dict, k: int, rows: int, n_tile: int, w: torch.Tensor, ws: torch.Tensor) -> dict:
    """The launch keys of config keys ``EVEN`` (loads without masks and the weight's row
    strides as constants, where K is whole 128-column blocks and an expert's `rows` (per
    gate / up / down) whole N tiles) and ``maxnreg`` (a register cap per thread). Both off
    by default: candidates for the prefill tiles, for a GPU to rank (bench/NOTES.md)."""
    on = bool(cfg.get("EVEN", False)) and k % GROUP == 0 and rows % n_tile == 0
    keys = dict(EVEN=on, SW_N=w.stride(1) if on else 0, SWS_N=ws.stride(1) if on else 0)
    return dict(keys, maxnreg=cfg["maxnreg"]) if "maxnreg" in cfg else keys


def fused_experts_fp8_triton(x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale,
                             expert_map=None, *, a_fp8: bool | None = None,
                             config: dict | None = None) -> torch.Tensor:
    """SwiGLU experts over FP8 stacks; see the module docstring. ``a_fp8`` forces the
    mode (None: from the rows per expert); ``config`` overrides `_config`'s keys
    (``warps2`` / ``stages2``: down's own, else gate_up's)."""
    T, hid = x.shape
    if T == 0:
        return x.new_zeros((0, hid))
    E, two_i, _ = w13.shape
    inter_dim = two_i // 2
    k_top = topk_ids.shape[1]
    P = T * k_top
    rows_cfg = DECODE_WEIGHT_ROWS
    weight_rows = rows_cfg is not False and x.dtype != torch.float32 and a_fp8 is None and config is None
    if P <= SMALL_MAX_PAIRS and not a_fp8 and config is None and not weight_rows:
        return moe_decode.fused_experts_small_triton(x, topk_weights, topk_ids, w13, w2, expert_map,
                                                     scales=(w13_scale, w2_scale),
                                                     fp8_f16=DECODE_F16 and x.dtype != torch.float32)
    cfg = _config(P, E, x.dtype)
    if weight_rows and not cfg["A_FP8"]:
        return moe_fp8_decode.fused_experts_fp8_decode_triton(x, topk_weights, topk_ids, w13, w13_scale,
                                                              w2, w2_scale, expert_map,
                                                              config=rows_cfg if isinstance(rows_cfg, dict) else None)
    ids = topk_ids.reshape(-1)
    ids = (expert_map[ids] if expert_map is not None else ids).to(torch.int32)
    if a_fp8 is not None:
        cfg = dict(cfg, A_FP8=a_fp8, **(dict(N1=GROUP) if a_fp8 else {}))
    cfg.update(config or {})
    bm = cfg["BLOCK_M"]
    sorted_ids, block_expert, max_blocks = _align(ids, E, bm)
    x = x if x.stride(-1) == 1 else x.contiguous()
    prec = dot_precision(x.dtype)
    if cfg["A_FP8"]:
        a, a_s = quantize_groups_triton(x)
        inter = torch.empty((max_blocks * bm, inter_dim), dtype=w13.dtype, device=x.device)
        inter_s = torch.empty((max_blocks * bm, triton.cdiv(inter_dim, GROUP)), dtype=torch.float32,
                              device=x.device)
    else:
        a, a_s = x, w13_scale  # a_s unused
        inter = x.new_empty((max_blocks * bm, inter_dim))
        inter_s = inter
    _fp8_gate_up_kernel[(max_blocks, triton.cdiv(inter_dim, cfg["N1"]))](
        a, a_s, w13, w13_scale, inter, inter_s, sorted_ids, block_expert,
        P, k_top, hid, inter_dim, E, a.stride(0), a_s.stride(0), w13.stride(0), w13.stride(1),
        w13_scale.stride(0), w13_scale.stride(1), inter.stride(0), inter_s.stride(0),
        A_FP8=cfg["A_FP8"], SCALE_AFTER=cfg["SCALE_AFTER"], BLOCK_M=bm, BLOCK_N=cfg["N1"], BLOCK_K=GROUP, PREC=prec, FP8_MAX_C=FP8_MAX,
        num_warps=cfg["warps"], num_stages=cfg["stages"], **_even(cfg, hid, inter_dim, cfg["N1"], w13, w13_scale),
    )
    pair_out = x.new_empty((P, hid))
    weights = topk_weights.reshape(-1).contiguous()
    _fp8_down_kernel[(max_blocks, triton.cdiv(hid, cfg["N2"]))](
        inter, inter_s, w2, w2_scale, pair_out, sorted_ids, block_expert, weights,
        P, hid, inter_dim, E, inter.stride(0), inter_s.stride(0), w2.stride(0), w2.stride(1),
        w2_scale.stride(0), w2_scale.stride(1), pair_out.stride(0),
        A_FP8=cfg["A_FP8"], SCALE_AFTER=cfg["SCALE_AFTER"], BLOCK_M=bm, BLOCK_N=cfg["N2"], BLOCK_K=GROUP, PREC=prec,
        num_warps=cfg.get("warps2", cfg["warps"]), num_stages=cfg.get("stages2", cfg["stages"]),
        **_even(cfg, inter_dim, hid, cfg["N2"], w2, w2_scale),
    )
    return combine_pairs(pair_out, ids, T, k_top, E, x.dtype)
