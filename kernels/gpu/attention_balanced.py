"""Triton paged decode attention over equal shares of the batch's KV tiles.

The split kernel (:mod:`.attention`) runs one program per (split, KV head, sequence), so
its grid grows with the batch: at 64 sequences of 1k positions, 1,024 programs of four
tiles each run in ~2.6 waves of an H100's resident blocks, and the kernel read the cache
at 0.70 of the copy rate, where 128 sequences (one full wave) read at 0.88 (bench/NOTES.md).
Here a fixed grid of ``P`` programs (about the SMs' resident blocks) divides the batch's
tiles evenly, so every program streams about the same bytes and all finish together.

Work. A *tile* is ``BLOCK_N`` KV positions of one (sequence, KV head); tiles are numbered
in (sequence, KV head, position) order, ``W = KVH * sum_s cdiv(len_s, BLOCK_N)``. With
``Q = min(P, W)``, program ``p < Q`` takes tiles ``[p*W//Q, (p+1)*W//Q)`` (at least one);
programs from ``Q`` on return at once. A *segment* is the run of a program's tiles in one
(sequence, KV head). A segment inside the program's range covers its whole (sequence, KV
head), whose output the program writes. Only a program's first and last segments can be
*shared* with its neighbours: it stores the normalized partial output and log2-sum-exp of
such a segment in its slot 0 (its first segment) or 1 (its last), ``parts [P, 2, G, D]``,
then bumps the (sequence, KV head)'s arrival counter (`arrivals.py`); the program that
brings it to the number of shares merges them in tile order, as the split kernel's merge
does (float32 online log-sum-exp, one rounding). Share ``j`` of a segment whose first
tile is ``a`` is held by program ``owner(a) + j``, where ``owner(x) = ((x+1)*Q - 1)//W``
is the program whose range holds tile ``x``; its slot is 1 when that program's range
starts before ``a`` (only share 0's can), else 0.

A segment's tiles run through `attention._attend_range` (page ids inline or a tile
ahead), the same online softmax as the split kernel's. Which tiles a sequence's output
sums depends on the whole batch's lengths, so its bits do too (as the split kernel's
partition depends on the batch size).

Nothing here synchronizes with the host: the grid is ``P`` (from the device and the
tile), the work list is computed by each program from ``seq_lens``, so the launch can be
captured in a CUDA graph. PDL: the lengths and the first page ids (host-copied before the
step, written by no kernel: pdl.py's protocol) are read before the wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arrivals import arrival_counts
from .attention import _LOG2E, _attend_range, _last_to_arrive, _tile_pages, dot_precision
from .pdl import gdc_launch_dependents, gdc_wait, pdl_enabled, pdl_launch

__all__ = ["decode_attention_balanced_triton", "balanced_config"]


@triton.jit
def _owner(x, Q, W):
    """The program whose tile range holds tile ``x`` (int64)."""
    return ((x + 1) * Q - 1) // W


@triton.jit
def _merge_shares(part_o_ptr, part_lse_ptr, out_ptr, s, heads, g, gm, d, dm, a, n, Q, W,
                  sp_p, sp_h, sl_p, so_s, so_h, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[s, heads] = the ``n`` shares of the segment whose first tile is ``a``, merged
    in tile order. Reads past L1: other programs of this launch stored the shares."""
    first = _owner(a, Q, W)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    om = gm[:, None] & dm[None, :]
    for j in range(0, n):
        prog = first + j
        slot = tl.where(prog * W // Q < a, 1, 0)  # only share 0's program can start before a
        row = prog * 2 + slot
        lse = tl.load(part_lse_ptr + row * sl_p + g, mask=gm, other=0.0, cache_modifier=".cg")
        o = tl.load(part_o_ptr + row * sp_p + g[:, None] * sp_h + d[None, :], mask=om, other=0.0,
                    cache_modifier=".cg")
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + w[:, None] * o
        l_sum = l_sum * alpha + w
        m = m_new
    tl.store(out_ptr + s * so_s + heads[:, None] * so_h + d[None, :],
             (acc / l_sum[:, None]).to(out_ptr.dtype.element_ty), mask=om)


@triton.jit
def _decode_balanced_kernel(
    q_ptr, kc_ptr, vc_ptr, seq_lens_ptr, bt_ptr, part_o_ptr, part_lse_ptr, out_ptr, arrived_ptr,
    sq_s, sq_h, s_kp, s_kh, s_kt, s_vp, s_vh, s_vt, s_bt, sp_p, sp_h, sl_p, so_s, so_h,
    scale_log2, S, KVH, G, HD, PAGE,
    BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PREC: tl.constexpr, PDL: tl.constexpr, TRIGGER: tl.constexpr, PREFETCH: tl.constexpr,
):
    # Program p of P: tiles [p*W//Q, (p+1)*W//Q) of the (sequence, KV head, position)
    # order, in segments (module docstring). The lengths and the work list come before
    # the PDL wait (host-copied inputs).
    p = tl.program_id(0).to(tl.int64)
    P = tl.num_programs(0).to(tl.int64)
    sidx = tl.arange(0, BLOCK_S)
    lens = tl.load(seq_lens_ptr + sidx, mask=sidx < S, other=0)
    n_tiles = (lens + BLOCK_N - 1) // BLOCK_N  # per KV head
    ends = tl.cumsum(n_tiles.to(tl.int64) * KVH, 0)  # a sequence's tiles end here
    W = tl.sum(n_tiles.to(tl.int64) * KVH, 0)
    Q = tl.minimum(P, W)
    i = p * W // tl.maximum(Q, 1)
    i1 = (p + 1) * W // tl.maximum(Q, 1)
    # the first tile's (sequence, KV head, tile)
    s = tl.sum((ends <= i).to(tl.int32), 0)
    here = sidx == s
    seq_len = tl.sum(tl.where(here, lens, 0), 0)
    nt = tl.sum(tl.where(here, n_tiles, 0), 0).to(tl.int64)
    rem = i - tl.sum(tl.where(here, ends, 0), 0) + nt * KVH
    kvh = rem // tl.maximum(nt, 1)
    t = rem - kvh * nt
    bt_row = bt_ptr + s.to(tl.int64) * s_bt
    pages = t * BLOCK_N  # unused without PREFETCH
    if PREFETCH:
        pages = _tile_pages(bt_row, t * BLOCK_N, seq_len, PAGE, BLOCK_N)
    if PDL:
        gdc_wait()
    if PDL or TRIGGER:
        gdc_launch_dependents()
    if p >= Q:
        return
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gm = g < G
    dm = d < HD
    om = gm[:, None] & dm[None, :]
    while i < i1:
        t_end = tl.minimum(nt, t + (i1 - i))  # this segment: tiles [t, t_end) of (s, kvh)
        heads = kvh * G + g
        q = tl.load(q_ptr + s * sq_s + heads[:, None] * sq_h + d[None, :], mask=om,
                    other=0.0).to(kc_ptr.dtype.element_ty)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        m_i, l_i, acc = _attend_range(q, m_i, l_i, acc, kc_ptr + kvh * s_kh, vc_ptr + kvh * s_vh,
                                      bt_row, pages, t * BLOCK_N,
                                      tl.minimum(t_end * BLOCK_N, seq_len), d, dm,
                                      s_kp, s_kt, s_vp, s_vt, PAGE, scale_log2, BLOCK_N, PREC, PREFETCH)
        o = acc / l_i[:, None]
        a = i - t  # the segment's first and last + 1 tiles, in the whole order
        b = a + nt
        if (a >= p * W // Q) & (b <= i1):  # the whole (s, kvh): the output
            tl.store(out_ptr + s * so_s + heads[:, None] * so_h + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=om)
        else:  # a share: slot 0 for the first segment of this program, 1 for its last
            row = p * 2 + tl.where(a <= p * W // Q, 0, 1)
            tl.store(part_o_ptr + row * sp_p + g[:, None] * sp_h + d[None, :], o, mask=om)
            tl.store(part_lse_ptr + row * sl_p + g, m_i + tl.log2(l_i), mask=gm)
            tl.debug_barrier()
            n = _owner(b - 1, Q, W) - _owner(a, Q, W) + 1
            if _last_to_arrive(arrived_ptr + s * KVH + kvh, n):
                _merge_shares(part_o_ptr, part_lse_ptr, out_ptr, s, heads, g, gm, d, dm, a, n, Q, W,
                              sp_p, sp_h, sl_p, so_s, so_h, BLOCK_G, BLOCK_D)
        # the next segment starts at tile 0 of the next (s, kvh)
        i += t_end - t
        t = t * 0
        kvh += 1
        if kvh == KVH:
            kvh = kvh * 0
            s += 1
            seq_len = tl.load(seq_lens_ptr + tl.minimum(s, S - 1))
            nt = ((seq_len + BLOCK_N - 1) // BLOCK_N).to(tl.int64)
            bt_row = bt_ptr + s.to(tl.int64) * s_bt
        if PREFETCH:
            pages = _tile_pages(bt_row, 0, seq_len, PAGE, BLOCK_N)


def balanced_config(num_seqs: int, head_dim: int) -> dict:
    """The default tile: KV positions a tile (``BLOCK_N``), warps, stages, page ids a
    tile ahead (``prefetch``), programs an SM (``per_sm``) and a register cap
    (``maxnreg``). Offline (sm_90, bench/probes/kernel_resources.py) the kernel takes
    164-228 registers uncapped (the segment loop around the tile loop), 2 blocks an SM at
    64-position tiles; capped at 168, 3 blocks an SM at 32 and 64 positions, no spills
    (128 spills). So 3 programs an SM until a GPU ranks the keys
    (bench/probes/decode_attention_tiles.py)."""
    return dict(BLOCK_N=32, warps=4, stages=3, prefetch=True, per_sm=3, maxnreg=168)


def _programs(device: torch.device, per_sm: int) -> int:
    """Grid size: ``per_sm`` programs on each SM (on the CPU interpreter, 8)."""
    if device.type != "cuda":
        return 8
    return per_sm * torch.cuda.get_device_properties(device).multi_processor_count


def decode_attention_balanced_triton(q, k_cache, v_cache, seq_lens, block_tables, scale: float,
                                     config: dict | None = None) -> torch.Tensor | None:
    """Paged decode attention over equal shares of the tiles; see ``decode_attention_ref``.

    q [S, H, D]; caches [P, KVH, page, D]; seq_lens int32 [S] (>= 1); block_tables
    int32 [S, max_pages]. ``config`` overrides :func:`balanced_config`'s keys, and
    ``programs`` sets the grid. None where the arrival counters would have to be made
    inside a graph capture (the caller takes the split kernel then: arrivals.py)."""
    S, H, D = q.shape
    _, KVH, page, _ = k_cache.shape
    out = torch.empty_like(q)
    if S == 0:
        return out
    arrived = arrival_counts("attention", S * KVH, q.device, required=False)
    if arrived is None:
        return None
    G = H // KVH
    cfg = dict(balanced_config(S, D), **(config or {}))
    block_n = cfg["BLOCK_N"]
    most = S * KVH * triton.cdiv(max(1, block_tables.shape[1] * page), block_n)
    programs = max(1, min(cfg.get("programs") or _programs(q.device, cfg["per_sm"]), most))
    block_d, block_g = triton.next_power_of_2(D), max(16, triton.next_power_of_2(G))
    part_o = out.new_empty((programs * 2, G, D), dtype=torch.float32)
    part_lse = out.new_empty((programs * 2, G), dtype=torch.float32)
    _decode_balanced_kernel[(programs,)](
        q, k_cache, v_cache, seq_lens, block_tables, part_o, part_lse, out, arrived,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        part_o.stride(0), part_o.stride(1), part_lse.stride(0), out.stride(0), out.stride(1),
        scale * _LOG2E, S, KVH, G, D, page,
        BLOCK_S=triton.next_power_of_2(S), BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d,
        PREC=dot_precision(q.dtype), TRIGGER=pdl_enabled(q.device), PREFETCH=cfg["prefetch"],
        num_warps=cfg["warps"], num_stages=cfg["stages"], **pdl_launch(q.device, "attention"),
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
    )
    return out
