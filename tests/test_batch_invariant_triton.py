"""The batch-invariant mode's Triton kernels (kernels/batch_invariant.py) on CPU under
Triton's interpreter, as tests/test_kernels_triton.py runs its checks (a subprocess with
``TRITON_INTERPRET=1``): the GEMM against ``F.linear``, decode attention under the mode's
fixed plan against the reference and against itself in other batches and table widths,
and prefill attention computed row by row as decode queries: each prefilled row has the
bits the decode kernel gives that position. (Whether a row's bits survive other row
tiles is the MMA's property, checked on a GPU by bench/probes/gpu_invariance.py: the
interpreter's ``tl.dot`` is numpy's, whose order follows the tile.)"""

from __future__ import annotations

import torch
from interpreter_checks import reference_test, rel_err, results_fixture, run_kernel_checks
from test_kernels_triton import _paged_cache, _prefill_meta

TOL = 1e-4


def check_invariant_gemm(g: torch.Generator) -> float:
    import torch.nn.functional as F

    from phalanx.kernels.gpu.invariant_gemm import invariant_config, invariant_linear_triton

    errs = []
    # rows across every BLOCK_M class; K whole blocks, a ragged tail and below a block
    for m, n, k in [(1, 40, 64), (5, 33, 100), (40, 70, 48), (130, 20, 96), (300, 8, 16)]:
        x, w, b = (torch.randn(m, k, generator=g), torch.randn(n, k, generator=g),
                   torch.randn(n, generator=g))
        errs.append(rel_err(invariant_linear_triton(x, w, b), F.linear(x, w, b)))
        errs.append(rel_err(invariant_linear_triton(x, w), F.linear(x, w)))
        assert invariant_config(m, n, k, 4)["BLOCK_K"] == invariant_config(1, n, k, 4)["BLOCK_K"]
    x3, w = torch.randn(2, 3, 24, generator=g), torch.randn(10, 24, generator=g)
    errs.append(rel_err(invariant_linear_triton(x3, w), F.linear(x3, w)))
    assert invariant_linear_triton(x3[:0], w).shape == (0, 3, 10)
    assert torch.equal(invariant_linear_triton(torch.randn(2, 0), torch.randn(3, 0), torch.ones(3)),
                       torch.ones(2, 3))
    return max(errs)


def check_norm_folded_into_gemm(g: torch.Generator) -> float:
    """The GEMM with the norm in front (a few rows, one launch) gives the norm kernel's
    normed rows and residual bit for bit, and their projection; the mode's norm_linear
    takes it at a few rows, the norm kernel and the GEMM past them."""
    from phalanx.kernels.backend import force_triton
    from phalanx.kernels.batch_invariant import batch_invariant
    from phalanx.kernels.gpu import invariant_gemm
    from phalanx.kernels.gpu.invariant_gemm import invariant_linear_triton, invariant_norm_linear_triton
    from phalanx.kernels.gpu.norm import add_rms_norm_triton, rms_norm_triton
    from phalanx.kernels.invariant_linear import row_invariant_linear
    from phalanx.kernels.norm_linear import norm_linear, norm_linear_ref

    errs = []
    for m, n, k, has_res, has_bias in [(1, 40, 64, True, False), (3, 33, 100, False, True),
                                       (16, 70, 300, True, True)]:
        x, w, nw = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(k, generator=g)
        res = torch.randn(m, k, generator=g) if has_res else None
        b = torch.randn(n, generator=g) if has_bias else None
        y, normed, new_res = invariant_norm_linear_triton(x, res, nw, 1e-6, w, b, want_normed=True)
        ref_normed, ref_res = (rms_norm_triton(x, nw, 1e-6), x) if res is None else add_rms_norm_triton(
            x, res, nw, 1e-6)
        assert torch.equal(normed, ref_normed) and torch.equal(new_res, ref_res)
        assert torch.equal(y, invariant_linear_triton(ref_normed, w, b)), (m, n, k)
        errs.append(rel_err(y, norm_linear_ref(x, res, nw, 1e-6, w, b)[0]))
        assert invariant_norm_linear_triton(x, res, nw, 1e-6, w, b)[1] is None
    x, res, nw, w = (torch.randn(2, 64, generator=g), torch.randn(2, 64, generator=g),
                     torch.randn(64, generator=g), torch.randn(24, 64, generator=g))
    invariant_gemm.FOLD_MAX_M, default = 16, invariant_gemm.FOLD_MAX_M  # off by default
    try:
        with force_triton(True), batch_invariant(True):
            y, normed, new_res = norm_linear(x, res, nw, 1e-6, w, want_normed=True)
            assert torch.equal(y, invariant_norm_linear_triton(x, res, nw, 1e-6, w)[0])
            many = torch.randn(40, 64, generator=g)  # past FOLD_MAX_M rows: the norm kernel, then the GEMM
            y, normed, new_res = norm_linear(many, many, nw, 1e-6, w, want_normed=True)
            assert torch.equal(normed, add_rms_norm_triton(many, many, nw, 1e-6)[0])
            assert torch.equal(y, row_invariant_linear(normed, w))  # the mode's GEMM (F.linear on CPU)
    finally:
        invariant_gemm.FOLD_MAX_M = default
    return max(errs)


