"""Qwen3-MoE in plain torch, over a paged KV cache.

One class covers the family: Qwen3-MoE (q/k RMSNorm, sparse MoE with softmax top-k
routing), Qwen2-MoE (q/k/v biases, a sigmoid-gated shared expert), and the dense
Qwen3 / Llama models (no experts). A model instance holds one rank's shard
(`ModelShard`); with `tp_size > 1` the caller supplies a `ModelComm` whose all-reduce
joins row-parallel partial sums (attention output, dense MLP, MoE; `RowParallel`, whose
sums can keep their bits at every TP width) and whose all-gather joins vocab-parallel
logits. With an `ExpertParallel` (DP×EP decode layout) the MoE
layers dispatch tokens to the ranks owning their experts instead.

Tokens are flattened: every forward takes `[T]` token ids and positions of all the
sequences in the batch, plus `AttentionMetadata` saying where each sequence's KV lives.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn
from torch.nn import functional as F

from ..config import ModelConfig
from ..kernels.activation import silu_and_mul
from ..kernels.attention import AttentionMetadata, decode_attention, prefill_attention
from ..kernels.invariant_linear import row_invariant_linear
from ..kernels.linear import project
from ..kernels.moe import fused_experts, make_expert_map, route
from ..kernels.norm import add_rms_norm
from ..kernels.norm_linear import norm_linear, norm_qkv_rope, norm_route
from ..kernels.rope import RotaryEmbedding
from .parallel import ExpertParallel, LocalComm, ModelComm
from .row_parallel import RowParallel, check_leaves, row_parallel_dims
from .shard import ModelShard
from .stages import Stages, interleave, run_to_end
KVCache = tuple[torch.Tensor, torch.Tensor]  # K and V pools, [pages, kv_heads, page_size, head_dim]


def _empty(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _fp8_scales(module: nn.Module, *weights: str) -> None:
    """`<weight>_scale` buffers, None until an FP8 weight is loaded (kernels/fp8.py: per
    row and 128-column block; the weight itself is then float8_e4m3fn)."""
    for name in weights:
        module.register_buffer(f"{name}_scale", None)


class Attention(nn.Module):
    """GQA self-attention for this rank's heads: qkv (column-cut), o (row-cut)."""

    def __init__(self, cfg: ModelConfig, shard: ModelShard, rows: RowParallel) -> None:
        super().__init__()
        self.rows = rows
        self.num_heads = len(shard.q_heads(cfg))
        self.num_kv_heads = len(shard.kv_heads(cfg))
        self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.head_dim ** -0.5
        q, kv = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = _empty(q + 2 * kv, cfg.hidden_size)
        self.qkv_bias = _empty(q + 2 * kv) if cfg.attention_bias else None
        self.o_proj = _empty(cfg.hidden_size, q)
        self.q_norm = _empty(cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = _empty(cfg.head_dim) if cfg.qk_norm else None
        _fp8_scales(self, "qkv_proj", "o_proj")

    def project(self, x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(qkv, new residual) of the layer's input: the residual add and input norm in
        front of the qkv projection (one launch at a few rows, kernels/norm_linear.py)."""
        qkv, _, residual = norm_linear(x, residual, norm_weight, eps, self.qkv_proj, self.qkv_bias,
                                       self.qkv_proj_scale)
        return qkv, residual

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor,
                eps: float, positions: torch.Tensor, rope: RotaryEmbedding, cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(the attention output summed over the TP group, the new residual) of the
        layer's input: the residual add and input norm, qkv, rope and the KV write,
        attention, o."""
        t = x.shape[0]
        if meta.is_decode_only:
            q, residual = norm_qkv_rope(x, residual, norm_weight, eps, self.qkv_proj, self.qkv_bias,
                                        self.qkv_proj_scale, rope, positions, self.q_norm, self.k_norm,
                                        cache, meta.slot_mapping, (self.num_heads, self.num_kv_heads))
            out = decode_attention(q, cache[0], cache[1], meta.seq_lens, meta.block_tables, self.scale)
            return self.rows.project(out.reshape(t, -1), self.o_proj, self.o_proj_scale), residual
        qkv, residual = self.project(x, residual, norm_weight, eps)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        # A prefill keeps the rotated k: its attention reads this step's K/V rows from
        # them rather than through the page table (same values as the cache's).
        q, k_rot = rope.apply_and_cache(q, k, positions, self.q_norm, self.k_norm, self.eps,
                                        kv_write=(v, cache[0], cache[1], meta.slot_mapping),
                                        keep_k=True)
        rows = (k_rot, v) if k_rot.dtype == cache[0].dtype else (None, None)
        out = prefill_attention(q, cache[0], cache[1], meta, self.scale, *rows)
        return self.rows.project(out.reshape(t, q_size), self.o_proj, self.o_proj_scale), residual


class DenseMLP(nn.Module):
    """SwiGLU MLP: gate/up column-cut, down row-cut; its output summed over the TP group."""

    def __init__(self, hidden: int, intermediate: int, rows: RowParallel) -> None:
        super().__init__()
        self.rows = rows
        self.gate_up_proj = _empty(2 * intermediate, hidden)
        self.down_proj = _empty(hidden, intermediate)
        _fp8_scales(self, "gate_up_proj", "down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = silu_and_mul(project(x, self.gate_up_proj, None, self.gate_up_proj_scale))
        return self.rows.project(h, self.down_proj, self.down_proj_scale)


class SparseMoE(nn.Module):
    """Softmax top-k router over all experts; this rank computes only its own experts
    (`expert_map`), so partial outputs of the ranks sum to the full block output."""

    def __init__(self, cfg: ModelConfig, shard: ModelShard, rows: RowParallel,
                 ep: Optional[ExpertParallel]) -> None:
        super().__init__()
        self.rows = rows
        self.comm = rows.comm
        self.ep = ep
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        local = shard.local_experts(cfg)
        self.gate = _empty(cfg.num_experts, cfg.hidden_size)
        self.w13 = _empty(len(local), 2 * cfg.moe_intermediate_size, cfg.hidden_size)
        self.w2 = _empty(len(local), cfg.hidden_size, cfg.moe_intermediate_size)
        _fp8_scales(self, "w13", "w2")
        full = local == tuple(range(cfg.num_experts))
        self.register_buffer("expert_map", None if full else make_expert_map(cfg.num_experts, local),
                             persistent=False)
        self.shared: Optional[DenseMLP] = None
        self.shared_gate: Optional[nn.Parameter] = None
        if cfg.shared_expert_intermediate_size:
            width = cfg.shared_expert_intermediate_size // shard.tp_size
            self.shared = DenseMLP(cfg.hidden_size, width, rows)
            self.shared_gate = _empty(1, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output, already summed over the TP group."""
        return run_to_end(self.stages(x))

    def stages(self, x: torch.Tensor, routing: Optional[tuple[torch.Tensor, torch.Tensor]] = None
               ) -> Stages[torch.Tensor]:
        """`forward` as a stage generator (yields while its EP exchanges are in flight).
        `routing`: x's (weights, ids) when the caller has routed it already."""
        if routing is None:
            routing = route(project(x, self.gate), self.top_k, self.renormalize, x.dtype)
        weights, ids = routing
        if self.ep is None:
            out = self.rows.experts(x, weights, ids, self.w13, self.w2, self.expert_map,
                                    self._scales())
        else:  # each token's chunk from one TP rank, zeros from the others
            out = self.rows.reduce((yield from self._dispatch(x, weights, ids)))
        if self.shared is not None:
            out = out + torch.sigmoid(row_invariant_linear(x, self.shared_gate)) * self.shared(x)
        return out

    def _dispatch(self, x: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> Stages[torch.Tensor]:
        """EP: the TP ranks of a DP group hold the same tokens, so each sends a disjoint
        chunk; the chunks come back in place and the TP all-reduce joins them."""
        t, tp, r = x.shape[0], self.comm.tp_size, self.comm.tp_rank
        lo, hi = t * r // tp, t * (r + 1) // tp
        part = yield from self.ep.stages(x[lo:hi], weights[lo:hi], ids[lo:hi], self._experts)
        if tp == 1:
            return part
        out = x.new_zeros(x.shape)
        out[lo:hi] = part
        return out

    def _experts(self, x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Weighted output of each received (token, local expert) row."""
        return fused_experts(x, weights[:, None], local_ids[:, None], self.w13, self.w2, None,
                             self._scales())

    def _scales(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(w13_scale, w2_scale) when the stacks are FP8 codes, else None."""
        return None if self.w13_scale is None else (self.w13_scale, self.w2_scale)

    def dummy_stages(self) -> Stages[None]:
        """An idle rank's (or empty micro-batch's) part in the layer's all-to-alls."""
        if self.ep is not None:
            empty = self.gate.new_empty((0, self.gate.shape[1]))  # the model dtype, not FP8
            yield from self.ep.stages(empty, empty.new_empty((0, self.top_k)),
                                      torch.empty((0, self.top_k), dtype=torch.int64,
                                                  device=empty.device), self._experts)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: ModelShard, layer: int, rows: RowParallel,
                 ep: Optional[ExpertParallel]) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_norm = _empty(cfg.hidden_size)
        self.post_attention_norm = _empty(cfg.hidden_size)
        self.attn = Attention(cfg, shard, rows)
        self.mlp: nn.Module
        if cfg.is_moe_layer(layer):
            self.mlp = SparseMoE(cfg, shard, rows, ep)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size // shard.tp_size, rows)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor], positions: torch.Tensor,
                rope: RotaryEmbedding, cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        return run_to_end(self.stages(x, residual, positions, rope, cache, meta))

    def stages(self, x: torch.Tensor, residual: Optional[torch.Tensor], positions: torch.Tensor,
               rope: RotaryEmbedding, cache: KVCache,
               meta: AttentionMetadata) -> Stages[tuple[torch.Tensor, torch.Tensor]]:
        """`forward` as a stage generator (a MoE layer yields while exchanging)."""
        x, residual = self.attn(x, residual, self.input_norm, self.eps, positions, rope, cache, meta)
        if isinstance(self.mlp, SparseMoE):
            # The post-attention norm in front of the router's projection and routing; the
            # experts read the normed rows it returns.
            routing, x, residual = norm_route(x, residual, self.post_attention_norm, self.eps,
                                              self.mlp.gate, self.mlp.top_k, self.mlp.renormalize)
            return (yield from self.mlp.stages(x, routing)), residual
        x, residual = add_rms_norm(x, residual, self.post_attention_norm, self.eps)
        return self.mlp(x), residual


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head of one rank's shard."""

    def __init__(self, cfg: ModelConfig, shard: ModelShard = ModelShard(),
                 comm: Optional[ModelComm] = None, ep: Optional[ExpertParallel] = None,
                 tp_invariant_width: int = 1) -> None:
        """`tp_invariant_width`: the row-parallel sums' leaves (models/row_parallel.py;
        1: the plain all-reduce)."""
        super().__init__()
        shard.validate(cfg)
        comm = comm or LocalComm()
        if comm.tp_size != shard.tp_size or comm.tp_rank != shard.tp_rank:
            raise ValueError(f"comm is TP rank {comm.tp_rank} of {comm.tp_size}, shard "
                             f"{shard.tp_rank} of {shard.tp_size}")
        check_leaves(tp_invariant_width, shard.tp_size, row_parallel_dims(cfg))
        rows = RowParallel(comm, tp_invariant_width)
        self.cfg = cfg
        self.shard = shard
        self.comm = comm
        self.vocab = shard.vocab(cfg)  # this rank's rows of the embedding and LM head
        self.embed_tokens = _empty(len(self.vocab), cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, shard, i, rows, ep)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = _empty(cfg.hidden_size)
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else _empty(len(self.vocab), cfg.hidden_size)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard.tp_size == 1:
            return F.embedding(input_ids, self.embed_tokens)
        # Vocab-parallel: rows outside this rank's range are zeros, the all-reduce fills them.
        local = input_ids - self.vocab.start
        inside = (local >= 0) & (local < len(self.vocab))
        x = F.embedding(local.clamp(0, len(self.vocab) - 1), self.embed_tokens)
        x = x * inside[:, None].to(x.dtype)
        return self.comm.all_reduce_tp(x)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[KVCache],
                meta: AttentionMetadata,
                layer_done: Optional[Callable[[int], None]] = None) -> torch.Tensor:
        """Final hidden states `[T, hidden]` (normed) of every token in the batch.

        `layer_done(i)` runs once layer i has written its KV (streaming prefill)."""
        return run_to_end(self.stages(input_ids, positions, caches, meta, layer_done))

    def stages(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[KVCache],
               meta: AttentionMetadata,
               layer_done: Optional[Callable[[int], None]] = None) -> Stages[torch.Tensor]:
        """`forward` as a stage generator: one micro-batch of a two-batch-overlap step
        (`models/stages.py`), which yields twice per MoE layer while exchanging."""
        x = self.embed(input_ids)
        residual = None
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            x, residual = yield from layer.stages(x, residual, positions, self.rope, cache, meta)
            if layer_done is not None:
                layer_done(i)
        x, _ = add_rms_norm(x, residual, self.norm, self.cfg.rms_norm_eps)
        return x

    def dummy_stages(self) -> Stages[None]:
        """An idle rank's step (or an empty micro-batch) in a DP×EP group: only the
        all-to-alls every rank must join."""
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoE):
                yield from layer.mlp.dummy_stages()

    def dummy_forward(self, microbatches: int = 1) -> None:
        """`dummy_stages` of `microbatches` micro-batches, interleaved as a step's."""
        interleave([self.dummy_stages() for _ in range(microbatches)])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (vocab-parallel shards joined by an all-gather)."""
        return self.comm.all_gather_tp(row_invariant_linear(hidden, self.lm_head), dim=-1)
