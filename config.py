"""Configuration: frozen, slotted dataclasses validated at construction.

Every config is built once, before anything starts, and never mutated. Unknown keys
are rejected by `from_dict`, so a typo in a deployment file fails loudly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "qwen3", "llama")


def _require(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {msg}")


def _from_dict(cls, data: Mapping[str, Any]):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown keys {unknown}; known: {sorted(names)}")
    return cls(**data)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The architecture of a Qwen3-MoE-family model, read from a Hugging Face config.json.

    Dense models (Qwen3, Llama) are the case `num_experts == 0`; Qwen2-MoE adds a gated
    shared expert (`shared_expert_intermediate_size > 0`) and q/k/v biases.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"

    def __post_init__(self) -> None:
        _require(self.model_type in SUPPORTED_MODEL_TYPES, "model_type",
                 f"{self.model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            _require(getattr(self, name) > 0, name, "must be positive")
        _require(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                 "must divide num_attention_heads")
        if self.num_experts:
            _require(0 < self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
                     "must be in [1, num_experts]")
            _require(self.moe_intermediate_size > 0, "moe_intermediate_size", "must be positive")
            _require(self.decoder_sparse_step >= 1, "decoder_sparse_step", "must be >= 1")
        _require(self.dtype in ("float32", "bfloat16", "float16"), "dtype",
                 f"{self.dtype!r} is not one of float32, bfloat16, float16")

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def is_moe_layer(self, layer: int) -> bool:
        """HF rule: MoE unless listed in mlp_only_layers or off the sparse step."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "ModelConfig":
        """Read the fields phalanx uses from a Hugging Face config.json dict.

        Features phalanx does not implement (rope scaling, sliding windows) are refused
        rather than silently ignored, since they would change the tokens.
        """
        model_type = hf.get("model_type", "")
        _require(model_type in SUPPORTED_MODEL_TYPES, "model_type",
                 f"{model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        _require(rope_type == "default", "rope_parameters",
                 f"rope_type {rope_type!r} is not supported (only 'default')")
        _require(not hf.get("use_sliding_window", False), "use_sliding_window",
                 "sliding-window attention is not supported")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        heads = hf["num_attention_heads"]
        num_experts = hf.get("num_experts", hf.get("num_local_experts", 0)) or 0
        if model_type in ("qwen3", "llama"):
            num_experts = 0
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            intermediate_size=hf.get("intermediate_size", 0),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", hf.get("qkv_bias", model_type == "qwen2_moe"))),
            qk_norm=model_type in ("qwen3_moe", "qwen3"),
            num_experts=num_experts,
            num_experts_per_tok=hf.get("num_experts_per_tok", 0) if num_experts else 0,
            moe_intermediate_size=hf.get("moe_intermediate_size", 0) if num_experts else 0,
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=hf.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(hf.get("mlp_only_layers", ()) or ()),
            shared_expert_intermediate_size=(hf.get("shared_expert_intermediate_size", 0) or 0)
            if model_type == "qwen2_moe" else 0,
            eos_token_ids=eos_ids,
            dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
        )


