"""One side's paged KV cache layout: which TP rank holds which KV heads, and page sizes.

Pages are HND: a page of the K (or V) pool of one layer is `[kv_heads_local, page_size,
head_dim]` — heads leading, then tokens, then the head dimension. A run of local heads of
one page is therefore a single contiguous slab, and so is a run of tokens of one head.

KV heads are assigned to TP ranks exactly as `models.shard.ModelShard.kv_heads` does:
- `tp <= num_kv_heads`: rank r holds the contiguous range `[r*H/tp, (r+1)*H/tp)`;
- `tp > num_kv_heads`: rank r holds the single head `r // (tp/H)`, so `tp/H` consecutive
  ranks hold copies (replicas) of the same head.

Pure logic: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVLayout:
    """KV cache layout of one prefill instance, or of one decode DP rank.

    tp: TP degree (of the prefill instance, or inside the decode DP rank).
    num_kv_heads: the model's total number of KV heads.
    page_size: tokens per page.  head_dim: elements per head per token.
    num_layers: attention layers.  dtype_bytes: itemsize of one element.
    """

    tp: int
    num_kv_heads: int
    page_size: int
    head_dim: int
    num_layers: int
    dtype_bytes: int

    def __post_init__(self) -> None:
        for name in ("tp", "num_kv_heads", "page_size", "head_dim", "num_layers", "dtype_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_kv_heads % self.tp and self.tp % self.num_kv_heads:
            raise ValueError(f"tp={self.tp} and num_kv_heads={self.num_kv_heads}: "
                             "one must divide the other")

    @property
    def replicas(self) -> int:
        """How many TP ranks hold each head (1 unless tp > num_kv_heads)."""
        return max(1, self.tp // self.num_kv_heads)

    def _check_rank(self, tp_rank: int) -> None:
        if not 0 <= tp_rank < self.tp:
            raise ValueError(f"tp_rank {tp_rank} outside [0, {self.tp})")

    def _check_head(self, head: int) -> None:
        if not 0 <= head < self.num_kv_heads:
            raise ValueError(f"head {head} outside [0, {self.num_kv_heads})")

    def heads_of(self, tp_rank: int) -> range:
        """Global KV heads held by `tp_rank`, in local order (local index i -> range[i])."""
        self._check_rank(tp_rank)
        kvh = self.num_kv_heads
        if self.tp <= kvh:
            n = kvh // self.tp
            return range(tp_rank * n, (tp_rank + 1) * n)
        head = tp_rank // (self.tp // kvh)
        return range(head, head + 1)

    def holders(self, head: int) -> list[int]:
        """TP ranks holding global `head`, ascending (several when heads are replicated)."""
        self._check_head(head)
        if self.tp <= self.num_kv_heads:
            return [head // (self.num_kv_heads // self.tp)]
        k = self.tp // self.num_kv_heads
        return list(range(head * k, (head + 1) * k))

    def local_head_index(self, tp_rank: int, head: int) -> int:
        """Index of global `head` within `tp_rank`'s pages; ValueError if not held there."""
        heads = self.heads_of(tp_rank)
        self._check_head(head)
        if head not in heads:
            raise ValueError(f"tp_rank {tp_rank} does not hold head {head} (holds {heads})")
        return head - heads.start

    def page_bytes(self, heads: int) -> int:
        """Bytes of one page of K (or of V) for `heads` heads of one layer."""
        return heads * self.page_size * self.head_dim * self.dtype_bytes

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)
