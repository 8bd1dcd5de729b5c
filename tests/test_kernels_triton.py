"""Triton kernels vs their torch references, on CPU under Triton's interpreter.

Triton must be imported with ``TRITON_INTERPRET=1`` already in the environment, which
pytest cannot promise for its own process (another test may have imported triton
first). So the checks run in one subprocess: this file, executed as a script with
``TRITON_INTERPRET=1``, forces the Triton path (``kernels.backend.force_triton``) on
float32 CPU tensors, runs every ``check_*`` function and prints a JSON line of
``{name: {"err": max relative error} | {"error": traceback}}``; the pytest tests below
read that line. Every check goes through the public kernel functions, so it covers the
dispatch too. Inputs are fresh random values (never zeros).
"""

from __future__ import annotations

import pytest
import torch
from interpreter_checks import reference_test, rel_err, results_fixture, run_kernel_checks

TOL = 1e-4  # float32 under the interpreter lands near 1e-7

# ---------------------------------------------------------------- checks (subprocess)


def check_rms_norm(g: torch.Generator) -> float:
    from phalanx.kernels.norm import rms_norm, rms_norm_ref

    errs = []
    for shape in [(1, 64), (7, 48), (2, 3, 5, 32)]:
        x = torch.randn(*shape, generator=g) * 3
        w = 1 + 0.1 * torch.randn(shape[-1], generator=g)
        errs.append(rel_err(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)))
    # A strided per-head view, as q = qkv[:, :heads*hd].view(T, heads, hd) in the model.
    qkv = torch.randn(5, 8 * 16 + 40, generator=g)
    q = qkv[:, : 8 * 16].view(5, 8, 16)
    w = 1 + 0.1 * torch.randn(16, generator=g)
    errs.append(rel_err(rms_norm(q, w, 1e-6), rms_norm_ref(q, w, 1e-6)))
    return max(errs)


def check_add_rms_norm(g: torch.Generator) -> float:
    from phalanx.kernels.norm import add_rms_norm, add_rms_norm_ref

    errs = []
    for shape in [(1, 64), (9, 80)]:
        x, r = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
        w = 1 + 0.1 * torch.randn(shape[-1], generator=g)
        x0, r0 = x.clone(), r.clone()
        out, res = add_rms_norm(x, r, w, 1e-5)
        ref_out, ref_res = add_rms_norm_ref(x, r, w, 1e-5)
        assert torch.equal(x, x0) and torch.equal(r, r0), "inputs modified"
        errs += [rel_err(out, ref_out), rel_err(res, ref_res)]
    return max(errs)


