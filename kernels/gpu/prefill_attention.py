"""Triton varlen causal prefill attention over the paged cache (cached prefixes included).

Contract: :func:`phalanx.kernels.attention.prefill_attention_ref`. One program is
(query block, head, sequence): ``BLOCK_M`` new tokens of one sequence and one query head.
New token ``j`` of a sequence with ``q_len`` new tokens sits at position ``ctx + j``
(``ctx = seq_len - q_len``, the cached prefix) and sees positions ``0 .. ctx + j``.

KV sources. Positions ``< ctx`` are read from the paged cache (one page-table lookup per
position, any page size). Positions ``>= ctx`` (this step's tokens) are read from the
contiguous ``k_new`` / ``v_new`` rows when given (``[T, kv_heads, head_dim]``, row ``i``
the K/V of query row ``i``: what was just written to the cache), otherwise from the
cache too. Reading them contiguously spares the per-element page arithmetic that
otherwise rivals the softmax's own ALU work.

KV tiles sit at multiples of ``BLOCK_N`` from position 0, so a prefix hit and a fresh
prompt reduce the same tiles in the same order, and ``BLOCK_N`` follows head_dim alone
(not the batch), so a sequence's result does not depend on its batch. Four loops, each
without work it does not need: whole prefix tiles (no masks), the tile holding the
prefix's end (rows from both sources), whole new-token tiles left of the block's first
row (no masks), and the diagonal tiles (causal mask). Query blocks run last-first.
Softmax in base 2; the scale is applied after the row max (``exp2(s * scale - m)``, one
fused multiply-add per score). Scores, softmax and the P@V accumulation are float32, P rounded to the KV dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import _LOG2E, dot_precision

__all__ = ["prefill_attention_triton", "PREFILL_CONFIG", "PREFILL_KV_SMEM", "PREFIX_PREFETCH"]


@triton.jit
def _softmax_step(s, m_i, l_i, scale_log2):
    """Online softmax over raw scores ``s`` [M, N] (masked entries -inf): the new running
    max (scaled, log2 units), the new running sum, the factor ``alpha`` the accumulator
    is rescaled by, and the probabilities ``p``."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
    # A row with nothing visible yet keeps m = -inf: subtract 0 instead (no inf - inf).
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_sub)
    p = tl.exp2(s * scale_log2 - m_sub[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), alpha, p


@triton.jit
def _online_tile(q, m_i, l_i, acc, k_ptrs, v_ptrs, lm, valid, scale_log2,
                 LOAD_MASK: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr):
    """One online-softmax step over a KV tile.

    k_ptrs, v_ptrs: [BLOCK_N, BLOCK_D] pointers; lm: their load mask (used only with
    LOAD_MASK); valid: [M, BLOCK_N] positions each row may see (used only with CAUSAL;
    without it every loaded position is visible to every row). m_i is the running max
    of the *scaled* scores (log2 units). Returns the updated (m_i, l_i, acc).
    """
    if LOAD_MASK:
        k = tl.load(k_ptrs, mask=lm, other=0.0)
    else:
        k = tl.load(k_ptrs)
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    if CAUSAL:
        s = tl.where(valid, s, float("-inf"))
    m_new, l_i, alpha, p = _softmax_step(s, m_i, l_i, scale_log2)
    if LOAD_MASK:
        v = tl.load(v_ptrs, mask=lm, other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _mixed_tile(q, m_i, l_i, acc, kp, vp, lm_old, kn, vn, lm_new, valid, scale_log2,
                PREC: tl.constexpr):
    """:func:`_online_tile` over a tile whose rows come from two places: ``kp``/``vp``
    where ``lm_old``, ``kn``/``vn`` where ``lm_new`` (disjoint; a row in neither is 0)."""
    k = tl.load(kp, mask=lm_old, other=0.0) + tl.load(kn, mask=lm_new, other=0.0)
    s = tl.where(valid, tl.dot(q, tl.trans(k), input_precision=PREC), float("-inf"))
    m_new, l_i, alpha, p = _softmax_step(s, m_i, l_i, scale_log2)
    v = tl.load(vp, mask=lm_old, other=0.0) + tl.load(vn, mask=lm_new, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _page_ids(bt_row, pos, pmask, PAGE):
    """The pages of positions ``pos`` [BLOCK_N], int64 (masked lanes: page 0)."""
    return tl.load(bt_row + pos // PAGE, mask=pmask, other=0).to(tl.int64)


@triton.jit
def _rows_at(base, page, pos, s_p, s_t, d, PAGE):
    """Pointers [BLOCK_N, BLOCK_D] to the cache rows of positions ``pos`` on ``page``."""
    return base + page[:, None] * s_p + (pos % PAGE).to(tl.int64)[:, None] * s_t + d[None, :]


@triton.jit
def _paged_rows(base, bt_row, pos, pmask, s_p, s_t, d, PAGE):
    """Pointers [BLOCK_N, BLOCK_D] to the cache rows of positions ``pos`` (masked lanes
    read page-table entry 0, never dereferenced with their mask)."""
    return _rows_at(base, _page_ids(bt_row, pos, pmask, PAGE), pos, s_p, s_t, d, PAGE)


@triton.jit
def _new_rows(kn_ptr, vn_ptr, kc_base, vc_base, bt_row, q_start, ctx, pos, pmask,
              s_knt, s_knh, s_vnt, s_vnh, kvh, s_kp, s_kt, s_vp, s_vt, d, PAGE, NEW_KV: tl.constexpr):
    """K and V pointers of positions ``pos`` (all >= ctx: this step's tokens)."""
    if NEW_KV:
        row = (q_start + pos - ctx).to(tl.int64)[:, None]
        return (kn_ptr + row * s_knt + kvh * s_knh + d[None, :],
                vn_ptr + row * s_vnt + kvh * s_vnh + d[None, :])
    return (_paged_rows(kc_base, bt_row, pos, pmask, s_kp, s_kt, d, PAGE),
            _paged_rows(vc_base, bt_row, pos, pmask, s_vp, s_vt, d, PAGE))


@triton.jit
def _straddling_tile(q, m_i, l_i, acc, pos, q_pos, kn_ptr, vn_ptr, kc_base, vc_base, bt_row,
                     q_start, ctx, kv_end, s_knt, s_knh, s_vnt, s_vnh, kvh, s_kp, s_kt, s_vp,
                     s_vt, d, dm, scale_log2, PAGE, NEW_KV: tl.constexpr, PREC: tl.constexpr):
    """The KV tile at positions ``pos`` that holds both the cached prefix's last rows
    (``pos < ctx``, from the paged cache) and this step's first ones (``ctx <= pos <
    kv_end``, from ``_new_rows``), causal against ``q_pos``."""
    old = pos < ctx
    new = (pos >= ctx) & (pos < kv_end)
    kn, vn = _new_rows(kn_ptr, vn_ptr, kc_base, vc_base, bt_row, q_start, ctx, pos, new,
                       s_knt, s_knh, s_vnt, s_vnh, kvh, s_kp, s_kt, s_vp, s_vt, d, PAGE, NEW_KV)
    kp = _paged_rows(kc_base, bt_row, pos, old, s_kp, s_kt, d, PAGE)
    vp = _paged_rows(vc_base, bt_row, pos, old, s_vp, s_vt, d, PAGE)
    return _mixed_tile(q, m_i, l_i, acc, kp, vp, old[:, None] & dm[None, :], kn, vn,
                       new[:, None] & dm[None, :],
                       (pos[None, :] <= q_pos[:, None]) & (old | new)[None, :], scale_log2, PREC)


@triton.jit
def _new_tiles(q, m_i, l_i, acc, ar, q_pos, new_start, full_end, kv_end, kn_ptr, vn_ptr,
               kc_base, vc_base, bt_row, q_start, ctx, s_knt, s_knh, s_vnt, s_vnh, kvh, s_kp,
               s_kt, s_vp, s_vt, d, dm, scale_log2, PAGE, BLOCK_N: tl.constexpr,
               NEW_KV: tl.constexpr, EVEN_D: tl.constexpr, PREC: tl.constexpr):
    """The KV tiles wholly of this step's tokens, from ``new_start``: below ``full_end``
    every row of the query block sees the whole tile (no causal mask); from there to
    ``kv_end`` the diagonal tiles, masked."""
    for n0 in range(new_start, full_end, BLOCK_N):
        pos = n0 + ar
        kn, vn = _new_rows(kn_ptr, vn_ptr, kc_base, vc_base, bt_row, q_start, ctx, pos, pos < kv_end,
                           s_knt, s_knh, s_vnt, s_vnh, kvh, s_kp, s_kt, s_vp, s_vt, d, PAGE, NEW_KV)
        m_i, l_i, acc = _online_tile(q, m_i, l_i, acc, kn, vn, dm[None, :], dm[None, :],
                                     scale_log2, not EVEN_D, False, PREC)
    for n0 in range(tl.maximum(new_start, full_end), kv_end, BLOCK_N):
        pos = n0 + ar
        pm = pos < kv_end
        kn, vn = _new_rows(kn_ptr, vn_ptr, kc_base, vc_base, bt_row, q_start, ctx, pos, pm,
                           s_knt, s_knh, s_vnt, s_vnh, kvh, s_kp, s_kt, s_vp, s_vt, d, PAGE, NEW_KV)
        m_i, l_i, acc = _online_tile(q, m_i, l_i, acc, kn, vn, pm[:, None] & dm[None, :],
                                     (pos[None, :] <= q_pos[:, None]) & pm[None, :],
                                     scale_log2, True, True, PREC)
    return m_i, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, kn_ptr, vn_ptr, qsl_ptr, seq_lens_ptr, bt_ptr, out_ptr,
    sq_t, sq_h, s_kp, s_kh, s_kt, s_vp, s_vh, s_vt, s_knt, s_knh, s_vnt, s_vnh, s_bt, so_t, so_h,
    scale_log2, G, HD, PAGE,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
    NEW_KV: tl.constexpr, EVEN_D: tl.constexpr, PREFETCH: tl.constexpr,
):
    # PREFETCH: the prefix tiles' page ids are loaded a tile ahead, so no K/V address of
    # the prefix loop depends on a load of its own iteration and the pipeliner keeps the
    # next tile's copies in flight while a tile computes (compiled for sm_90: with the
    # lookup inline that loop waits for every copy it issued; bench/NOTES.md).
    # Query blocks run last-first: the causal diagonal makes late blocks the longest, and
    # starting them first leaves the short ones for the grid's tail.
    mb = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2).to(tl.int64)
    q_start = tl.load(qsl_ptr + s)
    q_len = tl.load(qsl_ptr + s + 1) - q_start
    if mb * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + s)
    ctx = seq_len - q_len
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rm = rows < q_len
    q_pos = ctx + rows
    d = tl.arange(0, BLOCK_D)
    dm = d < HD
    tok = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * sq_t + h * sq_h + d[None, :],
                mask=rm[:, None] & dm[None, :], other=0.0).to(kc_ptr.dtype.element_ty)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kvh = h // G
    kc_base = kc_ptr + kvh * s_kh
    vc_base = vc_ptr + kvh * s_vh
    bt_row = bt_ptr + s * s_bt
    ar = tl.arange(0, BLOCK_N)
    # KV tiles sit at multiples of BLOCK_N from position 0, whoever computes the row: a
    # prefix hit and a fresh prompt take the same tiles in the same order (equal results).
    pre_end = ctx // BLOCK_N * BLOCK_N  # tiles below: all cached prefix
    new_start = tl.cdiv(ctx, BLOCK_N) * BLOCK_N  # tiles from here: all this step's
    full_end = (ctx + mb * BLOCK_M + 1) // BLOCK_N * BLOCK_N  # below: seen by every row
    kv_end = tl.minimum(seq_len, ctx + (mb + 1) * BLOCK_M)  # the last row's position + 1
    if PREFETCH:
        page_next = _page_ids(bt_row, ar, ar < pre_end, PAGE)
    for n0 in range(0, pre_end, BLOCK_N):
        pos = n0 + ar
        if PREFETCH:  # this tile's pages came with the last tile; fetch the next tile's
            page = page_next
            page_next = _page_ids(bt_row, pos + BLOCK_N, pos + BLOCK_N < pre_end, PAGE)
        else:
            page = _page_ids(bt_row, pos, pos < ctx, PAGE)
        m_i, l_i, acc = _online_tile(
            q, m_i, l_i, acc, _rows_at(kc_base, page, pos, s_kp, s_kt, d, PAGE),
            _rows_at(vc_base, page, pos, s_vp, s_vt, d, PAGE),
            dm[None, :], dm[None, :], scale_log2, not EVEN_D, False, PREC)
    if pre_end < ctx:  # the tile holding the prefix's end and this step's first tokens
        m_i, l_i, acc = _straddling_tile(
            q, m_i, l_i, acc, pre_end + ar, q_pos, kn_ptr, vn_ptr, kc_base, vc_base, bt_row,
            q_start, ctx, kv_end, s_knt, s_knh, s_vnt, s_vnh, kvh, s_kp, s_kt, s_vp, s_vt, d, dm,
            scale_log2, PAGE, NEW_KV, PREC)
    m_i, l_i, acc = _new_tiles(
        q, m_i, l_i, acc, ar, q_pos, new_start, full_end, kv_end, kn_ptr, vn_ptr, kc_base,
        vc_base, bt_row, q_start, ctx, s_knt, s_knh, s_vnt, s_vnh, kvh, s_kp, s_kt, s_vp, s_vt,
        d, dm, scale_log2, PAGE, BLOCK_N, NEW_KV, EVEN_D, PREC)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * so_t + h * so_h + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=rm[:, None] & dm[None, :])


