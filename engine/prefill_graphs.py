"""CUDA graphs for small prefill and mixed steps: one graph per token bucket.

An eager forward costs the host ~0.6 ms a layer (Python and ~15 launches; 31 ms for 48
layers of the Qwen3-30B-A3B shape on an H200), more than the device needs for a step of a
few hundred tokens, so a prefix hit's tail, a short prompt or a decode batch with a small
prefill chunk would wait on the host. A step of T <= `max_tokens` tokens over S <=
`max_rows` sequences (prefill chunks, decode rows or both; not decode-only, which
`DecodeGraphs` covers) replays the graph of the smallest bucket B >= T instead.

Static buffers hold the inputs. Padding, so that it never touches the real rows:
tokens [T, B) are token 0 at position 0 with slot -1 (no KV write) and belong to no
sequence (their attention rows stay 0). A bucket of B tokens has R = min(B, max_rows)
rows (a step has no more sequences than tokens): rows [S, R) have an empty query
(`query_start_loc` stays at T), so their attention programs return at once; logits are
gathered for R rows through `logits_indices`, rows past the step's gather row 0 and are
dropped. Attention runs with `max_query_len` = B: its grid covers every row, and
its KV tile depends on head_dim alone, so each row reduces the same tiles in the same
order as the eager path (kernels/gpu/prefill_attention.py).
"""

from __future__ import annotations

import bisect

import torch

from ..kernels.attention import AttentionMetadata
from ..models.qwen3_moe import CausalLM, KVCache

MIN_BUCKET = 16


def prefill_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, ... (powers of two) up to `max_tokens`, which is always the last
    (none below 16: a bucket of one token would take the decode-only attention)."""
    if max_tokens < MIN_BUCKET:
        return []
    sizes = []
    b = MIN_BUCKET
    while b < max_tokens:
        sizes.append(b)
        b *= 2
    return sizes + [max_tokens]


class PrefillGraphs:
    """Captured forwards (logits of each bucket's gathered rows) of steps up to
    `max_tokens` tokens and `max_rows` sequences; `fits` says whether a step can replay one."""

    def __init__(self, model: CausalLM, caches: list[KVCache], max_tokens: int,
                 max_rows: int, max_model_len: int, page_size: int,
                 device: torch.device) -> None:
        if max_tokens < MIN_BUCKET or max_rows < 1:
            raise ValueError(f"max_tokens must be >= {MIN_BUCKET} and max_rows >= 1, got "
                             f"{max_tokens}, {max_rows}")
        self.model, self.caches = model, caches
        self.sizes = prefill_buckets(max_tokens)
        self.max_rows, self.max_model_len = max_rows, max_model_len
        max_pages = -(-max_model_len // page_size)
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(max_tokens, **i64)
        self.positions = torch.zeros(max_tokens, **i64)
        self.slot_mapping = torch.full((max_tokens,), -1, **i64)
        self.query_start_loc = torch.zeros(max_rows + 1, **i32)
        self.seq_lens = torch.ones(max_rows, **i32)
        self.block_tables = torch.zeros((max_rows, max_pages), **i32)
        self.logits_indices = torch.zeros(max_rows, **i64)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.replays = 0

    def rows(self, size: int) -> int:
        """Rows of bucket `size`: a step has at most one sequence per token."""
        return min(size, self.max_rows)

    def _forward(self, size: int) -> torch.Tensor:
        r = self.rows(size)
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[:r + 1], seq_lens=self.seq_lens[:r],
            block_tables=self.block_tables[:r], slot_mapping=self.slot_mapping[:size],
            max_query_len=size, max_seq_len=self.max_model_len)
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.caches, meta)
        return self.model.compute_logits(hidden[self.logits_indices[:r]])

    @torch.inference_mode()
    def capture(self) -> None:
        """Every bucket once outside capture (compiles its kernels: tile choices follow
        the token count), then captured, largest first, sharing one memory pool. The
        buffers hold padding only meanwhile: nothing is written to the KV cache."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._forward(size)
        torch.cuda.current_stream().wait_stream(stream)
        pool = None
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def fits(self, tokens: int, rows: int, logits: int) -> bool:
        if not self.graphs or not 0 < tokens <= self.sizes[-1]:
            return False
        r = self.rows(self.sizes[bisect.bisect_left(self.sizes, tokens)])
        return rows <= r and logits <= r

    def run(self, host: dict[str, torch.Tensor]) -> torch.Tensor:
        """Replay for a step given as (pinned) host tensors, as `ModelRunner.prepare`
        builds them; logits `[len(logits_indices), vocab]`."""
        t, s = host["input_ids"].shape[0], host["seq_lens"].shape[0]
        n, width = host["logits_indices"].shape[0], host["block_tables"].shape[1]
        if not self.fits(t, s, n):
            raise ValueError(f"a step of {t} tokens, {s} rows, {n} logits fits no bucket")
        size = self.sizes[bisect.bisect_left(self.sizes, t)]
        r = self.rows(size)
        self.input_ids[:t].copy_(host["input_ids"], non_blocking=True)
        self.positions[:t].copy_(host["positions"], non_blocking=True)
        self.slot_mapping[:t].copy_(host["slot_mapping"], non_blocking=True)
        self.slot_mapping[t:size].fill_(-1)
        self.query_start_loc[:s + 1].copy_(host["query_start_loc"], non_blocking=True)
        self.query_start_loc[s + 1:r + 1].fill_(t)
        self.seq_lens[:s].copy_(host["seq_lens"], non_blocking=True)
        self.block_tables[:s, :width].copy_(host["block_tables"], non_blocking=True)
        self.logits_indices[:n].copy_(host["logits_indices"], non_blocking=True)
        self.logits_indices[n:r].zero_()
        self.graphs[size].replay()
        self.replays += 1
        return self.logits[size][:n]
