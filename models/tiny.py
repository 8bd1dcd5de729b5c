"""The tiny default model: a random-weight Qwen3-MoE built locally from a seed.

Everything here is deterministic and offline: the tokenizer is a byte-level
BPE trained on Python's own ``pydoc_data`` text, and the weights are drawn from
one ``torch.Generator`` seeded by the caller. Folders written here are ordinary
Hugging Face model folders (config.json, model.safetensors with the per-expert
hub key layout, tokenizer.json, tokenizer_config.json, generation_config.json)
that ``transformers`` loads without any newly initialised weight.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..envs import envs

TINY_MODEL_NAME = "tiny-qwen3-moe-v2"  # v2: the chat template renders tools

# Specials are appended after the 2045 trained BPE tokens, as in Qwen's vocab.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BPE_VOCAB_SIZE = 2045
VOCAB_SIZE = BPE_VOCAB_SIZE + len(SPECIAL_TOKENS)
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = range(BPE_VOCAB_SIZE, VOCAB_SIZE)

# Qwen3's chat template in shape: tools are listed in the system turn between <tools>
# tags, the assistant calls them with <tool_call>{"name": ..., "arguments": ...}</tool_call>
# and their results come back as <tool_response> blocks in a user turn.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first and tools %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}"
    "{{- fn.arguments if fn.arguments is string else (fn.arguments | tojson) }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_COMMON_CONFIG = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False,
    "use_cache": True,
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": ENDOFTEXT_ID,
    "pad_token_id": ENDOFTEXT_ID,
    "dtype": "float32",
}

# "num_experts" is the hub spelling; transformers 5 maps it onto num_local_experts
# (and writes "num_local_experts" itself when it saves a config). Layer 0 is dense.
_MOE_CONFIG = {"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 64,
               "decoder_sparse_step": 1, "mlp_only_layers": [0]}

TINY_HF_CONFIG: dict = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    **_COMMON_CONFIG,
    "attention_bias": False,
    **_MOE_CONFIG,
    "norm_topk_prob": True,
}

_VARIANT_EXTRAS: dict[str, dict] = {
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False},
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
              "mlp_bias": False},
    "qwen2_moe": {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "qkv_bias": True,
                  **_MOE_CONFIG, "shared_expert_intermediate_size": 128, "norm_topk_prob": False},
}

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen3", "qwen2_moe", "llama")


def tiny_variant_config(kind: str) -> dict:
    """HF config dict of a tiny variant sharing the tiny tokenizer and sizes.

    kind: "qwen3_moe" (== TINY_HF_CONFIG), "qwen3" (dense), "qwen2_moe"
    (shared expert, qkv bias) or "llama" (dense). Returns a fresh deep copy.
    """
    if kind == "qwen3_moe":
        return copy.deepcopy(TINY_HF_CONFIG)
    if kind not in _VARIANT_EXTRAS:
        raise ValueError(f"unknown tiny variant {kind!r}; expected one of {SUPPORTED_MODEL_TYPES}")
    extras = _VARIANT_EXTRAS[kind]
    return copy.deepcopy({"architectures": extras["architectures"], "model_type": kind,
                          **_COMMON_CONFIG, **extras})


# ---------------------------------------------------------------- tokenizer


def train_tokenizer():
    """Train the deterministic byte-level BPE tokenizer (a ``tokenizers.Tokenizer``)."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, special_tokens=[], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([topics[k] for k in sorted(topics)], trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    if tok.get_vocab_size() != VOCAB_SIZE or ids != [ENDOFTEXT_ID, IM_START_ID, IM_END_ID]:
        raise RuntimeError(f"tokenizer training gave vocab {tok.get_vocab_size()} and special ids {ids}")
    return tok


def write_tokenizer(folder: str | os.PathLike) -> Path:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json.

    eos/pad is <|endoftext|>; generation stops on <|endoftext|> or <|im_end|>.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    train_tokenizer().save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
        "bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "add_bos_token": False, "add_prefix_space": False, "clean_up_tokenization_spaces": False,
        "model_max_length": _COMMON_CONFIG["max_position_embeddings"],
    }
    generation_config = {"bos_token_id": ENDOFTEXT_ID, "eos_token_id": [ENDOFTEXT_ID, IM_END_ID],
                         "pad_token_id": ENDOFTEXT_ID}
    _write_json(folder / "tokenizer_config.json", tokenizer_config)
    _write_json(folder / "generation_config.json", generation_config)
    return folder


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------- weights


def is_moe_layer(hf_config: dict, layer: int) -> bool:
    """True iff decoder layer ``layer`` has a sparse MoE block (transformers' rule)."""
    num_experts = hf_config.get("num_experts", hf_config.get("num_local_experts", 0)) or 0
    step = hf_config.get("decoder_sparse_step", 1) or 1
    return (layer not in (hf_config.get("mlp_only_layers") or [])
            and num_experts > 0 and (layer + 1) % step == 0)