# Tile configs. BLOCK_N (the KV tile) depends on head_dim alone, never on the batch: a row's
# KV tiles, their order and each tile's reductions are then the same whatever BLOCK_M the
# batch's longest query picks, so a sequence's result does not depend on what it is batched
# with (seeded sampling reproduces alone and in a batch; tests/test_gpu.py). Only the query
# tile, warps and stages follow the longest query. One H200, triton 3.6, bf16, 32/4 heads,
# head_dim 128, k_new rows: 8x2048 causal 852-896 us with (128, 64, 8 warps, 3 stages),
# 947-1020 with (128, 128, 8, 2), 872-955 with (64, 64, 4, 3) (bench/NOTES.md).
PREFILL_CONFIG = dict(BLOCK_M=128, BLOCK_N=64, warps=8, stages=3)

# The prefix loop's page ids a tile ahead (PREFETCH above). One H100, 8 prompts of 1024 new
# tokens after a cached prefix of 1024, k_new rows (bench/probes/prefill_attention_tiles.py):
# 776.0 -> 719.2 us with the default tiles, 834 -> 754 with 64-row, 2774 -> 2594 with 16-row.
PREFIX_PREFETCH = True

# Shared memory the pipelined K and V tiles may take (stages x 2 x BLOCK_N x BLOCK_D x
# element size): H100/H200 give a block 227 KiB; float32 tiles of 128 x 128 in 2 stages
# asked for 256 KiB there and did not launch. Stages give way first (down to 2), so that
# BLOCK_N stays the head_dim's.
PREFILL_KV_SMEM = 128 << 10


