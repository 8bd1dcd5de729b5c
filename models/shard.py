"""Which part of a model one rank holds: a range of heads, a set of experts.

Tensor parallelism of degree `tp_size` cuts query heads evenly; KV heads are cut evenly
when `tp_size <= num_kv_heads`, otherwise each rank holds one KV head and
`tp_size / num_kv_heads` ranks hold copies of it. Experts are listed by global id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..config import ModelConfig


@dataclass(frozen=True, slots=True)
class ModelShard:
    tp_rank: int = 0
    tp_size: int = 1
    experts: Optional[tuple[int, ...]] = None  # None: every expert

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside [0, {self.tp_size})")
        if self.experts is not None and len(set(self.experts)) != len(self.experts):
            raise ValueError(f"experts lists an id twice: {self.experts}")

    def validate(self, cfg: ModelConfig) -> None:
        tp, kvh = self.tp_size, cfg.num_key_value_heads
        if cfg.num_attention_heads % tp:
            raise ValueError(f"tp={tp} does not divide num_attention_heads={cfg.num_attention_heads}")
        if kvh % tp and tp % kvh:
            raise ValueError(f"tp={tp} and num_key_value_heads={kvh}: one must divide the other")
        for name, size in (("intermediate_size", cfg.intermediate_size),
                           ("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size)):
            if size % tp:
                raise ValueError(f"tp={tp} does not divide {name}={size}")
        if cfg.vocab_size % tp:
            raise ValueError(f"tp={tp} does not divide vocab_size={cfg.vocab_size}")
        if self.experts is not None and any(not 0 <= e < cfg.num_experts for e in self.experts):
            raise ValueError(f"expert ids must lie in [0, {cfg.num_experts}): {self.experts}")

    def q_heads(self, cfg: ModelConfig) -> range:
        n = cfg.num_attention_heads // self.tp_size
        return range(self.tp_rank * n, (self.tp_rank + 1) * n)

    def kv_heads(self, cfg: ModelConfig) -> range:
        kvh = cfg.num_key_value_heads
        if self.tp_size <= kvh:
            n = kvh // self.tp_size
            return range(self.tp_rank * n, (self.tp_rank + 1) * n)
        head = self.tp_rank // (self.tp_size // kvh)
        return range(head, head + 1)

    def cols(self, size: int) -> range:
        """This rank's part of a dimension cut evenly over the TP ranks."""
        n = size // self.tp_size
        return range(self.tp_rank * n, (self.tp_rank + 1) * n)

    def vocab(self, cfg: ModelConfig) -> range:
        """Rows of the embedding and LM head held here (vocab-parallel under TP)."""
        return self.cols(cfg.vocab_size)

    def local_experts(self, cfg: ModelConfig) -> tuple[int, ...]:
        return tuple(range(cfg.num_experts)) if self.experts is None else self.experts
