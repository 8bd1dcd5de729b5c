"""Prefill attention in the batch-invariant mode: blocks of query rows, each row reduced as
decode attention reduces a query at its position (kernels/batch_invariant.py).

Decode attention (kernels/gpu/attention.py, the mode's fixed plan) takes one query of a
sequence of length L: splits of ``PART`` positions from position 0, each an online
softmax over ``BLOCK_N``-position tiles (`_attend_tile`), the splits' normalized partials
merged in split order. Computing every prefill row by that kernel reads a sequence's K/V
once per row. Here a program takes ``RM`` consecutive query rows of one sequence and one
split, and runs the same tiles over the split's positions for all of them at once; row
``r`` (length ``L_r``, its position + 1) sees positions ``< min(split end, L_r)``, as its
decode query would. Per row the arithmetic is the decode kernel's: the same tiles in the
same order (a tile past a row's length is an exact no-op for that row: its scores are
-inf, so ``alpha`` is 1 and ``p`` is 0), the same ``tl.dot`` chains (an MMA element does
not depend on the tile's rows), the same partial normalization, and the merge is the
decode reduce kernel's, over the row's own splits. The tile's rows are (query row, head)
pairs, the ``G`` heads of one KV head for ``RM`` rows. Both kernels take `_attend_tile`'s
INVARIANT steps: a plain row sum's order follows the tile's register layout (on one
H100 the block kernel's rows differed from the decode kernel's by up to 5e-7 with it),
so the row sums are MMAs too. `tests/test_gpu.py` asserts equal bits on the GPU.

Limits: every row at most ``PART`` x 256 positions (beyond, decode cuts a sequence in
other chunks); kernels/attention.py computes longer ones row by row instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import _LOG2E, _attend_tile, _decode_reduce_kernel, dot_precision
from .decode_plan import INVARIANT_PART, _invariant_plan

__all__ = ["invariant_prefill_triton", "row_lengths", "INVARIANT_MAX_LEN"]

INVARIANT_MAX_LEN = INVARIANT_PART * 256  # rows past this: row by row (kernels/attention.py)
_TILE_ROWS = 64  # (query row, head) pairs per program


@triton.jit
def _prefill_split_kernel(
    q_ptr, kc_ptr, vc_ptr, qsl_ptr, seq_lens_ptr, bt_ptr, part_o_ptr, part_lse_ptr,
    sq_t, sq_h, s_kp, s_kh, s_kt, s_vp, s_vh, s_vt, s_bt, sp_t, sp_h, sp_n, sl_t, sl_h,
    scale_log2, G, HD, PAGE, PART, QB,
    RM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PREC: tl.constexpr,
):
    # Program (split, kv_head, s * QB + qb): query rows [row0, row0 + RM) of sequence s
    # (row0 = qsl[s] + qb * RM), the G heads of kv_head each, over positions
    # [split*PART, (split+1)*PART) cut at each row's length. Stores each row's normalized
    # partial and log2-sum-exp at [row, head, split] for the rows that reach the split.
    split = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2) // QB
    qb = tl.program_id(2) % QB
    q_lo = tl.load(qsl_ptr + s)
    q_hi = tl.load(qsl_ptr + s + 1)
    row0 = q_lo + qb * RM
    if row0 >= q_hi:
        return
    ctx = tl.load(seq_lens_ptr + s) - (q_hi - q_lo)  # cached prefix: row j sits at ctx + j
    r = tl.arange(0, BLOCK_R)
    rq = r // G
    row = row0 + rq
    rmask = (rq < RM) & (row < q_hi)
    row_len = tl.where(rmask, ctx + (row - q_lo) + 1, 0)
    start = split * PART
    block_len = ctx + (tl.minimum(row0 + RM, q_hi) - q_lo)  # the block's longest row
    if start >= block_len:
        return
    end = tl.minimum(start + PART, block_len)
    row_end = tl.minimum(start + PART, row_len)
    heads = kvh * G + r % G
    d = tl.arange(0, BLOCK_D)
    dm = d < HD
    row64 = row.to(tl.int64)
    q = tl.load(q_ptr + row64[:, None] * sq_t + heads[:, None] * sq_h + d[None, :],
                mask=rmask[:, None] & dm[None, :], other=0.0).to(kc_ptr.dtype.element_ty)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    bt_row = bt_ptr + s.to(tl.int64) * s_bt
    kc_base = kc_ptr + kvh * s_kh
    vc_base = vc_ptr + kvh * s_vh
    nn = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + nn
        kv_mask = pos < end
        page = tl.load(bt_row + pos // PAGE, mask=kv_mask, other=0).to(tl.int64)
        valid = pos[None, :] < row_end[:, None]
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, kc_base, vc_base, page, pos, kv_mask, valid,
                                     d, dm, s_kp, s_kt, s_vp, s_vt, PAGE, scale_log2, True, PREC,
                                     True, BLOCK_N)
    o = acc / l_i[:, None]
    reach = rmask & (start < row_len)
    tl.store(part_o_ptr + row64[:, None] * sp_t + heads[:, None] * sp_h + split * sp_n + d[None, :],
             o, mask=reach[:, None] & dm[None, :])
    tl.store(part_lse_ptr + row64 * sl_t + heads * sl_h + split, m_i + tl.log2(l_i), mask=reach)


def row_lengths(meta, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(seq, owned, lens) of a step's ``t`` query rows: the sequence owning each row
    (clamped to a real one), whether one does (a graph's padding rows do not), and the
    row's KV length as a decode query (row ``i`` of sequence ``s``: ``seq_lens[s] -
    query_start_loc[s+1] + i + 1``; 1 for unowned rows). Tensor ops only (no host sync)."""
    rows = torch.arange(t, device=meta.query_start_loc.device, dtype=meta.query_start_loc.dtype)
    ends = meta.query_start_loc[1:]
    seq = torch.searchsorted(ends, rows, right=True)
    owned = seq < ends.shape[0]
    seq = seq.clamp_(max=max(ends.shape[0] - 1, 0))
    lens = (meta.seq_lens[seq] - ends[seq] + rows + 1).where(owned, 1).to(torch.int32)
    return seq, owned, lens