def checkpoint_shapes(hf_config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor name -> shape the transformers class for ``hf_config`` expects.

    Names follow the Hugging Face hub layout (per-expert MoE keys).
    """
    kind = hf_config.get("model_type")
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {kind!r} unsupported; expected one of {SUPPORTED_MODEL_TYPES}")
    if hf_config.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")
    hidden, vocab = hf_config["hidden_size"], hf_config["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    if not hf_config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hidden)
    for layer in range(hf_config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
        shapes.update(_attention_shapes(hf_config, f"{prefix}.self_attn"))
        shapes.update(_mlp_shapes(hf_config, f"{prefix}.mlp", is_moe_layer(hf_config, layer)))
    return shapes


def _attention_shapes(cfg: dict, prefix: str) -> dict[str, tuple[int, ...]]:
    hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    out = {
        f"{prefix}.q_proj.weight": (heads * head_dim, hidden),
        f"{prefix}.k_proj.weight": (kv_heads * head_dim, hidden),
        f"{prefix}.v_proj.weight": (kv_heads * head_dim, hidden),
        f"{prefix}.o_proj.weight": (hidden, heads * head_dim),
    }
    if cfg["model_type"] == "qwen2_moe":
        biased = ("q_proj", "k_proj", "v_proj") if cfg.get("qkv_bias", True) else ()
    else:
        biased = ("q_proj", "k_proj", "v_proj", "o_proj") if cfg.get("attention_bias", False) else ()
    for proj in biased:
        out[f"{prefix}.{proj}.bias"] = (out[f"{prefix}.{proj}.weight"][0],)
    if cfg["model_type"] in ("qwen3", "qwen3_moe"):
        out[f"{prefix}.q_norm.weight"] = (head_dim,)
        out[f"{prefix}.k_norm.weight"] = (head_dim,)
    return out


def _ffn_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.gate_proj.weight": (inter, hidden),
        f"{prefix}.up_proj.weight": (inter, hidden),
        f"{prefix}.down_proj.weight": (hidden, inter),
    }


def _mlp_shapes(cfg: dict, prefix: str, moe: bool) -> dict[str, tuple[int, ...]]:
    hidden = cfg["hidden_size"]
    if not moe:
        return _ffn_shapes(prefix, hidden, cfg["intermediate_size"])
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    out = {f"{prefix}.gate.weight": (num_experts, hidden)}
    for e in range(num_experts):
        out.update(_ffn_shapes(f"{prefix}.experts.{e}", hidden, cfg["moe_intermediate_size"]))
    if cfg["model_type"] == "qwen2_moe":
        out.update(_ffn_shapes(f"{prefix}.shared_expert", hidden, cfg["shared_expert_intermediate_size"]))
        out[f"{prefix}.shared_expert_gate.weight"] = (1, hidden)
    return out


def _draw(name: str, shape: tuple[int, ...], gen: torch.Generator, lm_head_scale: float) -> torch.Tensor:
    return scale_noise(name, torch.randn(shape, generator=gen, dtype=torch.float32), lm_head_scale)


def scale_noise(name: str, noise: torch.Tensor, lm_head_scale: float = 4.0) -> torch.Tensor:
    """Checkpoint tensor `name` from standard normal `noise` of its shape, scaled so
    activations stay O(1) through the network."""
    shape = noise.shape
    if name.endswith("norm.weight"):
        return 1.0 + 0.05 * noise
    if name.endswith(".bias"):
        return 0.1 * noise
    if name == "model.embed_tokens.weight":
        return noise
    fan_in = shape[-1]
    if name == "lm_head.weight":
        return noise * (lm_head_scale / math.sqrt(fan_in))
    if name.endswith("mlp.gate.weight"):
        # router: logits with std ~3 so the top-k choice is rarely a near tie
        return noise * (3.0 / math.sqrt(fan_in))
    return noise / math.sqrt(fan_in)


def write_random_checkpoint(
    folder: str | os.PathLike, hf_config: dict, seed: int, lm_head_scale: float = 4.0
) -> Path:
    """Write config.json and model.safetensors with random float32 weights.

    Deterministic: one ``torch.Generator().manual_seed(seed)`` draws every
    tensor of ``checkpoint_shapes(hf_config)`` in sorted key order.
    ``lm_head_scale`` multiplies the lm_head init (std lm_head_scale/sqrt(H)) so
    greedy logits have clear top1-top2 margins. Returns the folder.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shapes = checkpoint_shapes(hf_config)
    from tqdm.auto import tqdm

    names = tqdm(sorted(shapes), desc="Building the tiny model", unit="tensor", disable=None,
                 leave=False)
    tensors = {name: _draw(name, shapes[name], gen, lm_head_scale) for name in names}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _write_json(folder / "config.json", hf_config)
    return folder


def build_variant(folder: str | os.PathLike, kind: str, seed: int = 0) -> Path:
    """Write tokenizer + config + weights of tiny variant ``kind`` into ``folder``."""
    config = tiny_variant_config(kind)
    write_tokenizer(folder)
    return write_random_checkpoint(folder, config, seed)


def build_tiny_model(folder: str | os.PathLike, seed: int = 0) -> Path:
    """Write the tiny Qwen3-MoE (TINY_HF_CONFIG) into ``folder``."""
    return build_variant(folder, "qwen3_moe", seed)


def default_model_dir() -> Path:
    """The cached tiny model folder ``<PHALANX_CACHE_DIR>/tiny-qwen3-moe-v2``.

    Built on first use into a temporary sibling folder then renamed into place,
    so concurrent processes never observe a half-written model folder.
    """
    target = envs().cache_dir / TINY_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{TINY_MODEL_NAME}.", dir=target.parent))
    try:
        build_tiny_model(tmp, seed=0)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise  # not lost to a concurrent builder: a real failure
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
