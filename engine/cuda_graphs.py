"""CUDA graphs for decode steps: one graph per padded batch size, replayed each step.

A decode-only batch of `b` sequences runs the graph captured for the smallest size
`g >= b`. Inputs live in static device buffers; rows `[b, g)` are padding: their token
is 0, their KV write is skipped (slot -1) and they attend to one token of page 0, so
their (discarded) output never depends on, or disturbs, the real rows.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable
from typing import ContextManager, Optional

import torch

from ..kernels.attention import AttentionMetadata
from ..models.qwen3_moe import CausalLM, KVCache


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to `max_batch`."""
    sizes = [s for s in (1, 2, 4) if s < max_batch]
    sizes += list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    """Captured decode forwards (logits included) over static input buffers."""

    def __init__(self, model: CausalLM, caches: list[KVCache], max_batch: int,
                 max_model_len: int, page_size: int, device: torch.device) -> None:
        self.model = model
        self.caches = caches
        self.max_model_len = max_model_len
        self.sizes = graph_batch_sizes(max_batch)
        max_pages = -(-max_model_len // page_size)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, max_pages), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size], slot_mapping=self.slot_mapping[:size],
            max_query_len=1, max_seq_len=self.max_model_len)

    def _forward(self, size: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.caches, self._meta(size))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self, rehearsal: Callable[[], ContextManager] = contextlib.nullcontext,
                sized: Callable[[int], None] = lambda size: None) -> None:
        """Capture every size, largest first, sharing one memory pool.

        The largest and the smallest size run first (twice) outside capture, within
        `rehearsal()`: that compiles every kernel the graphs use (some paths depend on
        the batch size, e.g. the MoE small path) and creates the buffers they keep
        across launches, which must not come from the graphs' shared pool (see
        kernels/gpu/arrivals.py). A DP×EP group rehearses with stand-in exchanges, so
        capturing needs no peer. `sized(size)` runs before each forward of `size` (the
        group's exchange capacity per size)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), rehearsal():
            for _ in range(2):
                for size in sorted({self.sizes[-1], self.sizes[0]}, reverse=True):
                    sized(size)
                    self._forward(size)
        torch.cuda.current_stream().wait_stream(stream)
        pool = None
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            sized(size)
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def fits(self, batch: int) -> bool:
        return bool(self.graphs) and batch <= self.sizes[-1]

    def size_for(self, batch: int) -> int:
        """The captured size a batch of `batch` rows replays (fits(batch) must hold)."""
        return self.sizes[bisect.bisect_left(self.sizes, batch)]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            seq_lens: torch.Tensor, block_tables: torch.Tensor,
            size: Optional[int] = None) -> torch.Tensor:
        """Replay for a decode batch given as (pinned) host tensors; logits `[b, vocab]`.
        size: the captured size to replay (default the smallest that fits; a DP×EP
        group replays the size its ranks agreed on)."""
        b = input_ids.shape[0]
        size = self.size_for(b) if size is None else size
        if size not in self.graphs or size < b:
            raise ValueError(f"no captured size {size} for a batch of {b}")
        self.input_ids[:b].copy_(input_ids, non_blocking=True)
        self.positions[:b].copy_(positions, non_blocking=True)
        self.slot_mapping[:b].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:b].copy_(seq_lens, non_blocking=True)
        self.block_tables[:b, :block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        return self._replay(b, size)

    def run_idle(self, size: int) -> None:
        """Replay `size` with padding rows only: an idle rank's part in a DP×EP group's
        step (its exchanges; the logits are thrown away)."""
        if size not in self.graphs:
            raise ValueError(f"no captured size {size}")
        self._replay(0, size)

    def _replay(self, b: int, size: int) -> torch.Tensor:
        if size > b:
            self.input_ids[b:size].zero_()
            self.slot_mapping[b:size].fill_(-1)
            self.seq_lens[b:size].fill_(1)
            self.block_tables[b:size, 0].zero_()
        self.graphs[size].replay()
        return self.logits[size][:b]
