"""The few-row GEMV (`kernels/gpu/gemv.py`) and the norm folded into a projection
(`kernels/norm_linear.py`), on CPU under Triton's interpreter (the subprocess scheme of
test_kernels_triton.py), against `F.linear` and `norm_linear_ref`; then a decoder's
decode step through them against the torch reference path. Inputs are fresh random
float32 values (never zeros). PDL itself is GPU-only (tests/test_gpu.py runs it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from interpreter_checks import reference_test, rel_err, results_fixture, run_kernel_checks

TOL = 1e-5  # float32 under the interpreter, against float32 references


def check_gemv(g: torch.Generator) -> float:
    """The GEMV: M 1..4 (linear dispatches M = 1 to it), N 1/8/100/300 (one to many rows
    a program, a partial last program), K 16/72/200 (masked tails), with and without
    bias; x a column slice (row stride > K)."""
    from phalanx.kernels.gpu import gemv
    from phalanx.kernels.linear import linear, use_gemv

    errs = []
    for i, m in enumerate((1, 2, 3, 4)):  # every (M, N) pair, each K and bias with each M and N
        for j, n in enumerate((1, 8, 100, 300)):
            k = (16, 72, 200)[(i + j) % 3]
            x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
            assert use_gemv(x, w) == (m == 1)
            bias = b if (i + j) % 2 else None
            errs.append(rel_err(gemv.gemv_triton(x, w, bias)[0], F.linear(x, w, bias)))
            if m == 1:
                errs.append(rel_err(linear(x, w, bias), F.linear(x, w, bias)))
    x, w = torch.randn(3, 72, generator=g), torch.randn(100, 72, generator=g)
    view = torch.cat([x, x], 1)[:, 72:]
    errs.append(rel_err(gemv.gemv_triton(view, w)[0], F.linear(x, w)))
    return max(errs)


def check_norm_linear(g: torch.Generator) -> float:
    """The norm folded into the GEMV (every program recomputes it; norm_linear at one row,
    gemv_triton's norm at 2-4) vs the reference: y, the normed rows and the new residual;
    with and without a residual and a bias; the normed rows None unless asked for; inputs
    untouched; the same bits on a second call."""
    from phalanx.kernels.gpu.gemv import gemv_triton
    from phalanx.kernels.norm_linear import norm_linear as dispatched
    from phalanx.kernels.norm_linear import norm_linear_ref

    def norm_linear(x, residual, nw, eps, w, bias=None, want_normed=False):
        if x.shape[0] == 1:
            return dispatched(x, residual, nw, eps, w, bias, want_normed=want_normed)
        return gemv_triton(x, w, bias, norm=(residual, nw, eps), want_normed=want_normed)

    errs = []
    for i, (m, n, k) in enumerate([(1, 100, 72), (4, 8, 200), (2, 300, 16), (1, 1, 40)]):
        x, r = torch.randn(m, k, generator=g) * 2, torch.randn(m, k, generator=g)
        nw, w, b = 1 + 0.1 * torch.randn(k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        x0, r0 = x.clone(), r.clone()
        # residual and bias: each shape two of the four pairings, every pairing at 1 and >1 rows
        for residual, bias in ((None, None), (r, b)) if i % 2 == 0 else ((None, b), (r, None)):
            y, normed, res = norm_linear(x, residual, nw, 1e-6, w, bias, want_normed=True)
            ry, rnormed, rres = norm_linear_ref(x, residual, nw, 1e-6, w, bias)
            errs += [rel_err(y, ry), rel_err(normed, rnormed), rel_err(res, rres)]
            again = norm_linear(x, residual, nw, 1e-6, w, bias, want_normed=True)
            assert all(torch.equal(a, c) for a, c in zip(again, (y, normed, res))), "not deterministic"
            y2, none, _ = norm_linear(x, residual, nw, 1e-6, w)
            assert none is None and torch.equal(y2, norm_linear(x, residual, nw, 1e-6, w)[0])
        assert torch.equal(x, x0) and torch.equal(r, r0), "inputs modified"
    return max(errs)


def check_norm_linear_fallback(g: torch.Generator) -> float:
    """More rows than the GEMV takes: the norm kernel and then the projection, same
    contract (the normed rows returned even when not asked for)."""
    from phalanx.kernels.norm_linear import norm_linear, norm_linear_ref

    x, r = torch.randn(9, 40, generator=g), torch.randn(9, 40, generator=g)
    nw, w = 1 + 0.1 * torch.randn(40, generator=g), torch.randn(24, 40, generator=g)
    out, ref = norm_linear(x, r, nw, 1e-5, w), norm_linear_ref(x, r, nw, 1e-5, w)
    return max(rel_err(a, c) for a, c in zip(out, ref))


def check_norm_qkv_rope(g: torch.Generator) -> float:
    """The qkv projection with the input norm, the q/k norms, rope and the KV write folded
    into one launch, against the unfolded torch path on copies of the same cache: q, the
    new residual, every K/V page (untouched ones too); with and without a residual, q/k
    norms and a bias; a padding row (slot -1) writes nothing; counters back at zero."""
    from phalanx.kernels.backend import force_triton
    from phalanx.kernels.gpu.arrivals import all_zero
    from phalanx.kernels.norm_linear import norm_qkv_rope
    from phalanx.kernels.rope import RotaryEmbedding

    errs = []
    hid, nq, nk, hd, page = 48, 4, 2, 16, 4
    rope = RotaryEmbedding(hd, 64, 10000.0)
    w, b = torch.randn((nq + 2 * nk) * hd, hid, generator=g) / hid**0.5, torch.randn((nq + 2 * nk) * hd, generator=g)
    nw, qn, kn = (1 + 0.1 * torch.randn(n, generator=g) for n in (hid, hd, hd))
    for slot, residual, norms, bias in [(5, True, True, False), (0, False, True, True), (9, True, False, False),
                                        (-1, True, True, False)]:
        x, r = torch.randn(1, hid, generator=g), torch.randn(1, hid, generator=g)
        pos = torch.tensor([int(torch.randint(0, 64, (1,), generator=g))])
        caches = (torch.randn(4, nk, page, hd, generator=g), torch.randn(4, nk, page, hd, generator=g))
        outs = {}
        for forced in (True, False):
            cache = tuple(c.clone() for c in caches)
            with force_triton(forced):
                q, res = norm_qkv_rope(x, r if residual else None, nw, 1e-6, w, b if bias else None, None, rope,
                                       pos, qn if norms else None, kn if norms else None, cache,
                                       torch.tensor([slot]), (nq, nk))
            outs[forced] = (q, res, *cache)
        for got, ref in zip(outs[True], outs[False]):
            errs.append(rel_err(got, ref))
        if slot < 0:
            assert all(torch.equal(a, c) for a, c in zip(outs[True][2:], caches)), "padding row wrote the cache"
    assert all_zero(), "a head left its arrival count set"
    return max(errs)


def check_norm_route(g: torch.Generator) -> float:
    """The router's projection with the post-attention norm and the routing folded into
    one launch, against the unfolded torch path: weights, ids (equal), the normed rows
    and the new residual; with and without a residual and renormalization, experts not a
    power of two, tied logits (identical router rows: the lower id first, as torch.topk);
    counters back at zero."""
    from phalanx.kernels import norm_linear
    from phalanx.kernels.backend import force_triton
    from phalanx.kernels.gpu.arrivals import all_zero

    errs = []
    hid = 40
    nw = 1 + 0.1 * torch.randn(hid, generator=g)
    norm_linear.ROUTE_FOLD = True
    try:
        for experts, k, residual, renorm, ties in [(8, 2, True, True, False), (6, 3, False, True, False),
                                                   (16, 4, True, False, False), (8, 3, True, True, True)]:
            gate = torch.randn(experts, hid, generator=g) / hid**0.5
            x, r = torch.randn(1, hid, generator=g), torch.randn(1, hid, generator=g)
            if ties:  # experts 2, 5 and 6 share the largest logit
                v = 3 * torch.randn(hid, generator=g)
                v = v if float(torch.dot(x[0] + r[0], nw * v)) > 0 else -v
                gate = 0.01 * gate
                gate[2], gate[5], gate[6] = v, v, v
            outs = {}
            for forced in (True, False):
                with force_triton(forced):
                    (w, ids), normed, res = norm_linear.norm_route(
                        x, r if residual else None, nw, 1e-6, gate, k, renorm)
                outs[forced] = (w, ids, normed, res)
            assert torch.equal(outs[True][1], outs[False][1]), (outs[True][1], outs[False][1])
            if ties:
                assert outs[True][1][0, :3].tolist() == [2, 5, 6], outs[True][1]
            errs += [rel_err(a, c) for i, (a, c) in enumerate(zip(outs[True], outs[False])) if i != 1]
    finally:
        norm_linear.ROUTE_FOLD = False
    assert all_zero(), "a row left its arrival count set"
    return max(errs)


def check_gemv_fp8(g: torch.Generator) -> float:
    """FP8 codes with per-row, 128-column-block scales, dequantized in registers: the
    projection (linear's dispatch at one row, the kernel at 3), the norm folded in, and
    qkv + rope folded, against the references over the dequantized weights; K 72 (one
    partial block), 200 (a partial last block), 256; N 1/8/100."""
    from phalanx.kernels import linear
    from phalanx.kernels.backend import force_triton
    from phalanx.kernels.fp8 import dequantize, expand_block_scales, fp8_linear_ref, quantize_blocks
    from phalanx.kernels.gpu import gemv
    from phalanx.kernels.gpu.gemv import gemv_triton
    from phalanx.kernels.linear import project, use_gemv
    from phalanx.kernels.norm_linear import norm_linear, norm_linear_ref, norm_qkv_rope
    from phalanx.kernels.rope import RotaryEmbedding

    def weight(n, k):
        q, blocks = quantize_blocks(torch.randn(n, k, generator=g) * 0.05)
        return q, expand_block_scales(blocks, n)

    q, s = weight(8, 64)
    default_form = gemv.FP8_SUM_AFTER
    before = linear.GEMV_FP8
    linear.GEMV_FP8 = False
    try:
        assert not use_gemv(torch.randn(1, 64), q, None, s), "FP8 took the GEMV with GEMV_FP8 off"
    finally:
        linear.GEMV_FP8 = True
    try:
        errs = []
        for n in (1, 8, 100):
            for k in (72, 200, 256):
                q, s = weight(n, k)
                x, b = torch.randn(1, k, generator=g), torch.randn(n, generator=g)
                assert use_gemv(x, q, b, s) and not use_gemv(x, q, b)
                errs.append(rel_err(project(x, q, b, s), fp8_linear_ref(x, q, s, b)))
                x3 = torch.randn(3, k, generator=g)
                errs.append(rel_err(gemv_triton(x3, q, None, scales=s)[0], fp8_linear_ref(x3, q, s)))
                for rows in (4, 8):  # the rows FP8 codes take per program at the model's shapes
                    errs.append(rel_err(gemv_triton(x3, q, None, scales=s, cfg={"BLOCK_N": rows})[0],
                                        fp8_linear_ref(x3, q, s)))
                for sum_after in (False, True):  # form 1 dequantizes; 2: block sums scaled once
                    gemv.FP8_SUM_AFTER = sum_after
                    try:
                        errs.append(rel_err(gemv_triton(x3, q, b, scales=s, cfg={"BLOCK_N": 4})[0],
                                            fp8_linear_ref(x3, q, s, b)))
                    finally:
                        gemv.FP8_SUM_AFTER = default_form
                r, nw = torch.randn(1, k, generator=g), 1 + 0.1 * torch.randn(k, generator=g)
                got = norm_linear(x, r, nw, 1e-6, q, b, s, want_normed=True)
                ref = norm_linear_ref(x, r, nw, 1e-6, dequantize(q, s, x.dtype), b)
                errs += [rel_err(a, c) for a, c in zip(got, ref)]
        hid, nq, nk, hd = 128, 4, 2, 16
        q, s = weight((nq + 2 * nk) * hd, hid)
        x, r, nw = torch.randn(1, hid, generator=g), torch.randn(1, hid, generator=g), 1 + 0.1 * torch.randn(hid, generator=g)
        rope, qn, kn = RotaryEmbedding(hd, 64, 10000.0), 1 + 0.1 * torch.randn(hd, generator=g), 1 + 0.1 * torch.randn(hd, generator=g)
        caches = (torch.randn(3, nk, 4, hd, generator=g), torch.randn(3, nk, 4, hd, generator=g))
        outs = {}
        for forced in (True, False):
            cache = tuple(c.clone() for c in caches)
            with force_triton(forced):
                outs[forced] = (*norm_qkv_rope(x, r, nw, 1e-6, q, None, s, rope, torch.tensor([7]), qn, kn, cache,
                                               torch.tensor([6]), (nq, nk)), *cache)
        errs += [rel_err(a, c) for a, c in zip(outs[True], outs[False])]
    finally:
        linear.GEMV_FP8 = before
    return max(errs)


def check_decoder_decode_step(g: torch.Generator) -> float:
    """A 2-layer Qwen3-MoE decoder (q/k norms; one MoE layer, one dense) stepping 1, 3 and
    4 sequences of a decode batch, through the Triton kernels (the norms folded into the
    qkv and router projections; at one row the routing folded in too, with and without)
    vs the torch reference path on the same weights and cache contents: hidden states
    and the K/V written."""
    from phalanx.config import ModelConfig
    from phalanx.kernels import norm_linear
    from phalanx.kernels.attention import AttentionMetadata
    from phalanx.kernels.backend import force_triton
    from phalanx.models.qwen3_moe import CausalLM

    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=48,
                      qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                      norm_topk_prob=True, mlp_only_layers=(1,))
    model = CausalLM(cfg)
    for name, p in model.named_parameters():
        p.data.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                     else torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    errs = []
    for batch, fold in ((1, False), (1, True), (3, False), (4, False)):
        norm_linear.ROUTE_FOLD = fold
        page, pages = 4, 3
        lens = torch.randint(2, page * pages, (batch,), generator=g).to(torch.int32)
        tables = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
        slots = torch.stack([tables[i, (lens[i] - 1) // page] * page + (lens[i] - 1) % page
                             for i in range(batch)]).long()
        meta = AttentionMetadata(torch.arange(batch + 1, dtype=torch.int32), lens, tables, slots, 1,
                                 int(lens.max()))
        ids, pos = torch.randint(0, 64, (batch,), generator=g), (lens - 1).long()
        fill = [(torch.randn(batch * pages, 2, page, 16, generator=g),
                 torch.randn(batch * pages, 2, page, 16, generator=g)) for _ in range(2)]
        outs = {}
        for forced in (True, False):
            caches = [(k.clone(), v.clone()) for k, v in fill]
            with force_triton(forced):
                outs[forced] = (model(ids, pos, caches, meta), caches)
        norm_linear.ROUTE_FOLD = False
        errs.append(rel_err(outs[True][0], outs[False][0]))
        for (kt, vt), (kr, vr) in zip(outs[True][1], outs[False][1]):
            errs += [rel_err(kt, kr), rel_err(vt, vr)]
    return max(errs)


if __name__ == "__main__":
    run_kernel_checks(globals())

# ---------------------------------------------------------------- pytest side

interpreter_results = results_fixture(__file__)
test_gemv_kernel_matches_reference = reference_test(globals(), TOL)


def test_gemv_tiles():
    """Rows per program: about 128 programs or more, the tile within 64 KiB, <= 16 rows;
    0 when one row does not fit (use_gemv then declines)."""
    pytest.importorskip("triton")
    from phalanx.kernels.gpu.gemv import GEMV_TILE_BYTES, gemv_block_n
    from phalanx.kernels.linear import GEMV_ROW_BYTES, use_gemv

    assert GEMV_ROW_BYTES == GEMV_TILE_BYTES  # what dispatch admits, the kernel can tile

    assert gemv_block_n(5120, 2048, 2) == 16  # qkv: 320 programs
    assert gemv_block_n(2048, 4096, 2) == 8  # o: 256 programs, 64 KiB tiles
    assert gemv_block_n(128, 2048, 2) == 1  # router: 128 programs
    assert gemv_block_n(5120, 2048, 4) == 8  # float32 halves the rows
    assert gemv_block_n(5120, 2048, 1) == 8  # FP8 codes: half bf16's rows
    assert gemv_block_n(2048, 4096, 1) == 4
    assert gemv_block_n(10, 40000, 1) == 1  # one row of codes fits where bf16's does not
    assert gemv_block_n(100, 72, 4) == 1
    assert gemv_block_n(10, 40000, 2) == 0
    from phalanx.kernels.backend import force_triton

    with force_triton(True):  # only asks; nothing is launched
        assert use_gemv(torch.randn(1, 2048), torch.randn(3, 2048))
        assert not use_gemv(torch.randn(1, 40000), torch.randn(3, 40000))  # a row past 64 KiB
        assert not use_gemv(torch.randn(2, 2048), torch.randn(3, 2048))  # 2 rows: cuBLAS
        assert not use_gemv(torch.randn(1, 2048), torch.randn(3, 2048).double())


def test_pdl_switches():
    """PDL is per kernel name, off for CPU tensors whatever the switch, and unknown names
    are refused; the launch keywords carry Triton's launch_pdl only when on."""
    pytest.importorskip("triton")
    from phalanx.kernels.gpu.pdl import PDL_DEFAULT, PDL_KERNELS, pdl_enabled, pdl_launch, set_pdl

    cpu = torch.device("cpu")
    old = set_pdl(True)
    try:
        assert old == PDL_DEFAULT and "gemm" not in PDL_DEFAULT and not pdl_enabled(cpu, "gemv")
        assert pdl_launch(cpu, "rope") == {"PDL": False}
        assert set_pdl({"gemv"}) == PDL_KERNELS
        assert set_pdl(False) == frozenset({"gemv"})
        with pytest.raises(ValueError, match="unknown PDL kernels"):
            set_pdl({"gemv", "lm_head"})
    finally:
        set_pdl(old)
