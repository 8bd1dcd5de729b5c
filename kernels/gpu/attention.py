"""Triton paged attention: split-K decode (prefill: :mod:`.prefill_attention`; the cache
write: :mod:`.kv_write`).

Cache layout (see :mod:`phalanx.kernels.attention`): HND pages
``[num_pages, num_kv_heads, page_size, head_dim]``; KV position ``p`` of sequence ``s``
is page ``block_tables[s, p // page_size]``, offset ``p % page_size``. The kernels
gather KV a tile of ``BLOCK_N`` *positions* at a time (one page-table lookup per
position), so any page size works, 1 included; each K/V row is ``head_dim`` contiguous
elements. Scores, softmax and the P@V accumulation are float32 (P is rounded to the
cache dtype for the P@V matrix product, as in FlashAttention); softmax runs in base 2
with ``scale * log2(e)`` folded into the scores.

Nothing here synchronizes with the host: grid sizes come from tensor shapes only
(``block_tables.shape[1] * page_size`` bounds every context), programs past a
sequence's end return at once, so the launches can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..batch_invariant import batch_invariant_on
from .arrivals import arrival_counts
from .decode_plan import decode_plan
from .pdl import gdc_launch_dependents, gdc_wait, pdl_enabled, pdl_launch

__all__ = ["decode_attention_triton", "dot_precision"]

_LOG2E = 1.4426950408889634


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: exact fp32 for fp32 tensors (tf32 would change greedy
    tokens against the CPU reference); the native path for bf16/fp16."""
    return "ieee" if dtype == torch.float32 else "tf32"


# ---------------------------------------------------------------- shared tile step


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, kc_base, vc_base, page, pos, kv_mask, valid, d, dm,
    s_kp, s_kt, s_vp, s_vt, PAGE, scale_log2, HAS_MASK: tl.constexpr, PREC: tl.constexpr,
    INVARIANT: tl.constexpr = False, BLOCK_N: tl.constexpr = 16,
):
    """One online-softmax step over the KV positions ``pos`` [BLOCK_N].

    q: [M, BLOCK_D] (cache dtype); page: [BLOCK_N] int64, each position's page (from
    the block table); kv_mask: [BLOCK_N], positions to load (all
    < seq_len, so their page-table entries are real); valid: [M, BLOCK_N] or
    [1, BLOCK_N], the positions each row may see (a subset of kv_mask); m_i, l_i: [M]
    float32 running max (log2 units) and sum; acc: [M, BLOCK_D] float32. Without
    HAS_MASK every loaded position is visible to every row (``valid`` is ignored).
    INVARIANT (the batch-invariant mode; BLOCK_N = len(pos)): no step whose order
    follows the tile's register layout, so a row's bits do not depend on the tile's
    other rows or row count: ``p``'s row sum as an MMA with a ones matrix (the sum of
    the ``p`` the P@V product uses) and the rescaled accumulator as that MMA's
    accumulator. Returns the updated (m_i, l_i, acc).
    """
    off = (pos % PAGE).to(tl.int64)
    lm = kv_mask[:, None] & dm[None, :]
    k = tl.load(kc_base + page[:, None] * s_kp + off[:, None] * s_kt + d[None, :], mask=lm, other=0.0)
    qk = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
    if HAS_MASK:
        qk = tl.where(valid, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    # Rows with nothing visible yet keep m = -inf: subtract 0 instead to avoid inf - inf.
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_sub)
    p = tl.exp2(qk - m_sub[:, None])
    v = tl.load(vc_base + page[:, None] * s_vp + off[:, None] * s_vt + d[None, :], mask=lm, other=0.0)
    if INVARIANT:
        pv = p.to(v.dtype)
        ones = tl.full([BLOCK_N, 16], 1.0, v.dtype)
        l_i = l_i * alpha + tl.max(tl.dot(pv, ones, input_precision=PREC), axis=1)
        acc = tl.dot(pv, v, acc=acc * alpha[:, None], input_precision=PREC)
    else:
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


# ---------------------------------------------------------------- decode


