"""Triton MoE experts for small batches (decode): per-pair MMA tiles, combine fused, 2 launches.

Contract: :func:`phalanx.kernels.moe.fused_experts_ref`, as :mod:`phalanx.kernels.gpu.moe`
(which dispatches here when the number of (token, slot) pairs ``P = T * k`` is at most
``SMALL_MAX_PAIRS``; see there). No sort, no alignment, no separate combine:

1. ``_small_gate_up_kernel``, grid ``(P, cdiv(I, N1))``: program ``(p, nb)`` takes pair
   ``p = t * k + slot``, its local expert ``e`` (``expert_map[topk_ids[t, slot]]`` read
   in the kernel, so no torch gather launch), and computes gate and up rows
   ``nb*N1 ..`` of ``w13[e] @ x[t]`` over the whole hidden dim, then
   ``silu(gate) * up`` into ``inter[p]``. A pair whose local expert is outside
   ``[0, E)`` writes nothing (its ``inter`` row is never read).
2. ``_small_down_kernel``, grid ``(T, cdiv(H, N2))``: program ``(t, nb)`` loops over
   the token's slots in slot order, skips the non-local ones, computes its rows of
   ``w2[e] @ inter[p]`` scaled by the routing weight and adds them to a float32
   accumulator, then stores ``out[t]``: deterministic, no atomics, no ``pair_out``.

The same roundings as the general path (each linear's output, ``silu(gate)``,
``silu * up``, ``h * w`` rounded to ``x.dtype``; the slot sum in float32, one rounding),
and the same arithmetic: ``tl.dot`` on a 16-row tile whose row 0 is the pair's vector
(rows 1..15 are masked zeros), ``K`` tiles in the same order as the general path's
BLOCK_M=16 config. Each output element is then computed by the same MMA / FMA sequence
as in the general path (an MMA's per-element result depends neither on the other rows
nor on the N tiling), so a token gives the same bits on either side of the dispatch
threshold, i.e. alone or in a batch. ``bench/kernels_gpu.py`` checks this bit-for-bit on
the GPU. (Under Triton's interpreter, ``tl.dot`` is numpy's BLAS, whose per-element
order does depend on the tile's N and K: there the bits match the general path only with
its tiles, ``N1=N2=64, K1=K2=128``.) A GEMV's schedule instead (FMA rows over the whole K
in flight at once, no tensor cores) lost at one token in the 48-layer decode step on one
H100: 231 against 311 tok/s (bench/NOTES.md, thirty-third session), and was removed.

With ``split`` (the default) step 2 runs one program per (pair, H-tile)
instead (``_small_down_pair_kernel``), and the last pair of a token's tile to finish sums
the token's slots in slot order (an arrival counter, `arrivals.py`).

Nothing here syncs with the host: grids come from shapes only (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arrivals import arrival_counts
from .attention import dot_precision
from .fp8_linear import fp8_block_dot, scales_ahead
from .pdl import gdc_launch_dependents, gdc_wait, pdl_enabled, pdl_launch

__all__ = ["fused_experts_small_triton", "small_config"]

_ROWS = 16  # padded M of the MMA tile (tl.dot needs >= 16 rows); only row 0 is real


@triton.jit
def _local_expert(ids_ptr, emap_ptr, p, HAS_MAP: tl.constexpr):
    e = tl.load(ids_ptr + p).to(tl.int64)
    if HAS_MAP:
        e = tl.load(emap_ptr + e).to(tl.int64)
    return e


@triton.jit
def _small_gate_up_kernel(
    x_ptr, ids_ptr, emap_ptr, w_ptr, inter_ptr, ws_ptr,
    K_TOP, HID, I, E, sx_t, sw_e, sw_n, si_p, sws_e, sws_n,
    HAS_MAP: tl.constexpr, ROWS: tl.constexpr, FP8: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr,
):
    # w13[e] is [2I, HID] (gate rows 0..I-1, up rows I..2I-1), HID contiguous. PDL
    # (kernels/gpu/pdl.py): launched dependent; wait for the previous kernel first.
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    p = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    e = _local_expert(ids_ptr, emap_ptr, p, HAS_MAP)
    if (e < 0) | (e >= E):  # not held here: inter[p] is never read
        return
    tok = p // K_TOP
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < I
    kk = tl.arange(0, BLOCK_K)
    x_row = x_ptr + tok * sx_t
    w_gate = w_ptr + e * sw_e + n.to(tl.int64) * sw_n  # [BLOCK_N] row starts
    w_up = w_gate + I * sw_n
    ty = inter_ptr.dtype.element_ty
    r = tl.arange(0, ROWS)
    r0 = (r == 0)[:, None]
    acc_g = tl.zeros([ROWS, BLOCK_N], tl.float32)
    acc_u = tl.zeros([ROWS, BLOCK_N], tl.float32)
    s_gate = ws_ptr + e * sws_e + n.to(tl.int64) * sws_n  # FP8: the tile rows' scales per K block
    s_up = s_gate + I * sws_n
    sg = scales_ahead(s_gate, 0, nm, HID, BLOCK_K, FP8 == 2)
    su = scales_ahead(s_up, 0, nm, HID, BLOCK_K, FP8 == 2)
    for k0 in range(0, HID, BLOCK_K):
        k = k0 + kk
        km = k < HID
        a = tl.load(x_row + r[:, None] * 0 + k[None, :], mask=r0 & km[None, :], other=0.0)
        wm = km[:, None] & nm[None, :]
        wg = tl.load(w_gate[None, :] + k[:, None], mask=wm, other=0.0)  # [BLOCK_K, BLOCK_N]
        wu = tl.load(w_up[None, :] + k[:, None], mask=wm, other=0.0)
        if FP8 == 2:  # the codes dotted in float16, each block's sum scaled (`fp8_block_dot`)
            sg_next = scales_ahead(s_gate, k0 // BLOCK_K + 1, nm, HID, BLOCK_K, True)
            su_next = scales_ahead(s_up, k0 // BLOCK_K + 1, nm, HID, BLOCK_K, True)
            acc_g = fp8_block_dot(acc_g, a, sg, wg, sg, False, True, PREC)
            acc_u = fp8_block_dot(acc_u, a, su, wu, su, False, True, PREC)
            sg, su = sg_next, su_next
        else:
            if FP8:  # codes -> x's dtype as the reference dequantizes (BLOCK_K = one scale block)
                wg = _dequant(wg, s_gate + k0 // BLOCK_K, nm, a.dtype)
                wu = _dequant(wu, s_up + k0 // BLOCK_K, nm, a.dtype)
            acc_g = tl.dot(a, wg, acc=acc_g, input_precision=PREC)
            acc_u = tl.dot(a, wu, acc=acc_u, input_precision=PREC)
    g = acc_g.to(ty).to(tl.float32)
    u = acc_u.to(ty).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)
    tl.store(inter_ptr + p * si_p + r[:, None] * 0 + n[None, :], (s * u).to(ty),
             mask=r0 & nm[None, :])


@triton.jit
def _dequant(w, s_ptrs, nm, ty):
    """FP8 codes ``w [BLOCK_K, BLOCK_N]`` times their rows' scales (``s_ptrs [BLOCK_N]``),
    rounded to ``ty``: `kernels/fp8.dequantize` on one 128-column block."""
    return (w.to(tl.float32) * tl.load(s_ptrs, mask=nm, other=0.0)[None, :]).to(ty)


@triton.jit
def _row_dot(a_row, w_rows, s_rows, r, r0, kk, nm, I, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, PREC: tl.constexpr, FP8: tl.constexpr):
    """Down projection of one pair: row 0 of a [ROWS, BLOCK_N] float32 tile
    is inter[p] @ w2[e][tile rows].T over I in BLOCK_K steps (rows 1.. are zeros). FP8:
    w2 holds codes, ``s_rows`` the tile rows' scales."""
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    w_s = scales_ahead(s_rows, 0, nm, I, BLOCK_K, FP8 == 2)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + kk
        km = k < I
        a = tl.load(a_row + r[:, None] * 0 + k[None, :], mask=r0 & km[None, :], other=0.0)
        w = tl.load(w_rows[None, :] + k[:, None], mask=km[:, None] & nm[None, :], other=0.0)
        if FP8 == 2:
            w_s_next = scales_ahead(s_rows, k0 // BLOCK_K + 1, nm, I, BLOCK_K, True)
            acc = fp8_block_dot(acc, a, w_s, w, w_s, False, True, PREC)
            w_s = w_s_next
        else:
            if FP8:
                w = _dequant(w, s_rows + k0 // BLOCK_K, nm, a.dtype)
            acc = tl.dot(a, w, acc=acc, input_precision=PREC)
    return acc


@triton.jit
def _small_down_kernel(
    inter_ptr, ids_ptr, emap_ptr, tw_ptr, w_ptr, out_ptr, ws_ptr,
    K_TOP, HID, I, E, si_p, sw_e, sw_n, so_t, sws_e, sws_n,
    HAS_MAP: tl.constexpr, ROWS: tl.constexpr, FP8: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
):
    # w2[e] is [HID, I], I contiguous. out[t, tile] = sum over local slots, in slot order,
    # of round(round(w2[e] @ inter[p]) * weight[p]), summed in float32.
    t = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < HID
    kk = tl.arange(0, BLOCK_K)
    ty = out_ptr.dtype.element_ty
    r = tl.arange(0, ROWS)
    r0 = (r == 0)[:, None]
    acc_t = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for j in range(0, K_TOP):
        p = t * K_TOP + j
        e = _local_expert(ids_ptr, emap_ptr, p, HAS_MAP)
        if (e >= 0) & (e < E):
            wt = tl.load(tw_ptr + p).to(ty).to(tl.float32)
            w_rows = w_ptr + e * sw_e + n.to(tl.int64) * sw_n  # [BLOCK_N] row starts
            a_row = inter_ptr + p * si_p
            s_rows = ws_ptr + e * sws_e + n.to(tl.int64) * sws_n
            acc = _row_dot(a_row, w_rows, s_rows, r, r0, kk, nm, I, ROWS, BLOCK_N, BLOCK_K, PREC, FP8)
            acc_t += (acc.to(ty).to(tl.float32) * wt).to(ty).to(tl.float32)
    tl.store(out_ptr + t * so_t + r[:, None] * 0 + n[None, :], acc_t.to(ty), mask=r0 & nm[None, :])


@triton.jit
def _small_down_pair_kernel(
    inter_ptr, ids_ptr, emap_ptr, tw_ptr, w_ptr, pair_out_ptr, out_ptr, arrived_ptr, ws_ptr,
    HID, I, E, K_TOP, si_p, sw_e, sw_n, so_p, sws_e, sws_n,
    HAS_MAP: tl.constexpr, ROWS: tl.constexpr, MERGE: tl.constexpr,
    FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
    PDL: tl.constexpr, TRIGGER: tl.constexpr,
):
    # The slots spread over programs: pair_out[p, tile] =
    # round(round(w2[e] @ inter[p]) * weight[p]) (the 16-row MMA tile); non-local pairs
    # write nothing. With
    # MERGE every pair of a token arrives at the token's tile counter (arrivals.py) and
    # the last one writes out[t, tile]: the slot sum of _small_combine_kernel. PDL: as
    # the gate_up kernel's. TRIGGER: let a PDL-launched next kernel (the next layer's qkv
    # GEMV) start its weight reads now.
    if PDL:
        gdc_wait()
    if PDL or TRIGGER:
        gdc_launch_dependents()
    p = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    e = _local_expert(ids_ptr, emap_ptr, p, HAS_MAP)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < HID
    ty = pair_out_ptr.dtype.element_ty
    if (e >= 0) & (e < E):
        kk = tl.arange(0, BLOCK_K)
        wt = tl.load(tw_ptr + p).to(ty).to(tl.float32)
        w_rows = w_ptr + e * sw_e + n.to(tl.int64) * sw_n
        a_row = inter_ptr + p * si_p
        r = tl.arange(0, ROWS)
        r0 = (r == 0)[:, None]
        s_rows = ws_ptr + e * sws_e + n.to(tl.int64) * sws_n
        acc = _row_dot(a_row, w_rows, s_rows, r, r0, kk, nm, I, ROWS, BLOCK_N, BLOCK_K, PREC, FP8)
        h = (acc.to(ty).to(tl.float32) * wt).to(ty)
        tl.store(pair_out_ptr + p * so_p + r[:, None] * 0 + n[None, :], h, mask=r0 & nm[None, :])
    if MERGE:
        tl.debug_barrier()
        t = p // K_TOP
        slot = arrived_ptr + t * tl.num_programs(1) + nb
        if tl.atomic_add(slot, 1, sem="acq_rel", scope="gpu") == K_TOP - 1:
            tl.store(slot, 0)
            _slot_sum(pair_out_ptr, ids_ptr, emap_ptr, out_ptr, t, n, HID, K_TOP, E, HAS_MAP, BLOCK_N)


@triton.jit
def _small_combine_kernel(pair_out_ptr, ids_ptr, emap_ptr, out_ptr, HID, K_TOP, E,
                          HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):
    # out[t] = float32 sum, in slot order, of the token's local pair rows; one rounding.
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    _slot_sum(pair_out_ptr, ids_ptr, emap_ptr, out_ptr, t, cols, HID, K_TOP, E, HAS_MAP, BLOCK)


@triton.jit
def _slot_sum(pair_out_ptr, ids_ptr, emap_ptr, out_ptr, t, cols, HID, K_TOP, E,
              HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):
    """out[t, cols] = float32 sum, in slot order, of the token's local rows of the
    contiguous [P, HID] pair buffer; one rounding. Reads past L1: in the merging down
    kernel other programs of the same launch wrote the rows."""
    acc = tl.zeros([BLOCK], tl.float32)
    for j in range(0, K_TOP):
        e = _local_expert(ids_ptr, emap_ptr, t * K_TOP + j, HAS_MAP)
        lim = tl.where((e >= 0) & (e < E), HID, 0)
        v = tl.load(pair_out_ptr + (t * K_TOP + j) * HID + cols, mask=cols < lim, other=0.0,
                    cache_modifier=".cg")
        acc += v.to(tl.float32)
    tl.store(out_ptr + t * HID + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < HID)


# K tiles as the general path's BLOCK_M=16 config (K1 = K2 = 128), N 64 as its too.
# split: the down projection runs one program per (pair, H-tile) (8x the programs of the
# per-token loop at T=1); the last pair of a token's tile sums its slots (merge;
# merge=False: a third launch does).
# H200 graph replay at T=1 (Qwen3-30B-A3B shape): N 64/64 26.9 us, 32/16 28.7, 16/16 30.6;
# per-token loop instead of split 38.5.
# stages1: the pipeline stages at T = 1. 48-layer decode on the H200 (bench/NOTES.md,
# twenty-eighth session): 4 stages gave batch 1 377-378 tok/s against 372-374 with 3,
# but batch 4 676 against 690, so 4 at one token only.
_CONFIG = dict(N1=64, K1=128, N2=64, K2=128, warps=4, stages=3, stages1=4, split=True)


def small_config() -> dict:
    """The default tiles (a copy): N1/K1 gate_up, N2/K2 down, warps, stages (``stages1``:
    the stages at T = 1), split."""
    return dict(_CONFIG)


def fused_experts_small_triton(x, topk_weights, topk_ids, w13, w2, expert_map=None, *,
                               cfg: dict | None = None,
                               scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                               fp8_f16: bool = False) -> torch.Tensor:
    """Small-batch SwiGLU experts with weighted top-k combine; see ``fused_experts_ref``.

    Same arguments as ``fused_experts_triton``; ``cfg`` overrides :func:`small_config`
    (keys N1, K1, N2, K2, warps, stages, stages1,
    split, merge). Any T works (the work grows as T * k: meant for T * k <=
    ``SMALL_MAX_PAIRS``). Local expert ids outside ``[0, E)`` count as not held. Two
    kernel launches (three with ``split`` and ``merge=False``), no host sync. ``scales``: (w13_scale, w2_scale)
    when the stacks are FP8 codes (`moe_fp8`; K tiles of one 128-column block):
    each weight tile is dequantized in registers as the reference does, or with
    ``fp8_f16`` its codes are dotted in float16 (`fp8_block_dot`'s SCALE_AFTER), as
    the general path's decode tile does with `moe_fp8.DECODE_F16` (the same bits on
    either side of the dispatch threshold when both agree)."""
    if scales is not None and any((cfg or {}).get(k, 128) != 128 for k in ("K1", "K2")):
        raise ValueError("FP8 stacks take K tiles of 128")
    T, hid = x.shape
    out = x.new_empty((T, hid))
    if T == 0:
        return out
    E, two_i, _ = w13.shape
    inter_dim = two_i // 2
    k_top = topk_ids.shape[1]
    P = T * k_top
    c = small_config()
    c.update(cfg or {})
    x = x if x.stride(-1) == 1 else x.contiguous()
    w13 = w13 if w13.stride(-1) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(-1) == 1 else w2.contiguous()
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    weights = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
    emap = ids if expert_map is None else expert_map  # dummy pointer without a map
    s13, s2 = scales if scales is not None else (w13, w2)  # dummy pointers without FP8
    stages = c.get("stages1", c["stages"]) if T == 1 else c["stages"]
    fp8 = 0 if scales is None else 2 if fp8_f16 else 1  # the kernels' FP8 form
    meta = dict(HAS_MAP=expert_map is not None, ROWS=_ROWS, FP8=fp8,
                PREC=dot_precision(x.dtype), num_warps=c["warps"], num_stages=stages)
    inter = x.new_empty((P, inter_dim))
    _small_gate_up_kernel[(P, triton.cdiv(inter_dim, c["N1"]))](
        x, ids, emap, w13, inter, s13,
        k_top, hid, inter_dim, E, x.stride(0), w13.stride(0), w13.stride(1), inter.stride(0),
        s13.stride(0), s13.stride(1), BLOCK_N=c["N1"], BLOCK_K=c["K1"], **meta,
        **pdl_launch(x.device, "moe"),
    )
    if c.get("split"):
        _down_split(inter, ids, emap, weights, w2, s2, out, c, meta, k_top)
        return out
    _small_down_kernel[(T, triton.cdiv(hid, c["N2"]))](
        inter, ids, emap, weights, w2, out, s2,
        k_top, hid, inter_dim, E, inter.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        s2.stride(0), s2.stride(1), BLOCK_N=c["N2"], BLOCK_K=c["K2"], **meta,
    )
    return out


def _down_split(inter, ids, emap, weights, w2, s2, out, c, meta, k_top) -> None:
    """Down projection per (pair, H-tile) into a pair buffer and the slot sum: merged in
    the same launch (``merge``, the default) or by a combine kernel."""
    P, inter_dim = inter.shape
    T, hid = out.shape
    E = w2.shape[0]
    pair_out = out.new_empty((P, hid))
    tiles = triton.cdiv(hid, c["N2"])
    merge = c.get("merge", True)
    arrived = arrival_counts("moe_down", T * tiles, out.device) if merge else ids
    _small_down_pair_kernel[(P, tiles)](
        inter, ids, emap, weights, w2, pair_out, out, arrived, s2,
        hid, inter_dim, E, k_top, inter.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0),
        s2.stride(0), s2.stride(1), HAS_MAP=meta["HAS_MAP"], ROWS=meta["ROWS"], MERGE=merge,
        FP8=meta["FP8"], BLOCK_N=c["N2"], BLOCK_K=c["K2"], PREC=meta["PREC"],
        TRIGGER=merge and pdl_enabled(out.device), num_warps=meta["num_warps"],
        num_stages=meta["num_stages"], **pdl_launch(out.device, "moe"),
    )
    if merge:
        return
    block = min(1024, triton.next_power_of_2(hid))
    _small_combine_kernel[(T, triton.cdiv(hid, block))](
        pair_out, ids, emap, out, hid, k_top, E, HAS_MAP=meta["HAS_MAP"], BLOCK=block, num_warps=4,
    )