def check_gemm_leaf_tree(g: torch.Generator) -> float:
    """``leaves``: K in equal chunks added as a balanced tree in one launch, the bits of
    each chunk's own launch (float32 out) summed pairwise, and of a TP2 rank's subtree
    launches (models/row_parallel.py); float32 and float16, whole and ragged K blocks."""
    import torch.nn.functional as F

    from phalanx.kernels.gpu.invariant_gemm import invariant_linear_triton
    from phalanx.models.row_parallel import pairwise_sum

    errs = []
    for dtype in (torch.float32, torch.float16):
        for m, n, k, leaves in [(3, 40, 256, 2), (5, 33, 512, 4), (17, 24, 1024, 8), (2, 16, 96, 2)]:
            x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
            tree = invariant_linear_triton(x, w, leaves=leaves)
            c = k // leaves
            parts = [invariant_linear_triton(x[:, i * c:(i + 1) * c], w[:, i * c:(i + 1) * c],
                                             out_dtype=torch.float32) for i in range(leaves)]
            assert torch.equal(tree, pairwise_sum(parts).to(dtype)), (dtype, m, n, k, leaves)
            halves = [invariant_linear_triton(x[:, r * k // 2:(r + 1) * k // 2], w[:, r * k // 2:(r + 1) * k // 2],
                                              out_dtype=torch.float32, leaves=leaves // 2) for r in range(2)]
            assert torch.equal(tree, (halves[0] + halves[1]).to(dtype)), (dtype, m, n, k, leaves)
            if dtype == torch.float32:  # float16's rounding is the float16 GEMM's, not this tree's
                errs.append(rel_err(tree, F.linear(x, w)))
    try:
        invariant_linear_triton(torch.randn(2, 96), torch.randn(3, 96), leaves=3)
    except ValueError as e:
        assert "leaves=3" in str(e)
    else:
        raise AssertionError("leaves=3 taken")
    return max(errs)


def check_expert_pairs_summed_are_the_combine(g: torch.Generator) -> float:
    """The Triton experts' per-pair output (``pairs=True``: zeros where the expert is
    elsewhere) of two ranks' halves, added and summed in slot order, is one rank's
    combined output bit for bit."""
    from phalanx.kernels.gpu.moe import fused_experts_triton
    from phalanx.kernels.moe import make_expert_map, sum_slots

    E, H, I, T, k = 8, 32, 16, 12, 3
    x = torch.randn(T, H, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) / 4, torch.randn(E, H, I, generator=g) / 4
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    whole = fused_experts_triton(x, weights, ids, w13, w2, path="general")
    pairs = sum(fused_experts_triton(x, weights, ids, w13[list(r)], w2[list(r)], make_expert_map(E, r),
                                     pairs=True) for r in (tuple(range(0, E, 2)), tuple(range(1, E, 2))))
    assert torch.equal(sum_slots(pairs, x.dtype), whole)
    return 0.0


def check_slot_sum_in_one_launch(g: torch.Generator) -> float:
    """``sum_slots_triton`` (the combine kernel, every pair local) has the torch slot
    sum's bits: float32 adds in slot order, one cast; strided pairs too."""
    from phalanx.kernels.backend import force_triton
    from phalanx.kernels.gpu.moe import sum_slots_triton
    from phalanx.kernels.moe import sum_slots

    with force_triton(False):  # the torch adds as the reference
        for dtype, out_dtype in ((torch.float32, torch.float32), (torch.float16, torch.float16),
                                 (torch.float32, torch.float16)):
            pairs = (torch.randn(7, 4, 40, generator=g) * 3).to(dtype)
            want = sum_slots(pairs, out_dtype)
            assert torch.equal(sum_slots_triton(pairs, out_dtype), want), (dtype, out_dtype)
            strided = torch.randn(7, 4, 80, generator=g).to(dtype)[:, :, ::2]
            assert torch.equal(sum_slots_triton(strided, out_dtype), sum_slots(strided, out_dtype))
            if out_dtype == torch.float32:  # the control: another slot order, other bits
                assert not torch.equal(sum_slots_triton(pairs.flip(1), out_dtype), want)
    return 0.0


def check_decode_attention_plan(g: torch.Generator) -> float:
    """In the mode a sequence's output is the same bits in any batch and table width."""
    from phalanx.kernels.attention import decode_attention, decode_attention_ref
    from phalanx.kernels.batch_invariant import batch_invariant

    ps, hd, nq, nkv = 16, 32, 8, 2
    lens = [1, 15, 16, 17, 300, 600]  # 600: three 256-position splits
    kc, vc, tables = _paged_cache(g, lens, ps, nkv, hd)
    q = torch.randn(len(lens), nq, hd, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    with batch_invariant(True):
        out = decode_attention(q, kc, vc, seq_lens, tables, hd**-0.5)
        wide = torch.cat([tables, torch.full((len(lens), 40), 10**6, dtype=torch.int32)], 1)
        for s in range(len(lens)):
            alone = decode_attention(q[s:s + 1], kc, vc, seq_lens[s:s + 1], wide[s:s + 1], hd**-0.5)
            assert torch.equal(alone, out[s:s + 1]), s
    return rel_err(out, decode_attention_ref(q, kc, vc, seq_lens, tables, hd**-0.5))


def check_prefill_rows_as_decode(g: torch.Generator) -> float:
    """In the mode each prefilled row is the decode kernel's result at its position."""
    from phalanx.kernels.attention import decode_attention, prefill_attention, prefill_attention_ref
    from phalanx.kernels.batch_invariant import batch_invariant

    ps, hd, nq, nkv = 4, 16, 4, 2
    specs = [(1, 0), (5, 3), (0, 2), (30, 270)]  # (new tokens, cached prefix); 300: two splits
    kc, vc, tables = _paged_cache(g, [n + c for n, c in specs], ps, nkv, hd)
    meta, T = _prefill_meta(specs, tables, spare_rows=2)
    q = torch.randn(T, nq, hd, generator=g)
    with batch_invariant(True):
        out = prefill_attention(q, kc, vc, meta, hd**-0.5)
        assert torch.equal(out[-2:], torch.zeros_like(out[-2:])), "unowned rows not zero"
        row = 0
        for s, (n, ctx) in enumerate(specs):
            for j in range(n):
                one = decode_attention(q[row:row + 1], kc, vc, torch.tensor([ctx + j + 1], dtype=torch.int32),
                                       tables[s:s + 1], hd**-0.5)
                assert torch.equal(one, out[row:row + 1]), (s, j)
                row += 1
    return rel_err(out, prefill_attention_ref(q, kc, vc, meta, hd**-0.5))


def check_invariant_prefill_blocks(g: torch.Generator) -> float:
    """The block kernel (kernels/gpu/invariant_prefill.py) has the row-by-row form's bits
    (each row a decode query), every GQA group size and row block, and is close to the
    reference (with tests/interpreter_dot.py a dot's element depends on its own row and
    column only, as an MMA's does)."""
    from phalanx.kernels import attention
    from phalanx.kernels.attention import prefill_attention_ref
    from phalanx.kernels.batch_invariant import batch_invariant
    from phalanx.kernels.gpu.invariant_prefill import invariant_prefill_triton

    errs = []
    for ps, hd, nq, nkv in [(4, 16, 4, 2), (16, 32, 8, 1), (8, 16, 3, 3)]:
        specs = [(1, 0), (37, 3), (0, 2), (21, 250), (2, 511)]  # rows across 256-position splits
        kc, vc, tables = _paged_cache(g, [n + c for n, c in specs], ps, nkv, hd)
        meta, T = _prefill_meta(specs, tables, spare_rows=3)
        q = torch.randn(T, nq, hd, generator=g)
        with batch_invariant(True):
            blocks = invariant_prefill_triton(q, kc, vc, meta, hd**-0.5)
            rows = attention._rows_as_decode(q, kc, vc, meta, hd**-0.5)
        assert torch.equal(blocks[-3:], torch.zeros_like(blocks[-3:])), "unowned rows not zero"
        assert torch.equal(blocks, rows), (ps, hd, nq, nkv)
        errs.append(rel_err(blocks, prefill_attention_ref(q, kc, vc, meta, hd**-0.5)))
    return max(errs)


def check_mode_turns_off_the_batch_dependent_paths(g: torch.Generator) -> float:
    from phalanx.kernels.batch_invariant import batch_invariant, batch_invariant_on
    from phalanx.kernels.linear import use_gemv, use_skinny

    x, w = torch.randn(1, 64, generator=g), torch.randn(32, 64, generator=g)
    assert use_gemv(x, w) and use_skinny(x, w)
    with batch_invariant(True):
        assert batch_invariant_on() and not use_gemv(x, w) and not use_skinny(x, w)
    assert not batch_invariant_on()
    return 0.0


if __name__ == "__main__":
    run_kernel_checks(globals())

# ---------------------------------------------------------------- pytest side

interpreter_results = results_fixture(__file__)
test_triton_kernel_matches_reference = reference_test(globals(), TOL)