@triton.jit
def _tile_pages(bt_row, n0, end, PAGE, BLOCK_N: tl.constexpr):
    """The pages [BLOCK_N] (int64) of positions n0.. of a block table row; positions from
    ``end`` on are masked (page 0, not read)."""
    pos = n0 + tl.arange(0, BLOCK_N)
    return tl.load(bt_row + pos // PAGE, mask=pos < end, other=0).to(tl.int64)


@triton.jit
def _attend_range(q, m_i, l_i, acc, kc_base, vc_base, bt_row, pages, start, end, d, dm,
                  s_kp, s_kt, s_vp, s_vt, PAGE, scale_log2, BLOCK_N: tl.constexpr,
                  PREC: tl.constexpr, PREFETCH: tl.constexpr, INVARIANT: tl.constexpr):
    """Online softmax over KV positions [start, end) of one sequence (its block table row
    ``bt_row``) in tiles of BLOCK_N; returns the updated (m_i, l_i, acc).

    PREFETCH: each tile's page ids are loaded one iteration ahead (``pages``: the first
    tile's, `_tile_pages`), so no K/V address depends on a load of its own iteration and
    the pipeliner can keep the next tile's K/V copies in flight while this one computes
    (num_stages >= 3). With the lookup inline (``pages`` unused), the loop waits for every
    copy it issued, at any num_stages (compiled for sm_90: bench/probes/kernel_resources.py)."""
    nn = tl.arange(0, BLOCK_N)
    page_next = pages
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + nn
        kv_mask = pos < end
        if PREFETCH:  # this tile's pages came with the last tile; fetch the next tile's
            page = page_next
            page_next = _tile_pages(bt_row, n0 + BLOCK_N, end, PAGE, BLOCK_N)
        else:
            page = tl.load(bt_row + pos // PAGE, mask=kv_mask, other=0).to(tl.int64)
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, kc_base, vc_base, page,
                                     pos, kv_mask, kv_mask[None, :], d, dm,
                                     s_kp, s_kt, s_vp, s_vt, PAGE, scale_log2, True, PREC,
                                     INVARIANT, BLOCK_N)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["NGRID"])  # no variant per grid width
def _decode_split_kernel(
    q_ptr, kc_ptr, vc_ptr, seq_lens_ptr, bt_ptr, part_o_ptr, part_lse_ptr, out_ptr, arrived_ptr,
    sq_s, sq_h, s_kp, s_kh, s_kt, s_vp, s_vh, s_vt, s_bt,
    sp_s, sp_h, sp_n, sl_s, sl_h, so_s, so_h,
    scale_log2, G, HD, PAGE, PART, NGRID,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DIRECT: tl.constexpr, MERGE: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr,
    TRIGGER: tl.constexpr, PREFETCH: tl.constexpr, INVARIANT: tl.constexpr,
):
    # Program (split, kv_head, seq): the G query heads of kv_head over KV positions
    # [split*C, min((split+1)*C, seq_len)), C = `_split_chunk` (PART, unless the sequence
    # has more PART-position splits than the grid's NGRID: then its positions in NGRID
    # chunks, a multiple of BLOCK_N each). DIRECT (one split) writes the final
    # output; otherwise the normalized partial output [S, H, NSPLIT, D] (float32) and
    # its log2-sum-exp [S, H, NSPLIT]. MERGE: the last of the sequence's working splits
    # to arrive at the (seq, kv_head) counter (arrivals.py) merges the partials into the
    # output; without it _decode_reduce_kernel does, in a second launch. PDL
    # (kernels/gpu/pdl.py): launched dependent, wait for the previous kernel first.
    # TRIGGER: let a PDL-launched next kernel (the o projection's GEMV) start its weight
    # reads now (it waits for this grid to finish before it reads the output).
    # PREFETCH (_attend_range): the length and first page ids read before the PDL wait
    # (host-copied before the step's first kernel, written by none: pdl.py's protocol).
    split = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2).to(tl.int64)
    bt_row = bt_ptr + s * s_bt
    if PREFETCH:
        seq_len, chunk, start, end = _split_range(seq_lens_ptr, s, split, PART, NGRID, BLOCK_N)
        pages = _tile_pages(bt_row, start, end, PAGE, BLOCK_N)
    if PDL:
        gdc_wait()
    if PDL or TRIGGER:
        gdc_launch_dependents()
    if not PREFETCH:
        seq_len, chunk, start, end = _split_range(seq_lens_ptr, s, split, PART, NGRID, BLOCK_N)
        pages = start  # unused
    if start >= seq_len:
        return
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gm = g < G
    dm = d < HD
    heads = kvh * G + g
    q = tl.load(q_ptr + s * sq_s + heads[:, None] * sq_h + d[None, :],
                mask=gm[:, None] & dm[None, :], other=0.0).to(kc_ptr.dtype.element_ty)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    m_i, l_i, acc = _attend_range(q, m_i, l_i, acc, kc_ptr + kvh * s_kh, vc_ptr + kvh * s_vh,
                                  bt_row, pages, start, end, d, dm, s_kp, s_kt, s_vp, s_vt,
                                  PAGE, scale_log2, BLOCK_N, PREC, PREFETCH, INVARIANT)
    o = acc / l_i[:, None]
    om = gm[:, None] & dm[None, :]
    if DIRECT:
        tl.store(out_ptr + s * so_s + heads[:, None] * so_h + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=om)
    else:
        tl.store(part_o_ptr + s * sp_s + heads[:, None] * sp_h + split * sp_n + d[None, :], o, mask=om)
        tl.store(part_lse_ptr + s * sl_s + heads * sl_h + split, m_i + tl.log2(l_i), mask=gm)
        if MERGE:
            tl.debug_barrier()
            n_splits = tl.cdiv(seq_len, chunk)
            if _last_to_arrive(arrived_ptr + s * tl.num_programs(1) + kvh, n_splits):
                _merge_parts(part_o_ptr, part_lse_ptr, out_ptr, s, heads, gm, d, dm, n_splits,
                             sp_s, sp_h, sp_n, sl_s, sl_h, so_s, so_h, BLOCK_G, BLOCK_D)


