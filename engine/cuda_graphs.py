"""CUDA graphs for decode steps: one graph per padded batch size, replayed each step.

A decode-only batch of `b` sequences runs the graph captured for the smallest size
`g >= b`. Inputs live in static device buffers; rows `[b, g)` are padding: their token
is 0, their KV write is skipped (slot -1) and they attend to one token of page 0, so
their (discarded) output never depends on, or disturbs, the real rows.

With `lanes` (engine/lanes.py) every size from 2 also has a split graph: rows `[0, g//2)`
and `[g//2, g)` run as two micro-batches on the lanes' streams (forked from the capture
stream and joined back), each lane's MoE exchanges through its own channels with a
capacity of its own rows; same buffers, same rows, same logits as the whole graph.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable
from typing import ContextManager, Optional

import torch

from ..kernels.attention import AttentionMetadata
from ..models.qwen3_moe import CausalLM, KVCache
from .lanes import Lanes


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
                 max_model_len: int, page_size: int, device: torch.device,
                 lanes: Optional[Lanes] = None) -> None:
        self.model = model
        self.lanes = lanes
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
        # (size, split) -> graph and its logits; split graphs only with lanes, sizes >= 2
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, bool], torch.Tensor] = {}

    def _meta(self, lo: int, hi: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:hi - lo + 1], seq_lens=self.seq_lens[lo:hi],
            block_tables=self.block_tables[lo:hi], slot_mapping=self.slot_mapping[lo:hi],
            max_query_len=1, max_seq_len=self.max_model_len)

    def _rows(self, lo: int, hi: int, sized: Callable[[int], None]) -> torch.Tensor:
        sized(hi - lo)
        return self.model(self.input_ids[lo:hi], self.positions[lo:hi], self.caches,
                          self._meta(lo, hi))

    def _forward(self, size: int, split: bool, sized: Callable[[int], None]) -> torch.Tensor:
        if not split:
            hidden = self._rows(0, size, sized)
        else:
            half = size // 2
            hidden = torch.cat(self.lanes.run([lambda: self._rows(0, half, sized),
                                               lambda: self._rows(half, size, sized)]))
        return self.model.compute_logits(hidden)

    @property
    def split_sizes(self) -> list[int]:
        """The sizes that also run as two micro-batches (with lanes)."""
        return [s for s in self.sizes if s >= 2] if self.lanes is not None else []

    def can_split(self, size: int) -> bool:
        return (size, True) in self.graphs

    @torch.inference_mode()
    def capture(self, rehearsal: Callable[[], ContextManager] = contextlib.nullcontext,
                sized: Callable[[int], None] = lambda size: None) -> None:
        """Capture every size (whole, then split), largest first, sharing one memory pool.

        Every size runs first outside capture (the largest and the smallest twice),
        within `rehearsal()`: that compiles every kernel the graphs use (some paths and
        tiles depend on the batch size, e.g. the MoE small path at a few tokens, the FP8
        linear's split K at 17-128) and creates the buffers they keep across launches,
        which must not come from the graphs' shared pool (see kernels/gpu/arrivals.py;
        each lane has its own). A DP×EP group rehearses with
        stand-in exchanges, so capturing needs no peer. `sized(rows)` runs before each
        forward of that many rows (the group's exchange capacity per size or lane)."""
        kinds = [(size, False) for size in reversed(self.sizes)]
        kinds += [(size, True) for size in reversed(self.split_sizes)]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), rehearsal():
            for rep in range(2):
                for split in sorted({split for _, split in kinds}):
                    sizes = [size for size, s in kinds if s == split]
                    again = sorted({sizes[0], sizes[-1]}, reverse=True)
                    for size in sizes if rep == 0 else again:
                        self._forward(size, split, sized)
        torch.cuda.current_stream().wait_stream(stream)
        pool = None
        for key in kinds:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[key] = self._forward(*key, sized)
            pool = graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize()

    def fits(self, batch: int) -> bool:
        return bool(self.graphs) and batch <= self.sizes[-1]

    def size_for(self, batch: int) -> int:
        """The captured size a batch of `batch` rows replays (fits(batch) must hold)."""
        return self.sizes[bisect.bisect_left(self.sizes, batch)]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            seq_lens: torch.Tensor, block_tables: torch.Tensor,
            size: Optional[int] = None, split: bool = False) -> torch.Tensor:
        """Replay for a decode batch given as (pinned) host tensors; logits `[b, vocab]`.
        size: the captured size to replay (default the smallest that fits; a DP×EP
        group replays the size its ranks agreed on); split: its two-micro-batch graph."""
        b = input_ids.shape[0]
        size = self.size_for(b) if size is None else size
        if (size, split) not in self.graphs or size < b:
            raise ValueError(f"no captured size {size}{' split' if split else ''} "
                             f"for a batch of {b}")
        self.input_ids[:b].copy_(input_ids, non_blocking=True)
        self.positions[:b].copy_(positions, non_blocking=True)
        self.slot_mapping[:b].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:b].copy_(seq_lens, non_blocking=True)
        self.block_tables[:b, :block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        return self._replay(b, size, split)

    def run_idle(self, size: int, split: bool = False) -> None:
        """Replay `size` with padding rows only: an idle rank's part in a DP×EP group's
        step (its exchanges; the logits are thrown away)."""
        if (size, split) not in self.graphs:
            raise ValueError(f"no captured size {size}{' split' if split else ''}")
        self._replay(0, size, split)

    def _replay(self, b: int, size: int, split: bool) -> torch.Tensor:
        if size > b:
            self.input_ids[b:size].zero_()
            self.slot_mapping[b:size].fill_(-1)
            self.seq_lens[b:size].fill_(1)
            self.block_tables[b:size, 0].zero_()
        self.graphs[size, split].replay()
        return self.logits[size, split][:b]
