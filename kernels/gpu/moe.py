"""Triton MoE experts: sorted grouped GEMMs with SwiGLU fused, deterministic combine.

Contract: :func:`phalanx.kernels.moe.fused_experts_ref`. Steps, no host sync (so the
whole call can be captured in a CUDA graph):

1. align (``_align_kernel``, after ``_count_kernel`` past ``ALIGN_ONE_LAUNCH_ROWS``
   pairs an expert): the T*k (token, slot) pairs,
   ``pair = t * k + slot``, are sorted by local expert (stable, no atomics); each
   expert's run is padded to a multiple of BLOCK_M,
   giving ``sorted_ids`` [max_blocks * BLOCK_M] (pair id, or ``P`` = padding) and
   ``block_expert`` [max_blocks] (local expert of each row block, ``>= E`` = unused).
   ``max_blocks = cdiv(P, BLOCK_M) + min(E, P)`` bounds the real blocks from shapes.
2. ``_gate_up_kernel``: per row block and I-tile, ``x[rows] @ w13[e].T`` into a gate
   and an up accumulator; epilogue ``silu(gate) * up`` into ``inter`` [rows, I]
   (row = padded sorted position).
3. ``_down_kernel``: ``inter[rows] @ w2[e].T * topk_weight`` into ``pair_out``
   [P, H], one row per pair.
4. ``_combine_kernel``: ``out[t] = sum over slots 0..k-1`` of the local pairs, in
   slot order, float32 accumulation: no atomics, so each token's result does not
   depend on the batch it is in.

Small batches (``P = T * k <= SMALL_MAX_PAIRS``) skip all of this: see
:mod:`phalanx.kernels.gpu.moe_decode` (one GEMV program per pair and I-tile, then one per
token and H-tile that sums the token's slots: 2 launches instead of 4, no sort). Its
default mode computes each element with the same ``tl.dot`` K-order and roundings as
steps 2-4 at BLOCK_M=16, meant to give a token the same bits on either side of the
threshold (checked bit-for-bit by ``bench/kernels_gpu.py`` on the GPU; under the
interpreter only with equal tiles, see moe_decode).

Roundings follow the reference (each linear's output, ``silu(gate)``, ``silu * up``
and ``h * w`` rounded to ``x.dtype``); only the final sum differs (float32, one
rounding, instead of ``index_add_`` in ``x.dtype`` expert by expert). Local expert
ids outside ``[0, E)`` are treated as not held (the reference raises).

The pair count ``P`` and ``max_blocks`` follow the step's token count, so the kernels do
not specialise on them (``do_not_specialize``): otherwise each would compile again for
every combination of their values being 1, a multiple of 16 or neither, which a
serving engine's warm-up (engine/warmup.py) could only cover by trying them all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import moe_decode
from .attention import dot_precision

__all__ = ["fused_experts_triton", "SMALL_MAX_PAIRS"]

# Pairs (T * top_k) up to which fused_experts_triton takes the small-batch path
# (moe_decode: 2 launches, no align/combine). 32 = T <= 4 at top-8. Why: the general
# path's fixed cost is 4 dependent launches (align, gate_up, down, combine) on top
# of the weight reads, which dominates at T=1 (33.6 us vs an 18 us floor on an H200).
# The small path instead reads an expert's weights once per *pair*, not once per expert:
# at 128 experts top-8, T=4 has ~29 distinct experts for 32 pairs (~10% re-reads, which
# should mostly hit L2: the same tile of every pair runs in one wave), T=8 ~52 for
# 64 (~25%): past ~32 pairs the re-reads are expected to cost about what the saved
# launches save, and its down kernel's per-token programs loop over all k slots.
# Not measured yet: bench/kernels_gpu.py times both paths at T=1, 2, 4, 8 to place the
# crossover (the dispatch is from shapes only, so it stays CUDA-graph capturable).
SMALL_MAX_PAIRS = 32


@triton.jit
def block_pairs(sorted_ptr, b, P, BLOCK_M: tl.constexpr):
    """Row block ``b`` of the sorted pairs: its rows, their pair ids (``P`` = padding) and
    which are real."""
    rows = b * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    return rows, pair, pair < P


@triton.jit(do_not_specialize=["P"])
def _gate_up_kernel(
    x_ptr, w_ptr, inter_ptr, sorted_ptr, bexp_ptr,
    P, K_TOP, HID, I, E, sx_t, sw_e, sw_n, si_r,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
):
    # w13[e] is [2I, HID] (gate rows 0..I-1, up rows I..2I-1), HID contiguous.
    b = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.load(bexp_ptr + b).to(tl.int64)
    if e >= E:
        return
    rows, pair, rm = block_pairs(sorted_ptr, b, P, BLOCK_M)
    tok = (pair // K_TOP).to(tl.int64)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < I
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tok[:, None] * sx_t
    w_gate = w_ptr + e * sw_e + n[None, :].to(tl.int64) * sw_n  # [1, BLOCK_N] row starts
    w_up = w_gate + I * sw_n
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, HID, BLOCK_K):
        k = k0 + kk
        km = k < HID
        a = tl.load(x_rows + k[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        wm = km[:, None] & nm[None, :]
        wg = tl.load(w_gate + k[:, None], mask=wm, other=0.0)  # [BLOCK_K, BLOCK_N]
        wu = tl.load(w_up + k[:, None], mask=wm, other=0.0)
        acc_g = tl.dot(a, wg, acc=acc_g, input_precision=PREC)
        acc_u = tl.dot(a, wu, acc=acc_u, input_precision=PREC)
    ty = inter_ptr.dtype.element_ty
    g = acc_g.to(ty).to(tl.float32)
    u = acc_u.to(ty).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)
    tl.store(inter_ptr + rows[:, None].to(tl.int64) * si_r + n[None, :], (s * u).to(ty),
             mask=rm[:, None] & nm[None, :])


@triton.jit(do_not_specialize=["P"])
def _down_kernel(
    inter_ptr, w_ptr, pair_out_ptr, sorted_ptr, bexp_ptr, tw_ptr,
    P, HID, I, E, si_r, sw_e, sw_n, so_r,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
):
    # w2[e] is [HID, I], I contiguous. Output row = pair id (unsorted), scaled by its weight.
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
    w_rows = w_ptr + e * sw_e + n[None, :].to(tl.int64) * sw_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + kk
        km = k < I
        a = tl.load(a_rows + k[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        w = tl.load(w_rows + k[:, None], mask=km[:, None] & nm[None, :], other=0.0)
        acc = tl.dot(a, w, acc=acc, input_precision=PREC)
    ty = pair_out_ptr.dtype.element_ty
    wt = tl.load(tw_ptr + pair, mask=rm, other=0.0).to(ty).to(tl.float32)
    h = acc.to(ty).to(tl.float32) * wt[:, None]
    tl.store(pair_out_ptr + pair[:, None].to(tl.int64) * so_r + n[None, :], h.to(ty),
             mask=rm[:, None] & nm[None, :])


@triton.jit
def _combine_kernel(pair_out_ptr, ids_ptr, out_ptr, HID, K_TOP, E, BLOCK: tl.constexpr):
    # out[t] = sum over slots (in order) with 0 <= ids[t, slot] < E of pair_out[t * K_TOP + slot].
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for j in range(0, K_TOP):
        e = tl.load(ids_ptr + t * K_TOP + j)
        lim = tl.where((e >= 0) & (e < E), HID, 0)  # non-local pair: nothing written, read nothing
        v = tl.load(pair_out_ptr + (t * K_TOP + j) * HID + cols, mask=cols < lim, other=0.0)
        acc += v.to(tl.float32)
    tl.store(out_ptr + t * HID + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < HID)


@triton.jit(do_not_specialize=["P"])
def _count_kernel(ids_ptr, counts_ptr, P, BLOCK: tl.constexpr):
    # Program e: counts[e] = number of pairs whose local expert is e.
    e = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.int32)
    for p0 in range(0, P, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1)
        acc += (ids == e).to(tl.int32)
    tl.store(counts_ptr + e, tl.sum(acc, axis=0))


@triton.jit(do_not_specialize=["P", "max_blocks"])
def _align_kernel(ids_ptr, counts_ptr, sorted_ptr, bexp_ptr, P, E, max_blocks,
                  BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK: tl.constexpr,
                  COUNTED: tl.constexpr):
    # The pairs of each local expert: COUNTED, from _count_kernel's launch before; else
    # every program counts them all (a histogram of the ids in [0, E)). Program e < E:
    # expert e's run starts at pad_start[e] = sum of the padded counts of experts < e;
    # its pairs go there in pair order (a stable sort), the run's padding rows get P, its
    # blocks get block_expert = e. Program E marks the unused blocks.
    e = tl.program_id(0)
    ev = tl.arange(0, BLOCK_E)
    if COUNTED:
        counts = tl.load(counts_ptr + ev, mask=ev < E, other=0)
    else:
        counts = tl.zeros([BLOCK_E], tl.int32)
        for p0 in range(0, P, BLOCK):
            offs = p0 + tl.arange(0, BLOCK)
            ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1)
            counts += tl.histogram(ids, BLOCK_E, mask=(ids >= 0) & (ids < E))
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    if e == E:
        first = tl.sum(padded, axis=0) // BLOCK_M
        for b0 in range(first, max_blocks, BLOCK):
            bb = b0 + tl.arange(0, BLOCK)
            tl.store(bexp_ptr + bb, tl.zeros([BLOCK], tl.int32) + E, mask=bb < max_blocks)
    else:
        start = tl.sum(tl.where(ev < e, padded, 0), axis=0)
        cnt = tl.sum(tl.where(ev == e, counts, 0), axis=0)
        pad = tl.sum(tl.where(ev == e, padded, 0), axis=0)
        rank = cnt * 0
        for p0 in range(0, P, BLOCK):
            offs = p0 + tl.arange(0, BLOCK)
            hit = tl.load(ids_ptr + offs, mask=offs < P, other=-1) == e
            hit_i = hit.to(tl.int32)
            tl.store(sorted_ptr + start + rank + tl.cumsum(hit_i, axis=0) - 1, offs, mask=hit)
            rank += tl.sum(hit_i, axis=0)
        jj = cnt + tl.arange(0, BLOCK_M)  # < BLOCK_M padding rows
        tl.store(sorted_ptr + start + jj, tl.zeros([BLOCK_M], tl.int32) + P, mask=jj < pad)
        for b0 in range(0, pad // BLOCK_M, BLOCK):
            bb = b0 + tl.arange(0, BLOCK)
            tl.store(bexp_ptr + start // BLOCK_M + bb, tl.zeros([BLOCK], tl.int32) + e,
                     mask=bb < pad // BLOCK_M)


# Pairs an expert (on average) up to which the align step is one launch (each program
# counting every expert itself) instead of a count launch first: the decode tiles'
# bound (`_config`, `moe_fp8._config`), so the choice adds no compiled variant beyond the
# tiles'. One H100, 128 experts (bench/NOTES.md): at decode batches 16-128 (128-1024
# pairs) one launch is 73-77 µs a 24-layer step against 96-99 for two, steps 0.3-0.8%
# faster; at an 8x2048 prefill (131072 pairs) it took 243 µs a layer against 178 (each
# program's histogram of every pair costs more than a count of one expert's).
ALIGN_ONE_LAUNCH_ROWS = 16


def _align(ids: torch.Tensor, num_experts: int, block_m: int):
    """Sort pairs by expert, pad each expert's run to block_m; see the module docstring.

    ids: int32 [P] local expert per pair (outside [0, E) = not local). Returns
    (sorted_ids int32 [max_blocks*block_m], block_expert int32 [max_blocks], max_blocks);
    sorted_ids past the last used block are never read.
    """
    P, E = ids.shape[0], num_experts
    max_blocks = triton.cdiv(P, block_m) + min(E, P)
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=ids.device)
    block = 1024 if P > 256 else 256
    counted = P > ALIGN_ONE_LAUNCH_ROWS * E
    counts = torch.empty(E, dtype=torch.int32, device=ids.device) if counted else ids  # dummy pointer
    if counted:
        _count_kernel[(E,)](ids, counts, P, BLOCK=block, num_warps=4)
    _align_kernel[(E + 1,)](ids, counts, sorted_ids, block_expert, P, E, max_blocks,
                            BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(E), BLOCK=block,
                            COUNTED=counted, num_warps=4)
    return sorted_ids, block_expert, max_blocks


def _config(num_pairs: int, num_experts: int, itemsize: int = 2) -> dict:
    """Tile sizes by rows per expert: decode (few rows) -> BLOCK_M 16, prefill -> 64.

    One H200, triton 3.6, bf16, Qwen3-30B-A3B shapes (128 experts, top-8, hidden 2048,
    I 768), CUDA-graph replay: T=16/64/128 reach the weight-read floor at 4.0 TB/s
    (187/292/299 us) and no other BLOCK_M=16 tile (N 32..128, K 128..256, 3-4 stages)
    did better than noise; T=1 is 33 us (floor 19, launch-bound: 5 kernels);
    T=2048 (128 rows per expert) 655-698 us with (128, 128, 64, 128 | 256, 64, 8 warps, 3
    stages) against 675-728 with (64, 64, 64, 128, 64, 4, 3); T=8192 1659 against 1841;
    T=16384 (1024 rows per expert, an 8x2048 prefill) 3147 against 3517
    (bench/probes/moe_prefill_tiles.py, bench/NOTES.md); the 48-layer 8x2048 prefill's
    experts 146.5 -> 122.4 ms. Those 128-row tiles start past 128 rows per expert (fewer
    would be mostly padding) and in 2-byte dtypes only (float32's would not fit shared
    memory). K tiles stay 64 from 32 rows per expert up. gate_up holds two [M, N] fp32
    accumulators.
    """
    avg = num_pairs / max(1, num_experts)
    if avg <= 16:
        return dict(BLOCK_M=16, N1=64, K1=128, N2=64, K2=128, warps=4, stages=3)
    if avg <= 48:
        return dict(BLOCK_M=32, N1=64, K1=64, N2=64, K2=128, warps=4, stages=3)
    if avg <= 128 or itemsize > 2:
        return dict(BLOCK_M=64, N1=64, K1=64, N2=128, K2=64, warps=4, stages=3)
    return dict(BLOCK_M=128, N1=128, K1=64, N2=256, K2=64, warps=8, stages=3)


def fused_experts_triton(x, topk_weights, topk_ids, w13, w2, expert_map=None, *,
                         path: str | None = None, pairs: bool = False) -> torch.Tensor:
    """SwiGLU experts with weighted top-k combine; see ``fused_experts_ref``.

    x [T, H]; topk_weights [T, k]; topk_ids int [T, k] global ids; w13 [E, 2I, H];
    w2 [E, H, I]; expert_map optional int [E_global] (-1 = not local). Returns [T, H].
    path: None (auto: "small" iff T * k <= SMALL_MAX_PAIRS, decided from shapes only),
    "small" (moe_decode) or "general" (sorted grouped GEMMs). ``pairs``: the general
    path's per-pair outputs [T, k, H] instead (0 for a pair not held), no combine.
    """
    T, hid = x.shape
    if T == 0:
        return x.new_zeros((0, topk_ids.shape[1], hid) if pairs else (0, hid))
    if pairs:
        path = "general"
    if path is None:
        path = "small" if T * topk_ids.shape[1] <= SMALL_MAX_PAIRS else "general"
    if path == "small":
        return moe_decode.fused_experts_small_triton(x, topk_weights, topk_ids, w13, w2, expert_map)
    if path != "general":
        raise ValueError(f"path must be None, 'small' or 'general', got {path!r}")
    E, two_i, _ = w13.shape
    inter_dim = two_i // 2
    k_top = topk_ids.shape[1]
    P = T * k_top
    ids = topk_ids.reshape(-1)
    ids = (expert_map[ids] if expert_map is not None else ids).to(torch.int32)
    cfg = _config(P, E, x.element_size())
    bm = cfg["BLOCK_M"]
    sorted_ids, block_expert, max_blocks = _align(ids, E, bm)
    x = x if x.stride(-1) == 1 else x.contiguous()
    w13 = w13 if w13.stride(-1) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(-1) == 1 else w2.contiguous()
    inter = x.new_empty((max_blocks * bm, inter_dim))
    _gate_up_kernel[(max_blocks, triton.cdiv(inter_dim, cfg["N1"]))](
        x, w13, inter, sorted_ids, block_expert,
        P, k_top, hid, inter_dim, E, x.stride(0), w13.stride(0), w13.stride(1), inter.stride(0),
        BLOCK_M=bm, BLOCK_N=cfg["N1"], BLOCK_K=cfg["K1"], PREC=dot_precision(x.dtype),
        num_warps=cfg["warps"], num_stages=cfg["stages"],
    )
    pair_out = x.new_zeros((P, hid)) if pairs else x.new_empty((P, hid))
    weights = topk_weights.reshape(-1).contiguous()
    _down_kernel[(max_blocks, triton.cdiv(hid, cfg["N2"]))](
        inter, w2, pair_out, sorted_ids, block_expert, weights,
        P, hid, inter_dim, E, inter.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0),
        BLOCK_M=bm, BLOCK_N=cfg["N2"], BLOCK_K=cfg["K2"], PREC=dot_precision(x.dtype),
        num_warps=cfg["warps"], num_stages=cfg["stages"],
    )
    if pairs:
        return pair_out.view(T, k_top, hid)
    return combine_pairs(pair_out, ids, T, k_top, E, x.dtype)


def combine_pairs(pair_out, ids, T: int, k_top: int, E: int, dtype: torch.dtype) -> torch.Tensor:
    """``_combine_kernel`` over ``pair_out`` [T * k, H]: a new [T, H] of ``dtype``."""
    hid = pair_out.shape[-1]
    out = pair_out.new_empty((T, hid), dtype=dtype)  # contiguous: the kernel writes rows of HID
    block = min(1024, triton.next_power_of_2(hid))
    _combine_kernel[(T, triton.cdiv(hid, block))](pair_out, ids, out, hid, k_top, E, BLOCK=block,
                                                        num_warps=4)
    return out


def sum_slots_triton(pairs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``kernels.moe.sum_slots`` in one launch: every pair counts (ids all local), slot
    order, float32 accumulator, one cast; the same bits as the torch adds."""
    T, k_top, _ = pairs.shape
    pairs = pairs.reshape(T * k_top, -1)
    pairs = pairs if pairs.stride(-1) == 1 and pairs.stride(0) == pairs.shape[1] else pairs.contiguous()
    ids = torch.zeros(T * k_top, dtype=torch.int32, device=pairs.device)
    return combine_pairs(pairs, ids, T, k_top, 1, dtype)