@triton.jit
def _split_chunk(seq_len, PART, NGRID, BLOCK_N: tl.constexpr):
    """Positions a split of a sequence of ``seq_len`` takes: PART while its PART-position
    splits fit the grid's NGRID, else its positions cut in NGRID chunks of whole tiles."""
    wide = tl.cdiv(tl.cdiv(seq_len, NGRID), BLOCK_N) * BLOCK_N
    return tl.where(tl.cdiv(seq_len, PART) <= NGRID, PART, wide)


@triton.jit
def _split_range(seq_lens_ptr, s, split, PART, NGRID, BLOCK_N: tl.constexpr):
    """(seq_len, chunk, start, end) of split ``split`` of sequence ``s``: its positions
    [start, end), chunk = `_split_chunk`."""
    seq_len = tl.load(seq_lens_ptr + s)
    chunk = _split_chunk(seq_len, PART, NGRID, BLOCK_N)
    start = split * chunk
    return seq_len, chunk, start, tl.minimum(start + chunk, seq_len)


@triton.jit
def _last_to_arrive(slot, n):
    """Bump the counter at ``slot`` (acq_rel, GPU scope); True for the n-th arrival, which
    stores it back to 0 (arrivals.py)."""
    last = tl.atomic_add(slot, 1, sem="acq_rel", scope="gpu") == n - 1
    if last:
        tl.store(slot, 0)
    return last