def check_exponential_race(g: torch.Generator) -> float:
    """The fused race draws exactly the reference's tokens (the same noise, hashed in
    registers); returned as the share of rows that differ (must be 0)."""
    from phalanx.kernels.sampling import exponential_race, exponential_race_ref

    differ = rows = 0
    for b, v in [(1, 7), (5, 3000), (9, 40000)]:  # 40000: several chunks per row
        probs = torch.softmax(torch.randn(b, v, generator=g) * 3, dim=1)
        probs[0, : v // 2] = 0.0  # filtered tokens never win
        probs[0] /= probs[0].sum()
        seeds = torch.randint(0, 2**62, (b,), generator=g)
        got, want = exponential_race(probs, seeds), exponential_race_ref(probs, seeds)
        assert int(got[0]) >= v // 2
        differ += int((got != want).sum())
        rows += b
    return differ / rows


def check_silu_and_mul(g: torch.Generator) -> float:
    from phalanx.kernels.activation import silu_and_mul, silu_and_mul_ref

    errs = []
    for shape in [(1, 64), (5, 3, 96), (4, 2 * 1500)]:
        x = torch.randn(*shape, generator=g) * 2
        errs.append(rel_err(silu_and_mul(x), silu_and_mul_ref(x)))
    return max(errs)


def check_rope(g: torch.Generator) -> float:
    from phalanx.kernels.attention import write_kv_ref
    from phalanx.kernels.norm import rms_norm_ref
    from phalanx.kernels.rope import RotaryEmbedding, apply_rope_ref

    errs = []
    for T, nq, nk, hd in [(1, 8, 2, 16), (9, 8, 2, 16), (4, 6, 2, 128)]:
        rope = RotaryEmbedding(hd, 512, 1_000_000.0)
        qkv = torch.randn(T, (nq + 2 * nk) * hd, generator=g)  # strided views, as in the model
        q = qkv[:, : nq * hd].view(T, nq, hd)
        k = qkv[:, nq * hd : (nq + nk) * hd].view(T, nk, hd)
        pos = torch.randint(0, 512, (T,), generator=g)
        out_q, out_k = rope.apply(q, k, pos)
        ref_q, ref_k = apply_rope_ref(q, k, pos, rope.cos_cache, rope.sin_cache)
        errs += [rel_err(out_q, ref_q), rel_err(out_k, ref_k)]
        # fused q/k RMS-norm + rope (Qwen3) against norm-then-rope references
        qw, kw = 1 + 0.1 * torch.randn(hd, generator=g), 1 + 0.1 * torch.randn(hd, generator=g)
        out_q, out_k = rope.apply(q, k, pos, qw, kw, 1e-6)
        ref_q, ref_k = apply_rope_ref(rms_norm_ref(q, qw, 1e-6), rms_norm_ref(k, kw, 1e-6), pos,
                                      rope.cos_cache, rope.sin_cache)
        errs += [rel_err(out_q, ref_q), rel_err(out_k, ref_k)]
        # rope + KV write in one launch: the cache ends as rope-then-write_kv_ref leaves it
        v = qkv[:, (nq + nk) * hd:].view(T, nk, hd)
        for page_size in (1, 4):
            slots = torch.randperm(3 * T * page_size, generator=g)[:T]
            slots[0] = -1  # padding: nothing stored
            caches = [torch.randn(3 * T, nk, page_size, hd, generator=g) for _ in range(2)]
            want = [c.clone() for c in caches]
            out_q, out_k = rope.apply_and_cache(q, k, pos, qw, kw, 1e-6, kv_write=(v, *caches, slots))
            write_kv_ref(out_k, v, *want, slots)
            assert torch.equal(out_k, rope.apply(q, k, pos, qw, kw, 1e-6)[1])
            assert all(torch.equal(a, b) for a, b in zip(caches, want)), "rope KV write != write_kv_ref"
            errs.append(rel_err(out_q, ref_q))
            # as the model calls it: k only into the cache, not returned
            again = [torch.randn_like(c) for c in caches]
            only_q, no_k = rope.apply_and_cache(q, k, pos, qw, kw, 1e-6,
                                                kv_write=(v, *again, slots), keep_k=False)
            assert no_k is None and torch.equal(only_q, out_q)
            assert all(torch.equal(a[s], b[s]) for a, b in zip(again, caches)
                       for s in _written(slots, page_size)), "keep_k=False KV write differs"
    return max(errs)


def _written(slots: torch.Tensor, page_size: int) -> list[tuple[int, slice, int]]:
    """Index of each written slot in a [pages, heads, page_size, D] cache."""
    return [(int(x) // page_size, slice(None), int(x) % page_size) for x in slots if x >= 0]


def check_write_kv(g: torch.Generator) -> float:
    from phalanx.kernels.attention import write_kv, write_kv_ref

    for page_size, hd in [(1, 16), (16, 16), (4, 64)]:
        pages, kvh, T = 12, 2, 9
        k, v = torch.randn(T, kvh, hd, generator=g), torch.randn(T, kvh, hd, generator=g)
        slots = torch.randperm(pages * page_size, generator=g)[:T]
        slots[[0, 5]] = -1  # padding
        kc, vc = torch.randn(pages, kvh, page_size, hd, generator=g), torch.randn(pages, kvh, page_size, hd, generator=g)
        kc_ref, vc_ref = kc.clone(), vc.clone()
        write_kv(k, v, kc, vc, slots)
        write_kv_ref(k, v, kc_ref, vc_ref, slots)
        assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref), f"page_size {page_size}"
    return 0.0


def _paged_cache(g, lens, page_size, kvh, hd):
    """Random caches and shuffled block tables for sequences of ``lens`` tokens.

    Block-table padding entries point far past the pool: a kernel that reads one crashes
    or goes wrong under the interpreter.
    """
    per_seq = max(-(-n // page_size) for n in lens) + 2
    pages = len(lens) * per_seq + 3
    kc = torch.randn(pages, kvh, page_size, hd, generator=g)
    vc = torch.randn(pages, kvh, page_size, hd, generator=g)
    tables = torch.randperm(pages, generator=g)[: len(lens) * per_seq].view(len(lens), per_seq).int()
    for s, n in enumerate(lens):
        tables[s, -(-n // page_size) :] = 10**6
    return kc, vc, tables


def check_decode_attention(g: torch.Generator) -> float:
    from phalanx.kernels.attention import decode_attention, decode_attention_ref
    from unittest import mock

    from phalanx.kernels.gpu import arrivals
    from phalanx.kernels.gpu import attention as gpu_attention
    from phalanx.kernels.gpu import decode_plan
    from phalanx.kernels.gpu.attention import decode_attention_triton

    errs = []
    for page_size, hd, nq, nkv in [(16, 16, 8, 2), (1, 16, 8, 2), (4, 64, 8, 2), (32, 128, 8, 2), (8, 16, 4, 4)]:
        ps = page_size
        lens = [1, max(1, ps - 1), ps, ps + 1, 3 * ps + 7, 150]
        kc, vc, tables = _paged_cache(g, lens, ps, nkv, hd)
        q = torch.randn(len(lens), nq, hd, generator=g)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        ref = decode_attention_ref(q, kc, vc, seq_lens, tables, hd**-0.5)
        errs.append(rel_err(decode_attention(q, kc, vc, seq_lens, tables, hd**-0.5), ref))
        # Short partitions: many splits per sequence, merged by the last split to arrive;
        # and, with no counters (as inside a capture that did not rehearse), by the
        # reduce kernel: the same merge, the same bits.
        merged = decode_attention_triton(q, kc, vc, seq_lens, tables, hd**-0.5, partition=16)
        with mock.patch.object(gpu_attention, "arrival_counts", lambda *a, **k: None):
            reduced = decode_attention_triton(q, kc, vc, seq_lens, tables, hd**-0.5, partition=16)
        assert torch.equal(merged, reduced)
        # A grid of 2 splits, narrower than the table: a sequence past 2 x 16 positions
        # is cut in 2 chunks of whole tiles instead; merged by the last to arrive or by
        # the reduce launch, the same bits; shorter ones keep the 16-position splits.
        with mock.patch.object(decode_plan, "GRID_POSITIONS", 32), \
                mock.patch.object(decode_plan, "_GRID_PROGRAMS", 1):
            chunked = decode_attention_triton(q, kc, vc, seq_lens, tables, hd**-0.5, partition=16)
            with mock.patch.object(gpu_attention, "arrival_counts", lambda *a, **k: None):
                chunked_reduced = decode_attention_triton(q, kc, vc, seq_lens, tables, hd**-0.5, partition=16)
        assert torch.equal(chunked, chunked_reduced)
        short = seq_lens <= 32
        assert torch.equal(chunked[short], merged[short]) and not torch.equal(chunked[~short], merged[~short])
        assert arrivals.all_zero()
        errs += [rel_err(merged, ref), rel_err(chunked, ref)]
        # Page ids a tile ahead (several tiles per split, a masked last tile): the same
        # tiles in the same order, so the same bits.
        tiles = dict(BLOCK_N=8, warps=2)
        ahead = decode_attention_triton(q, kc, vc, seq_lens, tables, hd**-0.5, partition=32,
                                        config=dict(tiles, prefetch=True))
        inline = decode_attention_triton(q, kc, vc, seq_lens, tables, hd**-0.5, partition=32,
                                         config=dict(tiles, prefetch=False))
        assert torch.equal(ahead, inline)
        for grid in (64,):  # two chunks a (seq, head) past 64 positions
            with mock.patch.object(decode_plan, "GRID_POSITIONS", grid), \
                    mock.patch.object(decode_plan, "_GRID_PROGRAMS", 1):
                chunks = [decode_attention_triton(q, kc, vc, seq_lens, tables, hd**-0.5, partition=32,
                                                  config=dict(tiles, prefetch=pf)) for pf in (True, False)]
            assert torch.equal(chunks[0], chunks[1])
            errs.append(rel_err(chunks[0], ref))
        errs.append(rel_err(ahead, ref))
    return max(errs)


def check_prefill_attention(g: torch.Generator) -> float:
    from phalanx.kernels.attention import prefill_attention, prefill_attention_ref

    errs = []
    for page_size, hd, nq, nkv in [(16, 16, 8, 2), (1, 16, 8, 2), (4, 64, 8, 2), (16, 128, 4, 1)]:
        ps = page_size
        # (new tokens, cached prefix): 1 token, page boundaries, prefix 0 and > 0, a
        # sequence with no new token, ones longer than a query tile, a long prefix (KV
        # tiles below the diagonal, without the causal mask).
        specs = [(1, 0), (ps + 1, 0), (max(1, ps - 1), ps), (5, ps + 1), (0, 3), (70, 2 * ps - 1), (140, 300)]
        kc, vc, tables = _paged_cache(g, [n + c for n, c in specs], ps, nkv, hd)
        meta, T = _prefill_meta(specs, tables, spare_rows=2)  # 2 unowned rows: must come back 0
        q = torch.randn(T, nq, hd, generator=g)
        ref = prefill_attention_ref(q, kc, vc, meta, hd**-0.5)
        out = prefill_attention(q, kc, vc, meta, hd**-0.5)
        assert torch.equal(out[-2:], torch.zeros_like(out[-2:])), "unowned rows not zero"
        errs.append(rel_err(out, ref))
        # This step's rows read from contiguous k_new / v_new instead of the page table.
        k_new, v_new = _new_rows(kc, tables, specs, T), _new_rows(vc, tables, specs, T)
        out = prefill_attention(q, kc, vc, meta, hd**-0.5, k_new, v_new)
        assert torch.equal(out[-2:], torch.zeros_like(out[-2:])), "unowned rows not zero (k_new)"
        errs.append(rel_err(out, ref))
    return max(errs)


def check_prefill_attention_tiles(g: torch.Generator) -> float:
    """Every query/KV tile shape the prefill kernel can be given, BLOCK_M < BLOCK_N and
    BLOCK_M > BLOCK_N included, with and without k_new, against the reference."""
    from phalanx.kernels.attention import prefill_attention_ref
    from phalanx.kernels.gpu.prefill_attention import prefill_attention_triton

    ps, hd, nq, nkv = 4, 16, 4, 2
    specs = [(40, 0), (23, 9), (1, 17), (0, 5), (33, 32)]
    kc, vc, tables = _paged_cache(g, [n + c for n, c in specs], ps, nkv, hd)
    meta, T = _prefill_meta(specs, tables)
    q = torch.randn(T, nq, hd, generator=g)
    ref = prefill_attention_ref(q, kc, vc, meta, hd**-0.5)
    k_new, v_new = _new_rows(kc, tables, specs, T), _new_rows(vc, tables, specs, T)
    errs = []
    for bm, bn in [(16, 16), (16, 32), (32, 16), (64, 16)]:
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, warps=4, stages=2, prefetch=False)
        errs.append(rel_err(prefill_attention_triton(q, kc, vc, meta, hd**-0.5, config=cfg), ref))
        inline = prefill_attention_triton(q, kc, vc, meta, hd**-0.5, k_new, v_new, config=cfg)
        errs.append(rel_err(inline, ref))
        # the prefix tiles' page ids a tile ahead: the same tiles in the same order
        ahead = prefill_attention_triton(q, kc, vc, meta, hd**-0.5, k_new, v_new,
                                         config=dict(cfg, prefetch=True, stages=3))
        assert torch.equal(ahead, inline), (bm, bn)
    return max(errs)


def check_prefill_attention_invariant(g: torch.Generator) -> float:
    """A row's result is bit for bit the same as a fresh prompt, as a prefix hit (its
    prefix read from the cache, its tile holding rows of both sources) and under every
    query tile a batch may pick: KV tiles sit at multiples of BLOCK_N from position 0."""
    from phalanx.kernels.attention import AttentionMetadata
    from phalanx.kernels.gpu.prefill_attention import prefill_attention_triton

    ps, hd, nq, nkv, n = 4, 16, 4, 2, 40
    kc, vc, tables = _paged_cache(g, [n], ps, nkv, hd)
    q = torch.randn(n, nq, hd, generator=g)
    k_all, v_all = _new_rows(kc, tables, [(n, 0)], n), _new_rows(vc, tables, [(n, 0)], n)

    def run(ctx: int, bm: int) -> torch.Tensor:
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, n - ctx], dtype=torch.int32),
            seq_lens=torch.tensor([n], dtype=torch.int32), block_tables=tables,
            slot_mapping=torch.full((n - ctx,), -1, dtype=torch.int64),
            max_query_len=n - ctx, max_seq_len=n)
        return prefill_attention_triton(q[ctx:], kc, vc, meta, hd**-0.5, k_all[ctx:], v_all[ctx:],
                                        config=dict(BLOCK_M=bm, BLOCK_N=16, warps=4, stages=2))

    fresh = run(0, 16)
    same = [torch.equal(run(0, bm), fresh) for bm in (32, 64)]
    same += [torch.equal(run(ctx, bm), fresh[ctx:]) for ctx in (8, 21, 32) for bm in (16, 64)]
    return float(same.count(False))


def _prefill_meta(specs, tables: torch.Tensor, spare_rows: int = 0):
    """AttentionMetadata for (new tokens, cached prefix) per sequence, rows in order, and
    the row count (``spare_rows`` more rows owned by no sequence at the end)."""
    from phalanx.kernels.attention import AttentionMetadata

    starts = [0]
    for n, _ in specs:
        starts.append(starts[-1] + n)
    T = starts[-1] + spare_rows
    lens = [n + c for n, c in specs]
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
        slot_mapping=torch.full((T,), -1, dtype=torch.int64),
        max_query_len=max(n for n, _ in specs), max_seq_len=max(lens)), T


def _new_rows(cache: torch.Tensor, tables: torch.Tensor, specs, T: int) -> torch.Tensor:
    """[T, kv_heads, hd]: for each query row, the cache row of its own position (what
    write_kv put there), gathered from the paged cache."""
    page = cache.shape[2]
    rows = torch.zeros(T, cache.shape[1], cache.shape[3], dtype=cache.dtype)
    t = 0
    for s, (n, ctx) in enumerate(specs):
        for j in range(n):
            p = ctx + j
            rows[t] = cache[int(tables[s, p // page]), :, p % page]
            t += 1
    return rows


def check_fused_experts(g: torch.Generator) -> float:
    from phalanx.kernels.moe import fused_experts, fused_experts_ref, make_expert_map, route

    errs = []
    cases = [  # T, global experts, local experts, top_k, hidden, intermediate, expert map
        (1, 8, 8, 2, 64, 32, False), (7, 8, 8, 2, 64, 48, False),
        (40, 16, 6, 4, 64, 32, True), (5, 8, 8, 8, 32, 16, False), (3, 8, 2, 2, 32, 16, True),
        (300, 16, 12, 4, 32, 16, True),  # > 1024 pairs: several scan chunks in the align step
    ]
    for T, eg, el, k, hid, inter, use_map in cases:
        x = torch.randn(T, hid, generator=g)
        weights, ids = route(torch.randn(T, eg, generator=g), k, True, x.dtype)
        w13 = torch.randn(el, 2 * inter, hid, generator=g) / hid**0.5
        w2 = torch.randn(el, hid, inter, generator=g) / inter**0.5
        emap = make_expert_map(eg, torch.randperm(eg, generator=g)[:el].tolist()) if use_map else None
        errs.append(rel_err(fused_experts(x, weights, ids, w13, w2, emap),
                         fused_experts_ref(x, weights, ids, w13, w2, emap)))
    # T = 0.
    out = fused_experts(torch.randn(0, 32, generator=g), torch.rand(0, 2, generator=g),
                        torch.zeros(0, 2, dtype=torch.int64), torch.randn(2, 32, 32), torch.randn(2, 32, 16))
    assert out.shape == (0, 32)
    return max(errs)


def check_align_sorts_pairs_by_expert(g: torch.Generator) -> float:
    """`moe._align` against a stable sort in Python: each expert's pairs in pair order,
    its run padded with P to a multiple of block_m, its blocks marked with it, unused
    blocks with E; ids outside [0, E) (not held here) left out; in one launch and, past
    ALIGN_ONE_LAUNCH_ROWS pairs an expert, after a count launch. 1.0 if anything differs."""
    from phalanx.kernels.gpu.moe import ALIGN_ONE_LAUNCH_ROWS, _align

    cases = ((1, 4, 16), (37, 8, 16), (1500, 128, 16), (2100, 16, 16), (2100, 120, 64))
    bad = {P > ALIGN_ONE_LAUNCH_ROWS * E for P, E, _ in cases} != {True, False}  # both modes
    for P, E, block_m in cases:
        ids = torch.randint(-1, E + 2, (P,), generator=g, dtype=torch.int32)  # -1, E, E+1: not local
        sorted_ids, block_expert, max_blocks = _align(ids, E, block_m)
        want_rows, want_blocks = [], []
        for e in range(E):
            run = [p for p in range(P) if ids[p] == e]
            run += [P] * (-len(run) % block_m)
            want_rows += run
            want_blocks += [e] * (len(run) // block_m)
        want_blocks += [E] * (max_blocks - len(want_blocks))
        bad += sorted_ids[:len(want_rows)].tolist() != want_rows
        bad += block_expert.tolist() != want_blocks
    return float(bad)


def check_fused_experts_batch_invariant(g: torch.Generator) -> float:
    """A token's output is the same bits whether it runs alone or in a batch.

    Within each path (general: 33 vs 17 tokens; small: 1 vs 3 tokens), and across the
    dispatch threshold for the small path given the general path's tiles (under the interpreter tl.dot is numpy's BLAS, whose per-element order
    depends on the tile's N and K; on the GPU bench/kernels_gpu.py checks the default tiles).
    """
    from phalanx.kernels.gpu.moe import fused_experts_triton
    from phalanx.kernels.gpu.moe_decode import fused_experts_small_triton
    from phalanx.kernels.moe import fused_experts, route

    x = torch.randn(33, 64, generator=g)
    weights, ids = route(torch.randn(33, 8, generator=g), 2, True, x.dtype)
    w13, w2 = torch.randn(8, 64, 64, generator=g) / 8, torch.randn(8, 64, 32, generator=g) / 6
    full = fused_experts(x, weights, ids, w13, w2)
    part = fused_experts(x[:17], weights[:17], ids[:17], w13, w2)
    assert torch.equal(full[:17], part), "batch-dependent result (general path)"
    alone = fused_experts(x[5:6], weights[5:6], ids[5:6], w13, w2)  # small path (dispatch)
    trio = fused_experts_small_triton(x[4:7], weights[4:7], ids[4:7], w13, w2)
    one = fused_experts_small_triton(x[5:6], weights[5:6], ids[5:6], w13, w2)
    assert torch.equal(trio[1:2], one), "batch-dependent result (small path)"
    general_tiles = dict(N1=64, K1=128, N2=64, K2=128)
    matched = fused_experts_small_triton(x[5:6], weights[5:6], ids[5:6], w13, w2, cfg=general_tiles)
    assert torch.equal(full[5:6], matched), "small path != general path bits"
    return rel_err(alone, full[5:6])


def _moe_case(g, T, k, hid, inter, n_global=16, n_local=8, use_map=False):
    """Random fused_experts inputs; with use_map, n_local of n_global experts are held."""
    from phalanx.kernels.moe import make_expert_map, route

    n_global = n_global if use_map else n_local
    x = torch.randn(T, hid, generator=g)
    weights, ids = route(torch.randn(T, n_global, generator=g), k, True, x.dtype)
    w13 = torch.randn(n_local, 2 * inter, hid, generator=g) / hid**0.5
    w2 = torch.randn(n_local, hid, inter, generator=g) / inter**0.5
    emap = make_expert_map(n_global, torch.randperm(n_global, generator=g)[:n_local].tolist()) if use_map else None
    return x, weights, ids, w13, w2, emap


MOE_PATH_TOL = 1e-5  # float32 under the interpreter, either path vs fused_experts_ref


def check_fused_experts_paths(g: torch.Generator) -> float:
    """Both paths forced (general; small with its down projection merged in the launch,
    by a combine launch, or per token) vs the reference: T = 1, 2, 3,
    top-k 1, 2, 3, 5 and 8 (one, even and odd counts, the largest), all experts local and
    8 of 16 local (non-local pairs skipped)."""
    from phalanx.kernels.gpu.moe import fused_experts_triton
    from phalanx.kernels.gpu.moe_decode import fused_experts_small_triton
    from phalanx.kernels.moe import fused_experts_ref

    errs = {}
    for T in (1, 2, 3):
        for k in (1, 2, 3, 5, 8):
            for use_map in (False, True):
                x, w, ids, w13, w2, emap = _moe_case(g, T, k, 32, 32, use_map=use_map)
                ref = fused_experts_ref(x, w, ids, w13, w2, emap)
                outs = {"general": fused_experts_triton(x, w, ids, w13, w2, emap, path="general"),
                        "small": fused_experts_triton(x, w, ids, w13, w2, emap, path="small"),
                        "small-loop": fused_experts_small_triton(x, w, ids, w13, w2, emap, cfg={"split": False}),
                        "small-combine": fused_experts_small_triton(x, w, ids, w13, w2, emap,
                                                                    cfg={"merge": False})}
                assert torch.equal(outs["small"], outs["small-combine"]), \
                    "slot sum merged in the down kernel != the combine kernel's"
                for name, out in outs.items():
                    errs[(name, T, k, use_map)] = rel_err(out, ref)
    bad = {key: e for key, e in errs.items() if not e < MOE_PATH_TOL}
    assert not bad, f"(path, T, k, map) over {MOE_PATH_TOL}: {bad}"
    from phalanx.kernels.gpu.arrivals import all_zero
    assert all_zero(), "a merge left its arrival count set"
    return max(errs.values())


def check_fused_experts_small_tiles(g: torch.Generator) -> float:
    """Small path with tiles smaller than the dims (several K steps, partial N and K
    tiles), odd dims, non-contiguous inputs, every expert non-local for one token."""
    from phalanx.kernels.gpu.moe_decode import fused_experts_small_triton
    from phalanx.kernels.moe import fused_experts_ref

    errs = []
    tiles = dict(N1=16, K1=16, N2=16, K2=16, warps=2, stages=2)
    for T, k, hid, inter, use_map in [(2, 3, 40, 24, True), (3, 8, 72, 40, True), (1, 5, 48, 36, False)]:
        x, w, ids, w13, w2, emap = _moe_case(g, T, k, hid, inter, use_map=use_map)
        if use_map:  # token 0: no local expert at all -> a zero row
            off = (emap < 0).nonzero().flatten()
            ids[0] = off[torch.randperm(off.numel(), generator=g)[:k]]
        ref = fused_experts_ref(x, w, ids, w13, w2, emap)
        views = {"row stride 2*hid": torch.cat([x, x], 1)[:, :hid],
                 "column stride 2": torch.stack([x, x], 2).reshape(T, 2 * hid)[:, ::2]}
        for view, xv in views.items():
            assert torch.equal(xv, x)
            out = fused_experts_small_triton(xv, w, ids, w13, w2, emap, cfg=tiles)
            if use_map:
                assert torch.equal(out[0], torch.zeros_like(out[0])), f"{view}: non-local token not zero"
            errs.append(rel_err(out, ref))
    assert max(errs) < MOE_PATH_TOL, errs
    return max(errs)


def check_fused_experts_dispatch(g: torch.Generator) -> float:
    """fused_experts takes the small path iff T * top_k <= SMALL_MAX_PAIRS (T=1 at top-8 always)."""
    from phalanx.kernels import moe
    from phalanx.kernels.gpu import moe as gpu_moe, moe_decode

    assert gpu_moe.SMALL_MAX_PAIRS >= 8, "T=1 at top-8 must take the small path"
    calls: list[str] = []
    real_small, real_align = moe_decode.fused_experts_small_triton, gpu_moe._align
    moe_decode.fused_experts_small_triton = lambda *a, **kw: (calls.append("small"), real_small(*a, **kw))[1]
    gpu_moe._align = lambda *a, **kw: (calls.append("general"), real_align(*a, **kw))[1]
    try:
        limit = gpu_moe.SMALL_MAX_PAIRS
        for T, k, want in [(1, 8, "small"), (1, 1, "small"), (2, 4, "small"), (limit // 8, 8, "small"),
                           (limit // 8 + 1, 8, "general"), (limit // 2 + 1, 2, "general")]:
            x, w, ids, w13, w2, _ = _moe_case(g, T, k, 16, 16)
            calls.clear()
            out = moe.fused_experts(x, w, ids, w13, w2)
            assert calls == [want], (T, k, calls)
            assert rel_err(out, moe.fused_experts_ref(x, w, ids, w13, w2)) < MOE_PATH_TOL, (T, k)
    finally:
        moe_decode.fused_experts_small_triton, gpu_moe._align = real_small, real_align
    return 0.0


LINEAR_TOL = 1e-5  # float32 under the interpreter, the skinny GEMM vs F.linear


def check_linear(g: torch.Generator) -> float:
    """linear (the GEMV up to 4 rows, the skinny Triton GEMM up to 16) vs F.linear: M 1/3/16 x N 8/100/128 x K 16/72/128, with
    and without bias; x as a column-slice view (row stride > K) and a stride-2 view;
    split-K and small tiles (several K steps, a partial last one); split-K deterministic.
    (A row's bits alone vs in a 16-row batch are checked on the GPU only, by
    bench/kernels_gpu.py: under the interpreter tl.dot is numpy's BLAS, whose per-element
    order depends on the row's position in its micro-kernel.)"""
    import torch.nn.functional as F

    from phalanx.kernels.gpu.linear import skinny_linear_triton
    from phalanx.kernels.linear import linear

    errs = {}
    for M in (1, 3, 16):
        for N in (8, 100, 128):
            for K in (16, 72, 128):
                x, w, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
                for bias in (None, b):
                    errs[(M, N, K, bias is not None)] = rel_err(linear(x, w, bias), F.linear(x, w, bias))
    x, w, b = torch.randn(3, 72, generator=g), torch.randn(100, 72, generator=g), torch.randn(100, generator=g)
    ref = F.linear(x, w, b)
    views = {"slice": torch.cat([x, x], 1)[:, 72:], "stride2": torch.stack([x, x], 2).reshape(3, 144)[:, ::2]}
    for name, v in views.items():  # row stride 144; column stride 2 (made contiguous)
        assert torch.equal(v, x)
        errs[name] = rel_err(linear(v, w, b), ref)
    for cfg in (dict(BLOCK_K=16, SPLIT_K=3), dict(BLOCK_N=32, BLOCK_K=32, SPLIT_K=2), dict(BLOCK_K=16, SPLIT_K=1)):
        out = skinny_linear_triton(x, w, b, cfg=cfg)
        errs[str(cfg)] = rel_err(out, ref)
        assert torch.equal(out, skinny_linear_triton(x, w, b, cfg=cfg)), f"{cfg}: not deterministic"
    bad = {key: e for key, e in errs.items() if not e < LINEAR_TOL}
    assert not bad, f"over {LINEAR_TOL}: {bad}"
    return max(errs.values())


def check_linear_dispatch(g: torch.Generator) -> float:
    """linear takes the GEMV for 2-D x with 1..GEMV_MAX_M rows and the skinny Triton GEMM
    up to SKINNY_MAX_M (under force_triton), F.linear for M = 17, 3-D x, mixed dtypes and
    force_triton(False)."""
    import torch.nn.functional as F

    from phalanx.kernels import linear as lin
    from phalanx.kernels.backend import force_triton
    from phalanx.kernels.gpu import gemv as gpu_gemv
    from phalanx.kernels.gpu import linear as gpu_lin

    assert lin.SKINNY_MAX_M == 16 and lin.GEMV_MAX_M == 1
    calls: list[str] = []
    real_skinny, real_gemv, real_f = gpu_lin.skinny_linear_triton, gpu_gemv.gemv_triton, F.linear
    gpu_lin.skinny_linear_triton = lambda *a, **kw: (calls.append("skinny"), real_skinny(*a, **kw))[1]
    gpu_gemv.gemv_triton = lambda *a, **kw: (calls.append("gemv"), real_gemv(*a, **kw))[1]
    F.linear = lambda *a, **kw: (calls.append("F.linear"), real_f(*a, **kw))[1]
    errs = []
    try:
        w, b = torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
        for shape, forced_on, want in [((1, 40), True, "gemv"), ((2, 40), True, "skinny"),
                                       ((16, 40), True, "skinny"),
                                       ((17, 40), True, "F.linear"), ((2, 3, 40), True, "F.linear"),
                                       ((4, 40), False, "F.linear")]:
            x = torch.randn(*shape, generator=g)
            calls.clear()
            with force_triton(forced_on):
                out = lin.linear(x, w, b)
            assert calls == [want], (shape, forced_on, calls)
            errs.append(rel_err(out, real_f(x, w, b)))
        calls.clear()
        try:  # mixed dtypes: left to F.linear (which rejects them)
            lin.linear(torch.randn(2, 40, generator=g), w.double())
        except RuntimeError:
            pass
        assert calls == ["F.linear"], calls
    finally:
        gpu_lin.skinny_linear_triton, gpu_gemv.gemv_triton, F.linear = real_skinny, real_gemv, real_f
    return max(errs)


def check_route(g: torch.Generator) -> float:
    """One-launch routing equals softmax + topk (+ renormalization), ids exactly."""
    from phalanx.kernels.moe import route, route_ref

    errs = []
    for T, E, k, renorm in [(1, 16, 4, True), (7, 128, 8, True), (5, 60, 3, False), (0, 8, 2, True)]:
        logits = torch.randn(T, E, generator=g) * 3
        w, ids = route(logits, k, renorm, torch.float32)
        rw, rids = route_ref(logits, k, renorm, torch.float32)
        assert torch.equal(ids, rids), (ids, rids)
        if T:
            errs.append(rel_err(w, rw))
    return max(errs)


def check_dispatch(g: torch.Generator) -> float:
    """Under force_triton(True) every public function reaches its Triton version."""
    import importlib

    from phalanx.kernels import activation, attention, moe, norm
    from phalanx.kernels.backend import force_triton, use_triton

    x = torch.randn(2, 8, generator=g)
    with force_triton(False):
        assert not use_triton(x)
    assert use_triton(x)  # the script sets force_triton(True) globally
    calls: list[str] = []
    targets = {"norm": ["rms_norm_triton", "add_rms_norm_triton", "silu_and_mul_triton"],
               "attention": ["decode_attention_triton"], "kv_write": ["write_kv_triton"],
               "prefill_attention": ["prefill_attention_triton"],
               "moe": ["fused_experts_triton"], "rope": ["rope_triton"], "linear": ["skinny_linear_triton"],
               "gemv": ["gemv_triton"]}
    for mod_name, fns in targets.items():
        mod = importlib.import_module(f"phalanx.kernels.gpu.{mod_name}")
        for fn in fns:
            real = getattr(mod, fn)
            setattr(mod, fn, lambda *a, _real=real, _fn=fn, **kw: (calls.append(_fn), _real(*a, **kw))[1])
    from phalanx.kernels.rope import RotaryEmbedding

    norm.rms_norm(x, torch.ones(8), 1e-6)
    norm.add_rms_norm(x, x, torch.ones(8), 1e-6)
    activation.silu_and_mul(x)
    q, kv = torch.randn(2, 4, 16, generator=g), torch.randn(2, 2, 16, generator=g)
    RotaryEmbedding(16, 32, 10000.0).apply(q, kv, torch.tensor([0, 5]))
    kc, vc, tables = _paged_cache(g, [2, 1], 4, 2, 16)
    attention.write_kv(kv, kv, kc, vc, torch.tensor([0, -1]))
    lens = torch.tensor([2, 1], dtype=torch.int32)
    attention.decode_attention(q, kc, vc, lens, tables, 0.25)
    meta = attention.AttentionMetadata(torch.tensor([0, 1, 2], dtype=torch.int32), lens, tables,
                                       torch.tensor([0, -1]), 1, 2)
    attention.prefill_attention(q, kc, vc, meta, 0.25)
    moe.fused_experts(x, torch.rand(2, 1, generator=g), torch.tensor([[0], [1]]),
                      torch.randn(2, 8, 8, generator=g), torch.randn(2, 8, 4, generator=g))
    from phalanx.kernels.linear import linear

    linear(x[:1], torch.randn(4, 8, generator=g))  # 1 row: the GEMV
    linear(x, torch.randn(4, 8, generator=g))  # 2 rows: the skinny GEMM
    missing = sorted({f for fns in targets.values() for f in fns} - set(calls))
    assert not missing, f"not dispatched to Triton: {missing}"
    return 0.0


if __name__ == "__main__":
    run_kernel_checks(globals())

# ---------------------------------------------------------------- pytest side

interpreter_results = results_fixture(__file__)
test_triton_kernel_matches_reference = reference_test(globals(), TOL)


def test_backend_defaults_to_reference_on_cpu():
    from phalanx.kernels.backend import force_triton, forced, use_triton

    x = torch.randn(3)
    assert forced() is None and not use_triton(x)
    with force_triton(False):
        assert forced() is False and not use_triton(x)
    assert forced() is None
