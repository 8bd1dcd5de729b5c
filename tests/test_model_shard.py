"""A rank loads only its shard: its experts, its heads, its slice of the MLP."""

from __future__ import annotations

import pytest
import torch

from phalanx.models.checkpoint import Checkpoint
from phalanx.models.loader import read_model_config
from phalanx.models.qwen3_moe import CausalLM, SparseMoE
from phalanx.models.shard import ModelShard
from phalanx.models.weights import load_weights


class _ShapeOnlyComm:
    """Stands in for a TP group when only shapes and loaded bytes are checked."""

    def __init__(self, rank: int, size: int) -> None:
        self.tp_rank, self.tp_size = rank, size

    def all_reduce_tp(self, t):
        return t

    def all_gather_tp(self, t, dim):
        return t


def _build(folder: str, shard: ModelShard) -> tuple[CausalLM, Checkpoint]:
    cfg = read_model_config(folder)
    model = CausalLM(cfg, shard, _ShapeOnlyComm(shard.tp_rank, shard.tp_size))
    ckpt = Checkpoint(folder)
    load_weights(model, ckpt)
    return model, ckpt


def _expert_params(model: CausalLM) -> int:
    return sum(l.mlp.w13.numel() + l.mlp.w2.numel() for l in model.layers if isinstance(l.mlp, SparseMoE))


def test_expert_shard_loads_only_its_experts(tiny_model):
    full, full_ckpt = _build(tiny_model, ModelShard())
    part, part_ckpt = _build(tiny_model, ModelShard(experts=(3, 4, 5, 11)))
    assert _expert_params(part) * 4 == _expert_params(full)
    saved = (_expert_params(full) - _expert_params(part)) * 4  # float32 bytes not read
    assert full_ckpt.bytes_read - part_ckpt.bytes_read == saved
    for lf, lp in zip(full.layers, part.layers):
        if isinstance(lf.mlp, SparseMoE):
            assert torch.equal(lp.mlp.w13, lf.mlp.w13[[3, 4, 5, 11]])
            assert torch.equal(lp.mlp.w2, lf.mlp.w2[[3, 4, 5, 11]])


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_shards_hold_their_heads(tiny_model, tp_size):
    full, full_ckpt = _build(tiny_model, ModelShard())
    cfg = full.cfg
    # Read by every rank: norms, routers; plus K/V rows of replicated heads.
    replicated = sum(p.numel() * 4 for n, p in full.named_parameters()
                     if any(k in n for k in ("norm", "gate")) and "proj" not in n)
    kv_bytes = 2 * cfg.head_dim * cfg.hidden_size * 4 * cfg.num_hidden_layers
    for rank in range(tp_size):
        shard = ModelShard(tp_rank=rank, tp_size=tp_size, experts=tuple(range(rank, 16, tp_size)))
        part, ckpt = _build(tiny_model, shard)
        assert ckpt.bytes_read <= (full_ckpt.bytes_read - replicated) / tp_size + replicated + kv_bytes
        attn, fattn = part.layers[1].attn, full.layers[1].attn
        hd = cfg.head_dim
        q = shard.q_heads(cfg)
        kv = shard.kv_heads(cfg)
        assert attn.num_heads == cfg.num_attention_heads // tp_size
        assert attn.num_kv_heads == max(1, cfg.num_key_value_heads // tp_size)
        q_rows = fattn.qkv_proj[q.start * hd:q.stop * hd]
        k_off = cfg.num_attention_heads * hd
        k_rows = fattn.qkv_proj[k_off + kv.start * hd:k_off + kv.stop * hd]
        assert torch.equal(attn.qkv_proj[:len(q) * hd], q_rows)
        assert torch.equal(attn.qkv_proj[len(q) * hd:(len(q) + len(kv)) * hd], k_rows)
        assert torch.equal(attn.o_proj, fattn.o_proj[:, q.start * hd:q.stop * hd])
        dense = part.layers[0].mlp
        assert dense.down_proj.shape[1] == cfg.intermediate_size // tp_size
        rows = range(rank * cfg.vocab_size // tp_size, (rank + 1) * cfg.vocab_size // tp_size)
        assert torch.equal(part.embed_tokens, full.embed_tokens[rows.start:rows.stop])
        assert torch.equal(part.lm_head, full.lm_head[rows.start:rows.stop])


def test_bad_shards_are_refused(tiny_model):
    cfg = read_model_config(tiny_model)
    with pytest.raises(ValueError, match="tp=3"):
        CausalLM(cfg, ModelShard(tp_rank=0, tp_size=3), _ShapeOnlyComm(0, 3))
    with pytest.raises(ValueError, match="comm is TP rank"):
        CausalLM(cfg, ModelShard(tp_rank=0, tp_size=2))
    with pytest.raises(ValueError, match="expert ids"):
        CausalLM(cfg, ModelShard(experts=(0, 99)))
    with pytest.raises(ValueError, match="tp_rank"):
        ModelShard(tp_rank=2, tp_size=2)