@triton.jit
def _merge_parts(part_o_ptr, part_lse_ptr, out_ptr, s, heads, hm, d, dm, n_splits,
                 sp_s, sp_h, sp_n, sl_s, sl_h, so_s, so_h,
                 BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[s, heads] = the `n_splits` partials of those heads merged in split order (the
    float32 online log-sum-exp merge, one rounding). Reads past L1: other programs of
    the merging launch wrote the partials."""
    lse_base = part_lse_ptr + s * sl_s + heads * sl_h
    o_base = part_o_ptr + s * sp_s + heads[:, None] * sp_h + d[None, :]
    om = hm[:, None] & dm[None, :]
    m = tl.load(lse_base, mask=hm, other=0.0, cache_modifier=".cg")
    l_sum = m * 0.0
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for i in range(0, n_splits):
        lse = tl.load(lse_base + i, mask=hm, other=0.0, cache_modifier=".cg")
        o = tl.load(o_base + i * sp_n, mask=om, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, lse)
        a = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * a[:, None] + w[:, None] * o
        l_sum = l_sum * a + w
        m = m_new
    tl.store(out_ptr + s * so_s + heads[:, None] * so_h + d[None, :],
             (acc / l_sum[:, None]).to(out_ptr.dtype.element_ty), mask=om)


@triton.jit(do_not_specialize=["NGRID"])  # no variant per grid width
def _decode_reduce_kernel(
    part_o_ptr, part_lse_ptr, seq_lens_ptr, out_ptr,
    sp_s, sp_h, sp_n, sl_s, sl_h, so_s, so_h, G, HD, PART, NGRID,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
    TRIGGER: tl.constexpr,
):
    # Program (kv_head, seq): merge its G heads' partials (one a working split) in split
    # order. PDL, TRIGGER: as the split kernel's.
    if PDL:
        gdc_wait()
    if PDL or TRIGGER:
        gdc_launch_dependents()
    kvh = tl.program_id(0)
    s = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    seq_len = tl.load(seq_lens_ptr + s)
    _merge_parts(part_o_ptr, part_lse_ptr, out_ptr, s, kvh * G + g, g < G, d, d < HD,
                 tl.cdiv(seq_len, _split_chunk(seq_len, PART, NGRID, BLOCK_N)), sp_s, sp_h, sp_n,
                 sl_s, sl_h, so_s, so_h, BLOCK_G, BLOCK_D)


# The split kernel loads a tile's page ids one iteration ahead (PREFETCH), with 3 stages:
# the next tile's K/V copies then stay in flight while a tile computes (compiled for sm_90:
# bench/probes/kernel_resources.py). Off until a decode row on a GPU says it wins.
PAGE_PREFETCH = False


def decode_attention_triton(q, k_cache, v_cache, seq_lens, block_tables, scale: float,
                            partition: int | None = None, config: dict | None = None) -> torch.Tensor:
    """Split-K paged decode attention; see ``decode_attention_ref``.

    q [S, H, D]; caches [P, KVH, page, D]; seq_lens int32 [S] (>= 1); block_tables
    int32 [S, max_pages]. ``partition`` (positions per split, a multiple of the KV tile)
    overrides the heuristic (tests use it to force several splits); ``config`` the split
    kernel's tile (keys BLOCK_N, warps, stages, prefetch: page ids a tile ahead;
    bench/probes/decode_attention_tiles.py). Tile and splits: kernels/gpu/decode_plan.py
    (in the batch-invariant mode, unless ``partition`` or ``config`` is given, its fixed
    plan, and the tile's INVARIANT steps).
    """
    S, H, D = q.shape
    _, KVH, page, _ = k_cache.shape
    out = torch.empty_like(q)
    if S == 0:
        return out
    G = H // KVH
    cfg = config or {}
    prefetch = cfg.get("prefetch", PAGE_PREFETCH)
    bound = max(1, block_tables.shape[1] * page)
    invariant = batch_invariant_on() and partition is None and config is None
    block_n, part, n_split = decode_plan(S, KVH, H, D, bound, partition, cfg.get("BLOCK_N"), invariant)
    direct = n_split == 1
    # the last split of a (seq, kv head) merges, unless counters would have to be made
    # inside a graph capture: then a second launch does (arrivals.py)
    arrived = None if direct else arrival_counts("attention", S * KVH, q.device, required=False)
    if direct:
        part_o = out.new_empty((1, 1, 1, 1), dtype=torch.float32)
        part_lse = out.new_empty((1, 1, 1), dtype=torch.float32)
    else:
        part_o = out.new_empty((S, H, n_split, D), dtype=torch.float32)
        part_lse = out.new_empty((S, H, n_split), dtype=torch.float32)
    merge = arrived is not None
    block_d, block_g = triton.next_power_of_2(D), max(16, triton.next_power_of_2(G))
    _decode_split_kernel[(n_split, KVH, S)](
        q, k_cache, v_cache, seq_lens, block_tables, part_o, part_lse, out,
        arrived if merge else seq_lens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), scale * _LOG2E, G, D, page, part, n_split,
        BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d,
        DIRECT=direct, MERGE=merge, PREC=dot_precision(q.dtype),
        TRIGGER=(direct or merge) and pdl_enabled(q.device), PREFETCH=prefetch, INVARIANT=invariant,
        num_warps=cfg.get("warps", 4), num_stages=cfg.get("stages", 3 if prefetch else 2),
        **pdl_launch(q.device, "attention"),
    )
    if not (direct or merge):
        _decode_reduce_kernel[(KVH, S)](
            part_o, part_lse, seq_lens, out,
            part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1), G, D, part, n_split, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n,
            TRIGGER=pdl_enabled(q.device), num_warps=4, **pdl_launch(q.device, "attention"),
        )
    return out
