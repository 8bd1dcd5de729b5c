"""Triton FP8 experts at decode batches with the weight rows as the MMA's M and FP8
activations: FP8 tensor-core dots on the codes as they are.

At 4-8 rows an expert the token rows cannot fill a Hopper ``wgmma`` (64 rows a warp
group); on a 16-row token tile Triton lowers a dot to ``mma.sync``, so `moe_fp8`'s decode
tiles convert every code (to float16, `fp8_block_dot`'s SCALE_AFTER). Here each program
computes the transposed tile ``acc[n, t] = w[e][n, :] . x[t, :]`` over ``BLOCK_N`` weight
rows (the MMA's M) and ``BLOCK_T`` = 16 token rows (its N): ``wgmma`` e4m3, the codes going
from global to shared memory to the tensor cores with no per-code instruction.

Arithmetic: `moe_fp8`'s prefill mode (`fp8_block_dot` with A_FP8): activations quantized
per token and 128-column group first (`fp8_quant`, one launch), each K block's dot scaled
by the activation scale, then the weight scale, and added in float32; gate_up quantizes
``silu(g) * u`` per row and 128 columns for down (its N tile is one group). Same align
(`moe._align`, rows of ``BLOCK_T``) and deterministic combine (`moe._combine_kernel`) as
the other paths.

One H100, 24 layers (bench/NOTES.md): 1.008-1.014x the decode tiles in the decode step at
batch 16-128 (down 8% faster, gate_up level), at 2.5x their error against the float32
reference; the same transposed tiles with the codes in float16 (wgmma taking the
converted weights from registers) lost 3-4%. A candidate for the H200, whose copy rate
outruns per-code conversion (`moe_fp8.DECODE_WEIGHT_ROWS`).

Contract: :func:`phalanx.kernels.moe.fused_experts` with ``w13_scale`` / ``w2_scale``, up to
the activations' FP8 rounding (about 2**-4 relative per element, averaging out over K).
No host sync: CUDA-graph capturable; no specialisation on ``P`` (engine/warmup.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_linear import scales_ahead
from .fp8_quant import FP8_MAX, GROUP, quantize_group_tile, quantize_groups_triton
from .moe import _align, block_pairs, combine_pairs

__all__ = ["fused_experts_fp8_decode_triton", "decode_config"]


@triton.jit(do_not_specialize=["P"])
def _gate_up_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, inter_ptr, is_ptr, sorted_ptr, bexp_ptr,
    P, K_TOP, HID, I, E, sx_t, sxs_t, sw_e, sw_n, sws_e, sws_n, si_r, sis_r,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8_MAX_C: tl.constexpr,
):
    # x: FP8 codes [T, HID] with scales [T, HID/128]; w13[e] is [2I, HID] (gate rows
    # 0..I-1, up rows I..2I-1), scales [2I, HID/128]. Tile [BLOCK_N weight rows, BLOCK_T
    # tokens]; BLOCK_N = 128: one group of inter's row.
    b = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.load(bexp_ptr + b).to(tl.int64)
    if e >= E:
        return
    rows, pair, rm = block_pairs(sorted_ptr, b, P, BLOCK_T)
    tok = tl.where(rm, pair // K_TOP, 0).to(tl.int64)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < I
    kk = tl.arange(0, BLOCK_K)
    x_cols = x_ptr + tok[None, :] * sx_t
    w_gate = w_ptr + e * sw_e + n[:, None].to(tl.int64) * sw_n
    w_up = w_gate + I * sw_n
    s_gate = ws_ptr + e * sws_e + n.to(tl.int64) * sws_n
    s_up = s_gate + I * sws_n
    acc_g = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    # the scales a K block ahead: they meet the dot's sum, and Triton pipelines only the
    # loads that feed a dot
    xs_next = scales_ahead(xs_ptr + tok * sxs_t, 0, rm, HID, BLOCK_K, True)
    sg_next = scales_ahead(s_gate, 0, nm, HID, BLOCK_K, True)
    su_next = scales_ahead(s_up, 0, nm, HID, BLOCK_K, True)
    for kb in range(0, tl.cdiv(HID, BLOCK_K)):
        xs, sg, su = xs_next, sg_next, su_next
        xs_next = scales_ahead(xs_ptr + tok * sxs_t, kb + 1, rm, HID, BLOCK_K, True)
        sg_next = scales_ahead(s_gate, kb + 1, nm, HID, BLOCK_K, True)
        su_next = scales_ahead(s_up, kb + 1, nm, HID, BLOCK_K, True)
        k = kb * BLOCK_K + kk
        km = k < HID
        xq = tl.load(x_cols + k[:, None], mask=rm[None, :] & km[:, None], other=0.0)  # [BLOCK_K, BLOCK_T]
        wm = nm[:, None] & km[None, :]
        wg = tl.load(w_gate + k[None, :], mask=wm, other=0.0)  # [BLOCK_N, BLOCK_K] codes
        wu = tl.load(w_up + k[None, :], mask=wm, other=0.0)
        acc_g += tl.dot(wg, xq) * xs[None, :] * sg[:, None]
        acc_u += tl.dot(wu, xq) * xs[None, :] * su[:, None]
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # quantized per row and 128 columns for down
    q, scale = quantize_group_tile(h, FP8_MAX_C, 0)
    tl.store(inter_ptr + rows[None, :].to(tl.int64) * si_r + n[:, None], q, mask=rm[None, :] & nm[:, None])
    tl.store(is_ptr + rows.to(tl.int64) * sis_r + nb, scale, mask=rm)


@triton.jit(do_not_specialize=["P"])
def _down_kernel(
    inter_ptr, is_ptr, w_ptr, ws_ptr, pair_out_ptr, sorted_ptr, bexp_ptr, tw_ptr,
    P, HID, I, E, si_r, sis_r, sw_e, sw_n, sws_e, sws_n, so_r,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # w2[e] is [HID, I], scales [HID, I/128]. Output row = pair id, scaled by its weight.
    b = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.load(bexp_ptr + b).to(tl.int64)
    if e >= E:
        return
    rows, pair, rm = block_pairs(sorted_ptr, b, P, BLOCK_T)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < HID
    kk = tl.arange(0, BLOCK_K)
    a_cols = inter_ptr + rows[None, :].to(tl.int64) * si_r  # a padding row of inter: never written
    a_s_rows = is_ptr + rows.to(tl.int64) * sis_r
    w_rows = w_ptr + e * sw_e + n[:, None].to(tl.int64) * sw_n
    s_rows = ws_ptr + e * sws_e + n.to(tl.int64) * sws_n
    acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    w_s_next = scales_ahead(s_rows, 0, nm, I, BLOCK_K, True)
    a_s_next = scales_ahead(a_s_rows, 0, rm, I, BLOCK_K, True)
    for kb in range(0, tl.cdiv(I, BLOCK_K)):
        w_s, a_s = w_s_next, a_s_next
        w_s_next = scales_ahead(s_rows, kb + 1, nm, I, BLOCK_K, True)
        a_s_next = scales_ahead(a_s_rows, kb + 1, rm, I, BLOCK_K, True)
        k = kb * BLOCK_K + kk
        km = k < I
        a = tl.load(a_cols + k[:, None], mask=rm[None, :] & km[:, None], other=0.0)  # [BLOCK_K, BLOCK_T]
        w = tl.load(w_rows + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        acc += tl.dot(w, a) * a_s[None, :] * w_s[:, None]
    ty = pair_out_ptr.dtype.element_ty
    wt = tl.load(tw_ptr + pair, mask=rm, other=0.0).to(ty).to(tl.float32)
    h = acc.to(ty).to(tl.float32) * wt[None, :]
    tl.store(pair_out_ptr + pair[None, :].to(tl.int64) * so_r + n[:, None], h.to(ty),
             mask=rm[None, :] & nm[:, None])


_CONFIG = dict(BLOCK_T=16, N2=128, warps=4, stages=3)


def decode_config() -> dict:
    """The default tiles (a copy): BLOCK_T token rows, N2 down's weight rows a program
    (gate_up's are one 128-column group), warps, stages."""
    return dict(_CONFIG)


def fused_experts_fp8_decode_triton(x, topk_weights, topk_ids, w13, w13_scale, w2, w2_scale,
                                    expert_map=None, *, config: dict | None = None) -> torch.Tensor:
    """SwiGLU experts over FP8 stacks with FP8 activations; see the module docstring.
    ``config`` overrides :func:`decode_config`'s keys."""
    T, hid = x.shape
    if T == 0:
        return x.new_zeros((0, hid))
    E, two_i, _ = w13.shape
    inter_dim = two_i // 2
    k_top = topk_ids.shape[1]
    P = T * k_top
    cfg = dict(_CONFIG, **(config or {}))
    bt = cfg["BLOCK_T"]
    ids = topk_ids.reshape(-1)
    ids = (expert_map[ids] if expert_map is not None else ids).to(torch.int32)
    sorted_ids, block_expert, max_blocks = _align(ids, E, bt)
    x = x if x.stride(-1) == 1 else x.contiguous()
    xq, xs = quantize_groups_triton(x)
    inter = torch.empty((max_blocks * bt, inter_dim), dtype=w13.dtype, device=x.device)
    inter_s = torch.empty((max_blocks * bt, triton.cdiv(inter_dim, GROUP)), dtype=torch.float32,
                          device=x.device)
    launch = dict(BLOCK_T=bt, BLOCK_K=GROUP, num_warps=cfg["warps"], num_stages=cfg["stages"])
    _gate_up_kernel[(max_blocks, triton.cdiv(inter_dim, GROUP))](
        xq, xs, w13, w13_scale, inter, inter_s, sorted_ids, block_expert,
        P, k_top, hid, inter_dim, E, xq.stride(0), xs.stride(0), w13.stride(0), w13.stride(1),
        w13_scale.stride(0), w13_scale.stride(1), inter.stride(0), inter_s.stride(0),
        BLOCK_N=GROUP, FP8_MAX_C=FP8_MAX, **launch,
    )
    pair_out = x.new_empty((P, hid))
    _down_kernel[(max_blocks, triton.cdiv(hid, cfg["N2"]))](
        inter, inter_s, w2, w2_scale, pair_out, sorted_ids, block_expert,
        topk_weights.reshape(-1).contiguous(),
        P, hid, inter_dim, E, inter.stride(0), inter_s.stride(0), w2.stride(0), w2.stride(1),
        w2_scale.stride(0), w2_scale.stride(1), pair_out.stride(0),
        BLOCK_N=cfg["N2"], **launch,
    )
    return combine_pairs(pair_out, ids, T, k_top, E, x.dtype)
