"""The Hugging Face side of `bench/decode_gpu.py`: the transformers model with random
weights on the GPU, phalanx's model as views of its tensors (the expert layout
[E, 2I, H] / [E, H, I] is the same, so both fit on one H200), and `generate`'s decode
rate.
"""

from __future__ import annotations

import time

import torch

from phalanx.config import ModelConfig


def build_hf(hf_cfg: dict):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(**{k: v for k, v in hf_cfg.items() if k != "model_type"})
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = Qwen3MoeForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    with torch.no_grad():
        g = torch.Generator(device="cuda").manual_seed(0)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model.eval()


def phalanx_model_from_hf(hf, cfg: ModelConfig, tp_invariant_width: int = 1):
    """A phalanx `CausalLM` whose weights are views of the transformers model's
    (`tp_invariant_width`: its row-parallel sums', models/row_parallel.py)."""
    from torch import nn
    from phalanx.kernels.rope import RotaryEmbedding
    from phalanx.models.qwen3_moe import CausalLM

    def param(t: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(t, requires_grad=False)

    with torch.device("meta"):
        model = CausalLM(cfg, tp_invariant_width=tp_invariant_width)
    model.embed_tokens = param(hf.model.embed_tokens.weight)
    model.lm_head = param(hf.lm_head.weight)
    model.norm = param(hf.model.norm.weight)
    for ours, theirs in zip(model.layers, hf.model.layers):
        a, sa = ours.attn, theirs.self_attn
        a.qkv_proj = param(torch.cat([sa.q_proj.weight, sa.k_proj.weight, sa.v_proj.weight]))
        a.o_proj = param(sa.o_proj.weight)
        a.q_norm, a.k_norm = param(sa.q_norm.weight), param(sa.k_norm.weight)
        ours.input_norm = param(theirs.input_layernorm.weight)
        ours.post_attention_norm = param(theirs.post_attention_layernorm.weight)
        ours.mlp.gate = param(theirs.mlp.gate.weight)
        ours.mlp.w13 = param(theirs.mlp.experts.gate_up_proj)
        ours.mlp.w2 = param(theirs.mlp.experts.down_proj)
    model.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                 device="cuda")
    return model.eval()


def hf_decode_tok_s(hf, batch: int, ctx: int, steps: int) -> float:
    """Per-step decode time of `generate`, from two runs that differ only in new tokens."""
    ids = torch.randint(0, 150000, (batch, ctx), device="cuda")
    mask = torch.ones_like(ids)

    def run(new: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                    min_new_tokens=new, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    run(2)
    dt = (run(steps + 1) - run(1)) / steps
    return batch / dt
