"""The paged KV cache's memory: how many pages fit on the device and their allocation.

Layout: one allocation `[layers, 2 (K, V), pages, kv_heads, page_size, head_dim]`; each
layer's K and V pools are views of it (HND per page), so a head range of a page is one
contiguous slab and the KV transport moves several layers with one indexed copy.
"""

from __future__ import annotations

import torch

from ..config import CacheConfig
from ..models.qwen3_moe import CausalLM, KVCache

__all__ = ["ACTIVATION_RESERVE", "CPU_DEFAULT_PAGES", "allocate_kv_cache", "num_pages_for_memory",
           "pages_within", "torch_dtype"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def allocate_kv_cache(model: CausalLM, num_pages: int, page_size: int,
                      dtype: torch.dtype, device: torch.device) -> list[KVCache]:
    """Zeroed K and V pools for every layer of `model`'s shard: views of one allocation
    `[layers, 2 (K, V), pages, kv_heads, page_size, head_dim]`, so the KV transport
    moves a message spanning several layers with one indexed copy."""
    shapes = {(layer.attn.num_kv_heads, layer.attn.head_dim) for layer in model.layers}
    if len(shapes) != 1:
        raise ValueError(f"layers differ in (kv_heads, head_dim): {sorted(shapes)}")
    heads, head_dim = shapes.pop()
    buf = torch.zeros((len(model.layers), 2, num_pages, heads, page_size, head_dim),
                      dtype=dtype, device=device)
    return [(buf[i, 0], buf[i, 1]) for i in range(len(model.layers))]


CPU_DEFAULT_PAGES = 1024
ACTIVATION_RESERVE = 4 << 30  # bytes kept free for activations and CUDA graph pools


def num_pages_for_memory(model: CausalLM, cache: CacheConfig, dtype: torch.dtype,
                         device: torch.device) -> int:
    """Pages that fit in `gpu_memory_utilization` of the device once the weights are in,
    the activations' reserve and the KV transport's staging (`kv_staging_bytes`) kept out."""
    if device.type != "cuda":
        return CPU_DEFAULT_PAGES
    torch.cuda.empty_cache()  # blocks cached by the allocator count as free here
    free, total = torch.cuda.mem_get_info(device)
    per_page = sum(2 * l.attn.num_kv_heads * cache.page_size * l.attn.head_dim for l in model.layers)
    return pages_within(total * cache.gpu_memory_utilization - (total - free), cache,
                        per_page * dtype.itemsize, free, total)


def pages_within(budget: float, cache: CacheConfig, page_bytes: int, free: int, total: int) -> int:
    """KV pages in `budget` bytes (the device's share for this rank less what is in use)
    once the activations' reserve and the staging buffers are set aside."""
    pages = int((budget - ACTIVATION_RESERVE - cache.kv_staging_bytes) // page_bytes)
    if pages <= 0:
        staging = (f" and {cache.kv_staging_bytes / 2**30:.1f} GiB for KV staging"
                   if cache.kv_staging_bytes else "")
        raise ValueError(f"gpu_memory_utilization: {cache.gpu_memory_utilization} leaves no room "
                         f"for the KV cache ({free / 2**30:.1f} GiB free of {total / 2**30:.1f}, "
                         f"{ACTIVATION_RESERVE / 2**30:.0f} GiB kept for activations{staging})")
    return pages
