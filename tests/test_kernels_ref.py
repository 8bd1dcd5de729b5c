"""CPU tests of the torch reference kernels against HF Qwen3-MoE and dense formulas."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

from phalanx.kernels.activation import silu_and_mul
from phalanx.kernels.attention import (
    AttentionMetadata,
    decode_attention,
    prefill_attention,
    write_kv,
)
from phalanx.kernels.moe import fused_experts, make_expert_map, route
from phalanx.kernels.norm import add_rms_norm, rms_norm
from phalanx.kernels.rope import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]


def _same_as_hf(out: torch.Tensor, ref: torch.Tensor) -> None:
    """HF's experts' values within rounding: each expert's GEMM runs on rows padded to a
    multiple of 4 (kernels/invariant_linear.py) and a token's slots are summed in float32
    in slot order (the EP combine's order), where HF sums in expert order in the dtype."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def _config(**overrides) -> Qwen3MoeConfig:
    kw = dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, hidden_act="silu",
    )
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


# ---------------------------------------------------------------- norm


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_formula_and_hf(dtype):
    g = _gen(0)
    x = _randn(g, 7, 64, dtype=dtype) * 3
    w = (1 + 0.1 * _randn(g, 64)).to(dtype)
    eps = 1e-6
    xf = x.float()
    formula = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    hf_norm = hf.Qwen3MoeRMSNorm(64, eps=eps).to(dtype)
    with torch.no_grad():
        hf_norm.weight.copy_(w)
        ref = hf_norm(x)
    out = rms_norm(x, w, eps)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, formula)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_hf(dtype):
    g = _gen(1)
    x, res = _randn(g, 5, 64, dtype=dtype), _randn(g, 5, 64, dtype=dtype)
    w = (1 + 0.1 * _randn(g, 64)).to(dtype)
    x0, res0 = x.clone(), res.clone()
    hf_norm = hf.Qwen3MoeRMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf_norm.weight.copy_(w)
        ref_res = res + x  # HF: hidden_states = residual + hidden_states
        ref = hf_norm(ref_res)
    normed, new_res = add_rms_norm(x, res, w, 1e-6)
    assert new_res.dtype == dtype and torch.equal(new_res, ref_res)
    assert torch.equal(normed, ref)
    assert torch.equal(x, x0) and torch.equal(res, res0)


# ---------------------------------------------------------------- activation


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = _randn(_gen(2), 3, 4, 2 * 24, dtype=dtype)
    out = silu_and_mul(x)
    assert out.shape == (3, 4, 24) and out.dtype == dtype
    assert torch.equal(out, F.silu(x[..., :24]) * x[..., 24:])