KV_IN_PLACE_MIN_BYTES = 256 << 10  # one message costs more than the copy a smaller span saves


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache: `num_pages` pages of `page_size` tokens per layer (K and V each).

    `num_pages == 0` sizes the pool at start: on a GPU, from the memory left free after
    the weights (`gpu_memory_utilization` of the device's total); on CPU, 1024 pages.
    """

    page_size: int = 16
    num_pages: int = 0
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    # KV transport (disaggregated layout): a span of the receiver's pages at least this
    # large moves in place, pool to pool; smaller pieces go through staging buffers
    kv_in_place_min_bytes: int = KV_IN_PLACE_MIN_BYTES
    # device memory kept out of the KV pool for the KV transport's staging buffers; 0: the
    # disaggregated layout reserves each role's worst case (kv_transfer.transport.staging_memory)
    kv_staging_bytes: int = 0

    def __post_init__(self) -> None:
        _require(self.page_size > 0, "page_size", f"must be positive, got {self.page_size}")
        _require(isinstance(self.kv_staging_bytes, int) and self.kv_staging_bytes >= 0,
                 "kv_staging_bytes", f"must be an integer >= 0, got {self.kv_staging_bytes!r}")
        _require(isinstance(self.kv_in_place_min_bytes, int) and self.kv_in_place_min_bytes > 0,
                 "kv_in_place_min_bytes", f"must be a positive integer, got "
                 f"{self.kv_in_place_min_bytes!r}")
        _require(self.num_pages >= 0, "num_pages", f"must be >= 0 (0: auto), got {self.num_pages}")
        _require(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
                 f"must be in (0, 1], got {self.gpu_memory_utilization}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CacheConfig":
        return _from_dict(cls, data)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Token-budget scheduling: each step runs at most `max_num_batched_tokens` tokens
    from at most `max_num_seqs` requests; a prompt longer than the budget is chunked."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0  # 0: the model's max_position_embeddings

    def __post_init__(self) -> None:
        _require(self.max_num_seqs > 0, "max_num_seqs", f"must be positive, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens > 0, "max_num_batched_tokens",
                 f"must be positive, got {self.max_num_batched_tokens}")
        _require(self.max_model_len >= 0, "max_model_len", f"must be >= 0, got {self.max_model_len}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SchedulerConfig":
        return _from_dict(cls, data)


@dataclass(frozen=True, slots=True)
class EPWidthConfig:
    """How the EP width (ranks per DP×EP group) is chosen while serving (policies/ep_width.py).

    `policy`: a registered "ep_width" policy ("fixed": the `groups` given, "widest",
    "cost_model"); `groups`: DP×EP groups at start (the colocated or decode DP ranks split
    evenly; checked where the layout is built, `actors/dp_groups.py`);
    `costs`: a cost-table file (bench/ep_width.py writes one; "" with cost_model: measured
    on the ranks at start); `interval_s`: how often the policy is asked;
    `itl_target_ms`, `margin`, `min_interval_s`: cost_model's ITL target, hysteresis and
    minimum time between changes."""

    policy: str = "fixed"
    groups: int = 1
    costs: str = ""
    interval_s: float = 2.0
    itl_target_ms: float = 50.0
    margin: float = 0.15
    min_interval_s: float = 30.0

    def __post_init__(self) -> None:
        _require(isinstance(self.policy, str) and bool(self.policy), "ep_width.policy",
                 f"must be a policy name, got {self.policy!r}")
        _require(isinstance(self.groups, int) and self.groups >= 1, "ep_width.groups",
                 f"must be an integer >= 1, got {self.groups!r}")
        for name in ("interval_s", "itl_target_ms"):
            _require(getattr(self, name) > 0, f"ep_width.{name}",
                     f"must be positive, got {getattr(self, name)}")
        for name in ("margin", "min_interval_s"):
            _require(getattr(self, name) >= 0, f"ep_width.{name}",
                     f"must be >= 0, got {getattr(self, name)}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "EPWidthConfig":
        return _from_dict(cls, data)


@dataclass(frozen=True, slots=True)
class MicrobatchConfig:
    """Whether a DP×EP step runs as two overlapped micro-batches (policies/microbatch.py).

    `policy`: a registered "microbatch" policy ("off", "on", "threshold", "adaptive");
    `min_tokens`: threshold's tokens per rank from which it splits; `samples`, `probe`:
    adaptive's steps measured per choice and bucket, and the share of steps it re-probes;
    `window`: adaptive's recent steps a choice's mean is taken over."""

    policy: str = "adaptive"
    min_tokens: int = 32
    samples: int = 4
    probe: float = 0.02
    window: int = 32

    def __post_init__(self) -> None:
        _require(isinstance(self.policy, str) and bool(self.policy), "microbatch.policy",
                 f"must be a policy name, got {self.policy!r}")
        _require(isinstance(self.min_tokens, int) and self.min_tokens >= 2,
                 "microbatch.min_tokens", f"must be an integer >= 2, got {self.min_tokens!r}")
        _require(isinstance(self.samples, int) and self.samples >= 1, "microbatch.samples",
                 f"must be an integer >= 1, got {self.samples!r}")
        _require(isinstance(self.probe, (int, float)) and 0 <= self.probe < 1,
                 "microbatch.probe", f"must be in [0, 1), got {self.probe!r}")
        _require(isinstance(self.window, int) and self.window >= self.samples,
                 "microbatch.window", f"must be an integer >= samples, got {self.window!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "MicrobatchConfig":
        return _from_dict(cls, data)

    def policy_config(self) -> Optional[dict]:
        """The chosen policy's own settings (None: it has none)."""
        if self.policy == "threshold":
            return {"min_tokens": self.min_tokens}
        if self.policy == "adaptive":
            return {"samples": self.samples, "probe": self.probe, "window": self.window}
        return None


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Parallel layout of one serving group. `tp = dp = 1` is the single-rank engine."""

    tp: int = 1
    dp: int = 1
    collective_timeout_s: float = 30.0  # every collective and rendezvous ends within this
    # Restart intensity (ARCHITECTURE §5): at most max_recoveries re-formations within
    # any recovery_window_s seconds; one more fails the layout (0: a death is final).
    max_recoveries: int = 5
    recovery_window_s: float = 600.0
    # A dead rank whose placement finds no room within this (its node left, no free
    # CPU/GPU) is not waited for: the group re-forms one DP rank narrower, and back to
    # `dp` once there is room again.
    replace_timeout_s: float = 30.0
    # MoE all-to-all over a DP×EP world (`comm.dispatch`): "exact" (uneven splits; the
    # host reads the counts every layer) or "padded" (equal splits sized by the step's
    # agreed token count, padding rows skipped by the experts; no counts exchange, no
    # host read of them), or "peer" (the padded rows stored straight into the peers'
    # symmetric memory, NVSHMEM on GPU and /dev/shm on CPU, and waited for in device code,
    # each step bounded by the collective deadline; steps of more than max_num_seqs
    # tokens per rank take the padded path). Same tokens every way.
    ep_exchange: str = "exact"
    ep_width: EPWidthConfig = field(default_factory=EPWidthConfig)
    microbatch: MicrobatchConfig = field(default_factory=MicrobatchConfig)

    def __post_init__(self) -> None:
        _require(self.tp >= 1, "tp", f"must be >= 1, got {self.tp}")
        _require(isinstance(self.max_recoveries, int) and self.max_recoveries >= 0,
                 "max_recoveries", f"must be an integer >= 0, got {self.max_recoveries!r}")
        _require(self.dp >= 1, "dp", f"must be >= 1, got {self.dp}")
        _require(self.recovery_window_s > 0, "recovery_window_s",
                 f"must be positive, got {self.recovery_window_s}")
        _require(self.replace_timeout_s > 0, "replace_timeout_s",
                 f"must be positive, got {self.replace_timeout_s}")
        _require(self.collective_timeout_s > 0, "collective_timeout_s",
                 f"must be positive, got {self.collective_timeout_s}")
        _require(self.ep_exchange in ("exact", "padded", "peer"), "ep_exchange",
                 f"{self.ep_exchange!r} is not 'exact', 'padded' or 'peer'")

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ParallelConfig":
        data = dict(data)
        if isinstance(data.get("ep_width"), Mapping):
            data["ep_width"] = EPWidthConfig.from_dict(data["ep_width"])
        if isinstance(data.get("microbatch"), Mapping):
            data["microbatch"] = MicrobatchConfig.from_dict(data["microbatch"])
        return _from_dict(cls, data)


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """The disaggregated layout (ARCHITECTURE §2-§4): `prefill_instances` TP groups of
    `prefill_tp` ranks stream KV to one decode group of `decode_dp` DP ranks, each
    `decode_tp` wide. Page sizes may differ between the two sides."""

    prefill_tp: int = 1
    prefill_instances: int = 1
    decode_dp: int = 1
    decode_tp: int = 1
    prefill_page_size: int = 0  # 0: the decode side's page size
    transfer_timeout_s: float = 30.0  # every KV batch is acked within this

    def __post_init__(self) -> None:
        for name in ("prefill_tp", "prefill_instances", "decode_dp", "decode_tp"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                     name, f"must be an integer >= 1, got {value!r}")
        _require(isinstance(self.prefill_page_size, int) and self.prefill_page_size >= 0,
                 "prefill_page_size", f"must be 0 (same as decode) or positive, got "
                 f"{self.prefill_page_size!r}")
        _require(self.transfer_timeout_s > 0, "transfer_timeout_s",
                 f"must be positive, got {self.transfer_timeout_s}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DisaggConfig":
        return _from_dict(cls, data)


LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything one rank's engine needs; `model` comes from the checkpoint folder."""

    model_path: str
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: str = "cpu"
    dtype: str = "auto"  # "auto": the checkpoint's dtype
    seed: int = 0
    enforce_eager: bool = False  # True: no CUDA graphs on GPU
    cuda_graph_max_batch: int = 128
    # Prefill and mixed steps of up to this many tokens (over up to max_num_seqs rows)
    # replay CUDA graphs too (engine/prefill_graphs.py; one GPU rank alone; 0: eager).
    cuda_graph_max_prefill: int = 512
    # Launch the next decode step before returning the current step's tokens, so the
    # host's bookkeeping runs while the device computes (same tokens either way).
    overlap_steps: bool = True
    # Serve synthetic requests before ready so no kernel compiles afterwards (GPU, one
    # rank alone; engine/warmup.py).
    warmup: bool = True
    # "fp8": quantize a bf16/float32 checkpoint's projections to block-scaled FP8 on load
    # (kernels/fp8.py; an FP8 checkpoint loads as FP8 whatever this says). None: as stored.
    quantization: Optional[str] = None
    # "auto": the folder's safetensors; "dummy": seeded random weights of the folder's
    # config.json shapes, drawn on the device (models/random_weights.py; benchmarks).
    load_format: str = "auto"
    # Kernels whose row results do not depend on the batch (kernels/batch_invariant.py):
    # a seeded request's tokens equal alone, batched and after a re-prefill on a GPU too.
    batch_invariant: bool = False
    # Row-parallel sums cut in this many chunks at every TP width (models/row_parallel.py):
    # a row's bits are then the same at every TP width dividing it (a prefill TP group's
    # KV equals a TP1 decode rank's). 0: the layout's widest TP (actors/cluster_builder.py),
    # 1 for one engine alone; FP8 weights take 1.
    tp_invariant_width: int = 0

    def __post_init__(self) -> None:
        limit = self.model.max_position_embeddings
        _require(self.scheduler.max_model_len <= limit, "max_model_len",
                 f"{self.scheduler.max_model_len} exceeds the model's context of {limit}")
        _require(self.device in ("cpu", "cuda") or self.device.startswith("cuda:"), "device",
                 f"{self.device!r} is not 'cpu' or 'cuda[:N]'")
        _require(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
                 f"{self.dtype!r} is not one of auto, float32, bfloat16, float16")
        _require(self.cuda_graph_max_batch >= 0, "cuda_graph_max_batch", "must be >= 0")
        _require(self.cuda_graph_max_prefill == 0 or self.cuda_graph_max_prefill >= 16,
                 "cuda_graph_max_prefill", f"must be 0 or >= 16, got {self.cuda_graph_max_prefill}")
        _require(isinstance(self.overlap_steps, bool), "overlap_steps",
                 f"must be True or False, got {self.overlap_steps!r}")
        for name in ("warmup", "batch_invariant"):
            _require(isinstance(getattr(self, name), bool), name,
                     f"must be True or False, got {getattr(self, name)!r}")
        w = self.tp_invariant_width
        _require(isinstance(w, int) and w >= 0 and not w & (w - 1), "tp_invariant_width",
                 f"must be 0 or a power of two, got {w!r}")
        _require(self.quantization in (None, "fp8"), "quantization",
                 f"{self.quantization!r} is not None or 'fp8'")
        _require(self.load_format in LOAD_FORMATS, "load_format",
                 f"{self.load_format!r} is not one of {', '.join(LOAD_FORMATS)}")

    @property
    def torch_dtype_name(self) -> str:
        return self.model.dtype if self.dtype == "auto" else self.dtype

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len or self.model.max_position_embeddings