def _kv_tile(head_dim: int) -> int:
    return 64 if head_dim <= 128 else 32


def _prefill_config(max_query_len: int, head_dim: int, itemsize: int = 2,
                    prefetch: bool | None = None) -> dict:
    if max_query_len <= 16:  # decode-like rows (mixed batches): small query tiles
        cfg = dict(BLOCK_M=16, warps=4, stages=2)
    elif max_query_len <= 64:
        cfg = dict(BLOCK_M=64, warps=4, stages=2)
    else:
        cfg = dict(PREFILL_CONFIG)
    cfg["prefetch"] = PREFIX_PREFETCH if prefetch is None else prefetch
    if cfg["prefetch"]:  # a copy in flight while a tile computes needs a third stage
        cfg["stages"] = max(cfg["stages"], 3)
    cfg["BLOCK_N"] = _kv_tile(head_dim)
    tile = 2 * triton.next_power_of_2(head_dim) * itemsize * cfg["BLOCK_N"]  # K + V, one stage
    while cfg["stages"] > 2 and cfg["stages"] * tile > PREFILL_KV_SMEM:
        cfg["stages"] -= 1
    while cfg["BLOCK_N"] > 16 and cfg["stages"] * tile > PREFILL_KV_SMEM:  # past head_dim 256
        cfg["BLOCK_N"] //= 2
        tile //= 2
    return cfg