def invariant_prefill_triton(q, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
    """Varlen causal attention (``prefill_attention_ref``'s contract) whose every row has
    the bits ``decode_attention_triton`` in the batch-invariant mode gives a query at that
    position. Rows owned by no sequence are 0. Needs ``meta.max_seq_len`` <=
    `INVARIANT_MAX_LEN` (the caller checks) and ``meta.max_query_len`` (a host int) for
    the grid."""
    T, H, D = q.shape
    _, KVH, page, _ = k_cache.shape
    out = torch.zeros_like(q)
    S = meta.seq_lens.shape[0]
    if T == 0 or S == 0 or meta.max_query_len == 0:
        return out
    G = H // KVH
    width = meta.block_tables.shape[1]
    bound = max(1, min(width * page, meta.max_seq_len or width * page))
    block_n, part, n_split = _invariant_plan(bound)
    rm = max(1, _TILE_ROWS // G)
    block_r = max(16, triton.next_power_of_2(rm * G))
    qb = triton.cdiv(meta.max_query_len, rm)
    part_o = q.new_empty((T, H, n_split, D), dtype=torch.float32)
    part_lse = q.new_empty((T, H, n_split), dtype=torch.float32)
    block_d, prec = triton.next_power_of_2(D), dot_precision(q.dtype)
    _prefill_split_kernel[(n_split, KVH, S * qb)](
        q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, part_o, part_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), meta.block_tables.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        scale * _LOG2E, G, D, page, part, qb,
        RM=rm, BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_D=block_d, PREC=prec, num_warps=4, num_stages=2)
    _, owned, lens = row_lengths(meta, T)
    _decode_reduce_kernel[(KVH, T)](
        part_o, part_lse, lens, out,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), G, D, part, n_split, BLOCK_G=max(16, triton.next_power_of_2(G)),
        BLOCK_D=block_d, BLOCK_N=block_n, PDL=False, TRIGGER=False, num_warps=4)
    return out.where(owned[:, None, None], 0)
