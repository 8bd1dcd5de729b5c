"""Fill a `CausalLM` shard from a Hugging Face checkpoint, reading only its slices.

Column-cut weights (q/k/v, gate/up) read a row range, row-cut weights (o, down) a column
range, experts only the rank's own. Nothing outside the shard is read from disk.
"""

from __future__ import annotations

import torch

from .checkpoint import Checkpoint
from .fp8_weights import is_fp8_checkpoint, read_fp8, read_fp8_experts, use_fp8
from .qwen3_moe import Attention, CausalLM, DecoderLayer, DenseMLP, SparseMoE


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != expected {tuple(dst.shape)}")
    dst.copy_(src.to(dst.dtype))


def _rows(ckpt: Checkpoint, name: str, r: range) -> torch.Tensor:
    return ckpt.load(name, dim=0, start=r.start, stop=r.stop)


def _load_attention(attn: Attention, ckpt: Checkpoint, prefix: str, model: CausalLM,
                    fp8: bool) -> None:
    cfg, shard, hd = model.cfg, model.shard, model.cfg.head_dim
    qh, kvh = shard.q_heads(cfg), shard.kv_heads(cfg)
    q_rows = range(qh.start * hd, qh.stop * hd)
    kv_rows = range(kvh.start * hd, kvh.stop * hd)
    parts = [(f"{prefix}.q_proj", q_rows), (f"{prefix}.k_proj", kv_rows), (f"{prefix}.v_proj", kv_rows)]
    if fp8:
        pieces = [read_fp8(ckpt, n, rows=r) for n, r in parts]
        use_fp8(attn, "qkv_proj", _cat(pieces))
        use_fp8(attn, "o_proj", read_fp8(ckpt, f"{prefix}.o_proj", cols=q_rows))
    else:
        _copy(attn.qkv_proj, torch.cat([_rows(ckpt, f"{n}.weight", r) for n, r in parts]),
              f"{prefix}.qkv")
        _copy(attn.o_proj, ckpt.load(f"{prefix}.o_proj.weight", dim=1, start=q_rows.start,
                                     stop=q_rows.stop), f"{prefix}.o_proj")
    if attn.qkv_bias is not None:
        _copy(attn.qkv_bias, torch.cat([_rows(ckpt, f"{n}.bias", r) for n, r in parts]), f"{prefix}.qkv bias")
    if attn.q_norm is not None:
        _copy(attn.q_norm, ckpt.load(f"{prefix}.q_norm.weight"), f"{prefix}.q_norm")
        _copy(attn.k_norm, ckpt.load(f"{prefix}.k_norm.weight"), f"{prefix}.k_norm")


def _cat(pieces: list) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([q for q, _ in pieces]), torch.cat([s for _, s in pieces])


def _load_dense(mlp: DenseMLP, ckpt: Checkpoint, prefix: str, model: CausalLM,
                fp8: bool) -> None:
    cols = model.shard.cols(mlp.down_proj.shape[1] * model.shard.tp_size)
    if fp8:
        use_fp8(mlp, "gate_up_proj", _cat([read_fp8(ckpt, f"{prefix}.{p}", rows=cols)
                                           for p in ("gate_proj", "up_proj")]))
        use_fp8(mlp, "down_proj", read_fp8(ckpt, f"{prefix}.down_proj", cols=cols))
        return
    gate_up = torch.cat([_rows(ckpt, f"{prefix}.gate_proj.weight", cols),
                         _rows(ckpt, f"{prefix}.up_proj.weight", cols)])
    _copy(mlp.gate_up_proj, gate_up, f"{prefix}.gate_up")
    _copy(mlp.down_proj, ckpt.load(f"{prefix}.down_proj.weight", dim=1, start=cols.start, stop=cols.stop),
          f"{prefix}.down_proj")


def _load_moe(moe: SparseMoE, ckpt: Checkpoint, prefix: str, layer: int, model: CausalLM,
              fp8: bool) -> None:
    _copy(moe.gate, ckpt.load(f"{prefix}.gate.weight"), f"{prefix}.gate")
    local = model.shard.local_experts(model.cfg)
    if local and fp8:
        w13, w2 = read_fp8_experts(ckpt, layer, list(local))
        use_fp8(moe, "w13", w13)
        use_fp8(moe, "w2", w2)
    elif local:
        w13, w2 = ckpt.load_experts(layer, local)
        _copy(moe.w13, w13, f"{prefix}.experts w13")
        _copy(moe.w2, w2, f"{prefix}.experts w2")
    if moe.shared is not None:
        _load_dense(moe.shared, ckpt, f"{prefix}.shared_expert", model, fp8)
        _copy(moe.shared_gate, ckpt.load(f"{prefix}.shared_expert_gate.weight"), f"{prefix}.shared_expert_gate")


def _load_layer(layer: DecoderLayer, ckpt: Checkpoint, i: int, model: CausalLM,
                fp8: bool) -> None:
    prefix = f"model.layers.{i}"
    _copy(layer.input_norm, ckpt.load(f"{prefix}.input_layernorm.weight"), f"{prefix}.input_layernorm")
    _copy(layer.post_attention_norm, ckpt.load(f"{prefix}.post_attention_layernorm.weight"),
          f"{prefix}.post_attention_layernorm")
    _load_attention(layer.attn, ckpt, f"{prefix}.self_attn", model, fp8)
    if isinstance(layer.mlp, SparseMoE):
        _load_moe(layer.mlp, ckpt, f"{prefix}.mlp", i, model, fp8)
    else:
        _load_dense(layer.mlp, ckpt, f"{prefix}.mlp", model, fp8)


@torch.no_grad()
def load_weights(model: CausalLM, ckpt: Checkpoint, quantize: bool = False) -> None:
    """Copy the shard's weights from `ckpt` into `model` (shapes checked). The attention
    and MLP/expert projections become FP8 (models/fp8_weights.py) when the checkpoint is
    FP8 or `quantize`; embeddings, norms, the router and the LM head stay as they are."""
    from tqdm.auto import tqdm

    fp8 = quantize or is_fp8_checkpoint(ckpt.hf_config)
    v = model.vocab
    _copy(model.embed_tokens, _rows(ckpt, "model.embed_tokens.weight", v), "model.embed_tokens")
    # A bar on a terminal only (disable=None): logs and tests stay clean.
    for i, layer in enumerate(tqdm(model.layers, desc="Loading weights", unit="layer",
                                   disable=None, leave=False)):
        _load_layer(layer, ckpt, i, model, fp8)
    _copy(model.norm, ckpt.load("model.norm.weight"), "model.norm")
    if not model.cfg.tie_word_embeddings:
        _copy(model.lm_head, _rows(ckpt, "lm_head.weight", v), "lm_head")
