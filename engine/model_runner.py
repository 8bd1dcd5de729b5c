"""Runs one scheduled batch through the model over the paged KV cache.

KV layout: per layer one K pool and one V pool, `[num_pages, kv_heads, page_size,
head_dim]` (HND per page), so a head range of a page is one contiguous slab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import CacheConfig
from ..kernels.attention import AttentionMetadata
from ..models.qwen3_moe import CausalLM, KVCache
from .cuda_graphs import DecodeGraphs
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


CPU_DEFAULT_PAGES = 1024
ACTIVATION_RESERVE = 4 << 30  # bytes kept free for activations and CUDA graph pools


def num_pages_for_memory(model: CausalLM, cache: CacheConfig, dtype: torch.dtype,
                         device: torch.device) -> int:
    """Pages that fit in `gpu_memory_utilization` of the device once the weights are in."""
    if device.type != "cuda":
        return CPU_DEFAULT_PAGES
    free, total = torch.cuda.mem_get_info(device)
    budget = total * cache.gpu_memory_utilization - (total - free) - ACTIVATION_RESERVE
    per_page = sum(2 * l.attn.num_kv_heads * cache.page_size * l.attn.head_dim for l in model.layers)
    pages = int(budget // (per_page * dtype.itemsize))
    if pages <= 0:
        raise ValueError(f"gpu_memory_utilization: {cache.gpu_memory_utilization} leaves no room "
                         f"for the KV cache ({free / 2**30:.1f} GiB free of {total / 2**30:.1f})")
    return pages


@dataclass(slots=True)
class BatchInputs:
    """Flattened model inputs for a batch, plus which rows are sampled."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampled: list[Sequence]
    host: dict[str, torch.Tensor]  # the same inputs on the host (pinned on GPU machines)

    @property
    def decode_only(self) -> bool:
        """Every row is one token that gets sampled: the case CUDA graphs cover."""
        return self.meta.max_query_len == 1 and len(self.sampled) == self.input_ids.shape[0]


class ModelRunner:
    """Builds batch metadata, runs the model, samples the sequences that reached their end."""

    def __init__(self, model: CausalLM, caches: list[KVCache], page_size: int,
                 device: torch.device, max_model_len: int = 0, cuda_graph_max_batch: int = 0) -> None:
        self.model = model
        self.caches = caches
        self.page_size = page_size
        self.device = device
        self.pin = device.type == "cuda"
        self.graphs = None
        if device.type == "cuda" and cuda_graph_max_batch > 0:
            self.graphs = DecodeGraphs(model, caches, cuda_graph_max_batch, max_model_len,
                                       page_size, device)
            self.graphs.capture()

    def _host(self, values, dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(values, dtype=dtype)
        return t.pin_memory() if self.pin else t

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
        host = {
            "query_start_loc": self._host(starts, torch.int32),
            "seq_lens": self._host(seq_lens, torch.int32),
            "block_tables": tables.pin_memory() if self.pin else tables,
            "slot_mapping": self._host(slots, torch.int64),
            "input_ids": self._host(ids, torch.int64),
            "positions": self._host(positions, torch.int64),
            "logits_indices": self._host(logits_idx, torch.int64),
        }
        dev = {k: v.to(self.device, non_blocking=True) for k, v in host.items()}
        meta = AttentionMetadata(
            query_start_loc=dev["query_start_loc"], seq_lens=dev["seq_lens"],
            block_tables=dev["block_tables"], slot_mapping=dev["slot_mapping"],
            max_query_len=max(n for _, n in batch.items), max_seq_len=max(seq_lens))
        return BatchInputs(dev["input_ids"], dev["positions"], meta, dev["logits_indices"],
                           sampled, host)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> dict[str, int]:
        """Run the batch; return the sampled token of each sequence that reached its end."""
        inputs = self.prepare(batch)
        if self.graphs is not None and inputs.decode_only and self.graphs.fits(len(inputs.sampled)):
            h = inputs.host
            logits = self.graphs.run(h["input_ids"], h["positions"], h["slot_mapping"],
                                     h["seq_lens"], h["block_tables"])
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.caches, inputs.meta)
            if not inputs.sampled:
                return {}
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
        tokens = sample(logits, [s.params for s in inputs.sampled],
                        [s.num_tokens for s in inputs.sampled])
        return {s.request_id: t for s, t in zip(inputs.sampled, tokens)}