def prefill_attention_triton(q, k_cache, v_cache, meta, scale: float, k_new=None, v_new=None,
                             config: dict | None = None) -> torch.Tensor:
    """Varlen causal attention with cached prefixes; see ``prefill_attention_ref``.

    ``k_new`` / ``v_new`` ([T, kv_heads, head_dim], optional, together): this step's K/V
    rows as written to the cache, read instead of the cache for positions past each
    sequence's prefix. ``config`` overrides the tile choice (BLOCK_M, BLOCK_N, warps,
    stages, prefetch: the prefix tiles' page ids a tile ahead). Uses ``meta.max_query_len`` (a host int) for the grid; rows of ``q`` owned by
    no sequence come back 0.
    """
    T, H, D = q.shape
    _, KVH, page, _ = k_cache.shape
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new go together")
    out = torch.zeros_like(q)
    S = meta.seq_lens.shape[0]
    if T == 0 or S == 0 or meta.max_query_len == 0:
        return out
    cfg = dict(config) if config else _prefill_config(meta.max_query_len, D, k_cache.element_size())
    new_kv = k_new is not None
    kn, vn = (k_new, v_new) if new_kv else (k_cache, v_cache)
    if new_kv and (kn.shape != (T, KVH, D) or vn.shape != (T, KVH, D) or kn.stride(-1) != 1
                   or vn.stride(-1) != 1 or kn.dtype != k_cache.dtype or vn.dtype != v_cache.dtype):
        raise ValueError(f"k_new/v_new must be [{T}, {KVH}, {D}] {k_cache.dtype} with contiguous "
                         f"rows, got {tuple(kn.shape)} / {tuple(vn.shape)}")
    block_m, block_d = cfg["BLOCK_M"], triton.next_power_of_2(D)
    grid = (triton.cdiv(meta.max_query_len, block_m), H, S)
    _prefill_kernel[grid](
        q, k_cache, v_cache, kn, vn, meta.query_start_loc, meta.seq_lens, meta.block_tables, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1), meta.block_tables.stride(0),
        out.stride(0), out.stride(1), scale * _LOG2E, H // KVH, D, page,
        BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], BLOCK_D=block_d, PREC=dot_precision(q.dtype),
        NEW_KV=new_kv, EVEN_D=block_d == D, PREFETCH=cfg.get("prefetch", PREFIX_PREFETCH),
        num_warps=cfg["warps"], num_stages=cfg["stages"],
    )
    return out
