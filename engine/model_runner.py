"""Runs one scheduled batch through the model over the paged KV cache.

KV layout: per layer one K pool and one V pool, `[num_pages, kv_heads, page_size,
head_dim]` (HND per page), so a head range of a page is one contiguous slab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.attention import AttentionMetadata
from ..models.qwen3_moe import CausalLM, KVCache
from .sampler import sample
from .scheduler import ScheduledBatch
from .sequence import Sequence

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def allocate_kv_cache(model: CausalLM, num_pages: int, page_size: int,
                      dtype: torch.dtype, device: torch.device) -> list[KVCache]:
    """Zeroed K and V pools for every layer of `model`'s shard."""
    caches = []
    for layer in model.layers:
        shape = (num_pages, layer.attn.num_kv_heads, page_size, layer.attn.head_dim)
        caches.append((torch.zeros(shape, dtype=dtype, device=device),
                       torch.zeros(shape, dtype=dtype, device=device)))
    return caches


@dataclass(slots=True)
class BatchInputs:
    """Flattened model inputs for a batch, plus which rows are sampled."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampled: list[Sequence]


class ModelRunner:
    """Builds batch metadata, runs the model, samples the sequences that reached their end."""

    def __init__(self, model: CausalLM, caches: list[KVCache], page_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.caches = caches
        self.page_size = page_size
        self.device = device

    def prepare(self, batch: ScheduledBatch) -> BatchInputs:
        ps = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts, seq_lens, logits_idx, sampled = [0], [], [], []
        max_pages = max(len(seq.pages) for seq, _ in batch.items)
        tables = torch.zeros((len(batch.items), max_pages), dtype=torch.int32)
        for row, (seq, n) in enumerate(batch.items):
            begin, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids.extend(seq.token_slice(begin, end))
            positions.extend(range(begin, end))
            slots.extend(seq.pages[p // ps] * ps + p % ps for p in range(begin, end))
            starts.append(starts[-1] + n)
            seq_lens.append(end)
            tables[row, :len(seq.pages)] = torch.tensor(seq.pages, dtype=torch.int32)
            if end == seq.num_tokens:
                logits_idx.append(starts[-1] - 1)
                sampled.append(seq)
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(n for _, n in batch.items),
            max_seq_len=max(seq_lens),
        )
        return BatchInputs(torch.tensor(ids, dtype=torch.int64, device=dev),
                           torch.tensor(positions, dtype=torch.int64, device=dev), meta,
                           torch.tensor(logits_idx, dtype=torch.int64, device=dev), sampled)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> dict[str, int]:
        """Run the batch; return the sampled token of each sequence that reached its end."""
        inputs = self.prepare(batch)
        hidden = self.model(inputs.input_ids, inputs.positions, self.caches, inputs.meta)
        if not inputs.sampled:
            return {}
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        tokens = sample(logits, [s.params for s in inputs.sampled],
                        [s.num_tokens for s in inputs.sampled])
        return {s.request_id: t for s, t in zip(inputs.sampled, tokens)}
