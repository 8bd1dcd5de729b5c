"""The FP8 side of `bench/decode_gpu.py --quantization fp8` (issue 33).

The bf16 rows of such a run compute with the *dequantized twin* of the FP8 weights (the
transformers model's projections quantized to 128 x 128 blocks and back, in place), so the
FP8 rows run the same numbers: their greedy tokens are compared with the bf16 rows'
(agreement, not equality: the FP8 kernels quantize prefill activations, and bf16 rounding
applies). The floors count the bytes the FP8 kernels read: codes (1 byte) plus their
per-row scales (4 bytes per 128 columns), bf16 for the router, LM head and KV cache.
"""

from __future__ import annotations

import importlib

import torch

from phalanx.config import ModelConfig
from phalanx.kernels.fp8 import BLOCK, dequantize, expand_block_scales, quantize_blocks
from phalanx.models.fp8_weights import use_fp8

_HF_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, blocks = quantize_blocks(w)
    return q, expand_block_scales(blocks, w.shape[-2])


@torch.no_grad()
def make_twin_in_place(hf) -> None:
    """Every projection of the transformers model (attention, experts) replaced by its
    FP8 round trip: the weights an FP8 checkpoint's dequantized twin holds."""
    for layer in hf.model.layers:
        tensors = [getattr(layer.self_attn, p).weight for p in _HF_PROJECTIONS]
        tensors += [layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj]
        for t in tensors:
            q, s = _blocks(t.data)
            t.data.copy_(dequantize(q, s, t.dtype))


@torch.no_grad()
def quantize_in_place(model) -> None:
    """phalanx's model (bf16, `decode_hf.phalanx_model_from_hf`) to FP8 projections, the
    format `--quantization fp8` loads (exact on the twin: its values are on the grid)."""
    for layer in model.layers:
        for module, name in ((layer.attn, "qkv_proj"), (layer.attn, "o_proj"),
                             (layer.mlp, "w13"), (layer.mlp, "w2")):
            use_fp8(module, name, _blocks(getattr(module, name).data))


def decode_bytes_fp8(cfg: ModelConfig, batch: int, ctx: int) -> float:
    """`decode_gpu.decode_bytes` with FP8 projections: 1 byte per code + 4 per row and
    128 columns; the router, LM head and KV cache in bf16."""
    h, hd, e, k = cfg.hidden_size, cfg.head_dim, cfg.num_experts, cfg.num_experts_per_tok
    attn = h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd + cfg.num_attention_heads * hd * h
    touched = e * (1 - (1 - k / e) ** batch)
    quantized = cfg.num_hidden_layers * (attn + touched * 3 * h * cfg.moe_intermediate_size)
    plain = cfg.num_hidden_layers * e * h + cfg.vocab_size * h
    kv = batch * ctx * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * hd
    return quantized * (1 + 4 / BLOCK) + 2.0 * (plain + kv)


def prefill_seconds_fp8(cfg: ModelConfig, num_seqs: int, length: int, ceil: dict) -> float:
    """The prefill floor: the projections' FLOPs at the FP8 matmul rate, attention, the
    router and the LM head at the bf16 rate."""
    h, hd = cfg.hidden_size, cfg.head_dim
    attn_w = h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd + cfg.num_attention_heads * hd * h
    tokens = num_seqs * length
    fp8 = 2.0 * tokens * cfg.num_hidden_layers * (attn_w + cfg.num_experts_per_tok * 3 * h
                                                    * cfg.moe_intermediate_size)
    attn = num_seqs * cfg.num_hidden_layers * 2 * 2 * cfg.num_attention_heads * hd * length * length / 2
    plain = 2.0 * tokens * cfg.num_hidden_layers * cfg.num_experts * h + 2.0 * num_seqs * cfg.vocab_size * h
    return fp8 / ceil["fp8_matmul_flops_per_s"] + (attn + plain) / ceil["matmul_flops_per_s"]


def fp8_matmul_rate(n: int = 8192) -> float:
    """FLOP/s of cuBLAS's FP8 GEMM (`torch._scaled_mm`, e4m3, bf16 out) at n^3."""
    from triton.testing import do_bench
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    ms = do_bench(lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16),
                  warmup=50, rep=300, return_mode="median")
    return 2 * n ** 3 / (ms * 1e-3)


def token_agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Greedy streams against the bf16 twin's: the share of requests whose first token
    matches, the mean length of the equal prefix over the shorter stream, whole streams equal."""
    pairs = list(zip(ours, theirs))
    prefix = []
    for a, b in pairs:
        n = min(len(a), len(b))
        prefix.append(next((i for i in range(n) if a[i] != b[i]), n) / max(n, 1))
    return dict(first_equal=sum(a[:1] == b[:1] for a, b in pairs) / len(pairs),
                mean_equal_prefix=sum(prefix) / len(pairs),
                streams_equal=sum(a == b for a, b in pairs) / len(pairs))


def _fp8_switch(module: str, name: str, off_value, default=None):
    """A switch for `FP8_BASELINES` (`decode_gpu.py --baselines`): on sets ``module.name``
    to ``off_value`` (the part turned off, or a candidate turned on), off restores
    ``default`` (None: True/False, the opposite of ``off_value``)."""
    def switch(on: bool) -> None:
        mod = importlib.import_module(f"phalanx.kernels{module}")
        setattr(mod, name, off_value if on else (not off_value) if default is None else default)
    return switch


# --baselines names for the FP8 rows only: (switch, the batches it changes, whether it
# changes prefill too: then the prefill row runs again beside the decode rows).
FP8_BASELINES = {
    # the FP8 linear where the one-row GEMV takes FP8 codes
    "fp8linear": (_fp8_switch(".linear", "GEMV_FP8", False),
                  lambda b: b <= importlib.import_module("phalanx.kernels.linear").GEMV_MAX_M, False),
    # the FP8 GEMVs' 64 KiB-tile rows (qkv 16, o 16) instead of half bf16's
    "fp8gemv16": (_fp8_switch(".gpu.gemv", "FP8_HALF_ROWS", False), lambda b: b <= 4, False),
    # the FP8 GEMVs dequantizing each code (form 1), not summing each block's code * x
    # and scaling the sum once
    "fp8gemvdeq": (_fp8_switch(".gpu.gemv", "FP8_SUM_AFTER", False), lambda b: b <= 4, False),
    # the experts (both paths) dequantizing each code as the reference does
    # instead of dotting the codes in float16 (SCALE_AFTER)
    "fp8dequant": (_fp8_switch(".gpu.moe_fp8", "DECODE_F16", False), lambda b: True, False),
    # the FP8-activation linears (batches past 16, prefill) by the Triton kernel instead of
    # cuBLAS's block-scaled GEMM
    "fp8tritonlin": (_fp8_switch(".gpu.fp8_linear", "CUBLAS_BLOCKWISE", False), lambda b: b > 16, True),
    # a candidate, off by default: the experts at every decode batch (the small path's too)
    # with the weight rows as the MMA's M and FP8 activations (`moe_fp8_decode`)
    "fp8wrows": (_fp8_switch(".gpu.moe_fp8", "DECODE_WEIGHT_ROWS", {}, False), lambda b: True, False),
    # the decode tiles' down with 128-row N tiles and 3 stages (the tile before N2 64, 4 stages)
    "fp8down128": (_fp8_switch(".gpu.moe_fp8", "DECODE_DOWN", {"N2": 128, "stages2": 3}, {}), lambda b: b > 4, False),
}