# ---------------------------------------------------------------- rope


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_matches_hf(dtype):
    cfg = _config()
    g = _gen(3)
    t, nh, nkv, hd, max_pos = 37, 8, 2, 16, 512
    positions = torch.randint(0, max_pos, (t,), generator=g)
    positions[0], positions[1] = 0, max_pos - 1
    q, k = _randn(g, t, nh, hd, dtype=dtype), _randn(g, t, nkv, hd, dtype=dtype)

    hf_rope = hf.Qwen3MoeRotaryEmbedding(cfg)
    cos, sin = hf_rope(q, positions[None])  # [1, T, D]
    # HF layout is [B, H, T, D].
    q_hf, k_hf = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)

    rope = RotaryEmbedding(hd, max_pos, 1_000_000.0)
    assert rope.cos_cache.shape == (max_pos, hd // 2) and rope.cos_cache.dtype == torch.float32
    q_rot, k_rot = rope.apply(q, k, positions)
    assert q_rot.dtype == dtype and q_rot.shape == q.shape and k_rot.shape == k.shape
    assert torch.equal(q_rot, q_hf[0].transpose(0, 1))
    assert torch.equal(k_rot, k_hf[0].transpose(0, 1))


def test_rope_rejects_out_of_range_positions():
    rope = RotaryEmbedding(16, 32, 10000.0)
    q, k = torch.ones(2, 4, 16), torch.ones(2, 1, 16)
    with pytest.raises(ValueError):
        rope.apply(q, k, torch.tensor([0, 32]))
    rope.apply(q, k, torch.tensor([0, 31]))


# ---------------------------------------------------------------- attention

NH, NKV, HD = 8, 2, 16  # GQA ratio 4
SCALE = HD**-0.5
BAD_PAGE = 10**6  # padding block-table entry: indexing with it would raise


def _build_batch(g, seqs, page_size):
    """Paged cache holding each sequence's prefix; new tokens' K/V returned for write_kv.

    seqs: list of (prefix_len, new_len). Returns dict with dense per-sequence K/V
    [kvh, L, hd], q [T, H, hd], new k/v [T, kvh, hd], caches, metadata.
    """
    lens = [p + n for p, n in seqs]
    n_pages = [-(-L // page_size) for L in lens]
    total_pages = sum(n_pages) + 5
    max_pages = max(n_pages) + 2
    perm = torch.randperm(total_pages, generator=g).tolist()
    k_cache = torch.full((total_pages, NKV, page_size, HD), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    block_tables = torch.full((len(seqs), max_pages), BAD_PAGE, dtype=torch.int32)
    dense_k, dense_v, slots, q_new, k_new, v_new = [], [], [], [], [], []
    for s, ((prefix, new), L) in enumerate(zip(seqs, lens)):
        pages = [perm.pop() for _ in range(n_pages[s])]
        block_tables[s, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        K, V = _randn(g, NKV, L, HD), _randn(g, NKV, L, HD)
        dense_k.append(K)
        dense_v.append(V)
        for p in range(L):
            page, off = pages[p // page_size], p % page_size
            if p < prefix:
                k_cache[page, :, off] = K[:, p]
                v_cache[page, :, off] = V[:, p]
            else:
                slots.append(page * page_size + off)
        q_new.append(_randn(g, new, NH, HD))
        k_new.append(K[:, prefix:].transpose(0, 1))
        v_new.append(V[:, prefix:].transpose(0, 1))
    qsl = torch.tensor([0] + [n for _, n in seqs]).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        query_start_loc=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=block_tables, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(n for _, n in seqs), max_seq_len=max(lens),
    )
    return dict(dense_k=dense_k, dense_v=dense_v, q=torch.cat(q_new), k=torch.cat(k_new),
                v=torch.cat(v_new), k_cache=k_cache, v_cache=v_cache, meta=meta)


def _dense_ref(q_s, K, V):
    """Plain causal SDPA of q_s [n, H, hd] (trailing queries) over K, V [kvh, L, hd]."""
    n, L = q_s.shape[0], K.shape[1]
    grp = NH // NKV
    k = K.repeat_interleave(grp, dim=0)[None]
    v = V.repeat_interleave(grp, dim=0)[None]
    mask = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
    out = F.scaled_dot_product_attention(q_s.transpose(0, 1)[None], k, v, attn_mask=mask, scale=SCALE)
    return out[0].transpose(0, 1)


def _sub_meta(meta, s):
    """Metadata for sequence s alone (same cache, same pages)."""
    qsl = meta.query_start_loc
    start, end = int(qsl[s]), int(qsl[s + 1])
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
        seq_lens=meta.seq_lens[s : s + 1].clone(), block_tables=meta.block_tables[s : s + 1].clone(),
        slot_mapping=meta.slot_mapping[start:end].clone(), max_query_len=end - start,
        max_seq_len=int(meta.seq_lens[s]),
    ), start, end


PREFILL_SEQS = [(0, 5), (3, 1), (13, 7), (16, 1), (0, 1), (31, 4), (4, 12), (0, 19)]
DECODE_PREFIXES = [0, 3, 4, 15, 16, 17, 40]


@pytest.mark.parametrize("page_size", [4, 16])
def test_write_kv_places_tokens_and_skips_negative_slots(page_size):
    g = _gen(4)
    num_pages = 6
    k_cache = _randn(g, num_pages, NKV, page_size, HD)
    v_cache = _randn(g, num_pages, NKV, page_size, HD)
    k0, v0 = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_pages * page_size, generator=g)[:9].to(torch.int64)
    slots[[2, 5]] = -1
    k, v = _randn(g, 9, NKV, HD), _randn(g, 9, NKV, HD)
    write_kv(k, v, k_cache, v_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        page, off = divmod(slot, page_size)
        assert torch.equal(k_cache[page, :, off, :], k[t]) and torch.equal(v_cache[page, :, off, :], v[t])
        k0[page, :, off], v0[page, :, off] = k[t], v[t]
    # Nothing else changed (the two skipped tokens wrote nowhere).
    assert torch.equal(k_cache, k0) and torch.equal(v_cache, v0)


@pytest.mark.parametrize("page_size", [4, 16])
def test_prefill_attention_matches_dense_sdpa(page_size):
    b = _build_batch(_gen(5), PREFILL_SEQS, page_size)
    meta = b["meta"]
    write_kv(b["k"], b["v"], b["k_cache"], b["v_cache"], meta.slot_mapping)
    assert not meta.is_decode_only and meta.num_seqs == len(PREFILL_SEQS)
    out = prefill_attention(b["q"], b["k_cache"], b["v_cache"], meta, SCALE)
    assert out.shape == b["q"].shape and out.dtype == torch.float32
    qsl = meta.query_start_loc.tolist()
    for s in range(meta.num_seqs):
        ref = _dense_ref(b["q"][qsl[s] : qsl[s + 1]], b["dense_k"][s], b["dense_v"][s])
        assert _rel(out[qsl[s] : qsl[s + 1]], ref) < 1e-5, s
    # Batch invariance: each sequence alone gives bit-identical rows.
    for s in range(meta.num_seqs):
        sub, start, end = _sub_meta(meta, s)
        alone = prefill_attention(b["q"][start:end], b["k_cache"], b["v_cache"], sub, SCALE)
        assert torch.equal(alone, out[start:end]), s


@pytest.mark.parametrize("page_size", [4, 16])
def test_decode_attention_matches_dense_sdpa(page_size):
    b = _build_batch(_gen(6), [(p, 1) for p in DECODE_PREFIXES], page_size)
    meta = b["meta"]
    write_kv(b["k"], b["v"], b["k_cache"], b["v_cache"], meta.slot_mapping)
    assert meta.is_decode_only
    out = decode_attention(b["q"], b["k_cache"], b["v_cache"], meta.seq_lens, meta.block_tables, SCALE)
    assert out.shape == (len(DECODE_PREFIXES), NH, HD)
    for s in range(meta.num_seqs):
        ref = _dense_ref(b["q"][s : s + 1], b["dense_k"][s], b["dense_v"][s])
        assert _rel(out[s : s + 1], ref) < 1e-5, s
    # Decode and prefill agree on a decode-only batch.
    pre = prefill_attention(b["q"], b["k_cache"], b["v_cache"], meta, SCALE)
    torch.testing.assert_close(out, pre, rtol=1e-6, atol=1e-6)
    # Batch invariance.
    for s in range(meta.num_seqs):
        alone = decode_attention(b["q"][s : s + 1], b["k_cache"], b["v_cache"],
                                 meta.seq_lens[s : s + 1], meta.block_tables[s : s + 1], SCALE)
        assert torch.equal(alone, out[s : s + 1]), s


def test_attention_bf16_output_dtype():
    b = _build_batch(_gen(7), [(5, 3), (0, 1)], 4)
    meta = b["meta"]
    kc, vc = b["k_cache"].bfloat16(), b["v_cache"].bfloat16()
    write_kv(b["k"].bfloat16(), b["v"].bfloat16(), kc, vc, meta.slot_mapping)
    q = b["q"].bfloat16()
    out = prefill_attention(q, kc, vc, meta, SCALE)
    assert out.dtype == torch.bfloat16
    for s, (start, end) in enumerate([(0, 3), (3, 4)]):
        ref = _dense_ref(q[start:end].float(), b["dense_k"][s].bfloat16().float(),
                         b["dense_v"][s].bfloat16().float())
        assert _rel(out[start:end], ref) < 1e-2


# ---------------------------------------------------------------- moe

E, H, I, TOPK = 8, 64, 32, 2


def _moe_weights(g, dtype=torch.float32):
    w13 = (_randn(g, E, 2 * I, H) * H**-0.5).to(dtype)
    w2 = (_randn(g, E, H, I) * I**-0.5).to(dtype)
    return w13, w2


def _naive_experts(x, w, ids, w13, w2):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e] @ x[t]
            out[t] += w[t, j] * (w2[e] @ (F.silu(h[:I]) * h[I:]))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_hf_router(dtype, renormalize):
    cfg = _config(norm_topk_prob=renormalize, num_experts_per_tok=4)
    g = _gen(8)
    router = hf.Qwen3MoeTopKRouter(cfg).to(dtype)
    with torch.no_grad():
        router.weight.copy_(_randn(g, E, H))
        logits, ref_w, ref_ids = router(_randn(g, 11, H, dtype=dtype))
    w, ids = route(logits, 4, renormalize, logits.dtype)
    assert w.dtype == dtype and ids.dtype == torch.int64 and w.shape == (11, 4)
    assert torch.equal(ids, ref_ids) and torch.equal(w, ref_w)
    if renormalize:
        torch.testing.assert_close(w.float().sum(-1), torch.ones(11), rtol=1e-2, atol=1e-2)


def test_fused_experts_matches_naive_loop():
    g = _gen(9)
    w13, w2 = _moe_weights(g)
    x = _randn(g, 13, H)
    w, ids = route(_randn(g, 13, E), TOPK, True, torch.float32)
    out = fused_experts(x, w, ids, w13, w2)
    assert out.shape == (13, H) and out.dtype == torch.float32
    assert _rel(out, _naive_experts(x, w, ids, w13, w2)) < 1e-5


def test_fused_experts_empty():
    w13, w2 = _moe_weights(_gen(10))
    x = torch.empty(0, H)
    out = fused_experts(x, torch.empty(0, TOPK), torch.empty(0, TOPK, dtype=torch.int64), w13, w2)
    assert out.shape == (0, H)


def test_fused_experts_expert_map_partitions_sum_to_full():
    g = _gen(11)
    w13, w2 = _moe_weights(g)
    x = _randn(g, 17, H)
    w, ids = route(_randn(g, 17, E), TOPK, True, torch.float32)
    full = fused_experts(x, w, ids, w13, w2)
    ident = make_expert_map(E, list(range(E)))
    assert ident.dtype == torch.int32
    assert torch.equal(fused_experts(x, w, ids, w13, w2, ident), full)
    even, odd = [0, 2, 4, 6], [7, 1, 5, 3]  # local order need not be sorted
    map_a, map_b = make_expert_map(E, even), make_expert_map(E, torch.tensor(odd))
    assert map_b.tolist() == [-1, 1, -1, 3, -1, 2, -1, 0]
    out_a = fused_experts(x, w, ids, w13[even], w2[even], map_a)
    out_b = fused_experts(x, w, ids, w13[odd], w2[odd], map_b)
    assert _rel(out_a + out_b, full) < 1e-5
    assert _rel(out_a, _naive_experts(x, w * (ids % 2 == 0), ids, w13, w2)) < 1e-5
    with pytest.raises(ValueError):
        make_expert_map(E, [1, 1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_experts_matches_hf_experts(dtype):
    cfg = _config()
    g = _gen(12)
    w13, w2 = _moe_weights(g, dtype)
    experts = hf.Qwen3MoeExperts(cfg).to(dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(w13)
        experts.down_proj.copy_(w2)
    x = _randn(g, 21, H, dtype=dtype)
    w, ids = route(_randn(g, 21, E, dtype=dtype), TOPK, False, dtype)
    with torch.no_grad():
        ref = experts(x, ids, w)
    out = fused_experts(x, w, ids, w13, w2)
    assert out.dtype == dtype
    _same_as_hf(out, ref)


def test_route_plus_experts_matches_hf_sparse_block():
    cfg = _config(norm_topk_prob=True)
    g = _gen(13)
    block = hf.Qwen3MoeSparseMoeBlock(cfg)
    w13, w2 = _moe_weights(g)
    gate_w = _randn(g, E, H)
    with torch.no_grad():
        block.experts.gate_up_proj.copy_(w13)
        block.experts.down_proj.copy_(w2)
        block.gate.weight.copy_(gate_w)
        x = _randn(g, 2, 9, H)
        ref = block(x).reshape(-1, H)
    xt = x.reshape(-1, H)
    w, ids = route(F.linear(xt, gate_w), TOPK, True, xt.dtype)
    out = fused_experts(xt, w, ids, w13, w2)
    _same_as_hf(out, ref)
