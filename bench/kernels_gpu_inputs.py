"""Shapes and random inputs of `bench/kernels_gpu.py`: the Qwen3-30B-A3B decode shapes,
the check context (device, dtype, generator, NaN-poisoned allocator) and the paged KV
caches, attention metadata and MoE inputs the checks and timings build.

Imports nothing GPU-specific (nor phalanx) at module import time.
"""

from __future__ import annotations

HID, NQ, NKV, HD, NE, TOPK, INTER, PAGE = 2048, 32, 4, 128, 128, 8, 768, 16


class Ctx:
    def __init__(self, device: str, dtype, small: bool, seed: int = 0):
        import torch

        self.torch, self.dev, self.dtype, self.small = torch, device, dtype, small
        self.g = torch.Generator(device=device).manual_seed(seed)

    def randn(self, *shape, scale: float = 1.0):
        t = self.torch.randn(*shape, generator=self.g, device=self.dev, dtype=self.torch.float32)
        return (t * scale).to(self.dtype)

    def poison(self):
        """Fill freed allocator blocks with NaN so unwritten outputs read as NaN."""
        if self.dev == "cuda":  # the large pool, then the small pool (blocks <= 1 MiB)
            self.torch.empty(256 << 20, dtype=self.torch.uint8, device="cuda").fill_(0xFF)
            small = [self.torch.empty(1 << 20, dtype=self.torch.uint8, device="cuda") for _ in range(32)]
            for t in small:
                t.fill_(0xFF)


def paged(c: Ctx, lens, ps=PAGE, kvh=NKV, hd=HD, slack=4):
    """Caches + shuffled block tables for sequences of ``lens`` tokens (extra table columns)."""
    torch = c.torch
    per = max(-(-n // ps) for n in lens) + slack
    pages = len(lens) * per + 1
    kc, vc = c.randn(pages, kvh, ps, hd), c.randn(pages, kvh, ps, hd)
    perm = torch.randperm(pages, generator=c.g, device=c.dev)[: len(lens) * per]
    return kc, vc, perm.view(len(lens), per).int()


def meta_for(c: Ctx, specs, tables):
    """AttentionMetadata for (new tokens, cached prefix) per sequence."""
    from phalanx.kernels.attention import AttentionMetadata

    torch = c.torch
    starts = [0]
    for n, _ in specs:
        starts.append(starts[-1] + n)
    lens = [n + p for n, p in specs]
    i32 = dict(dtype=torch.int32, device=c.dev)
    return AttentionMetadata(torch.tensor(starts, **i32), torch.tensor(lens, **i32), tables,
                             torch.full((starts[-1],), -1, dtype=torch.int64, device=c.dev),
                             max(n for n, _ in specs), max(lens))


def moe_inputs(c: Ctx, T, ne=NE, hid=HID, inter=INTER, topk=TOPK):
    from phalanx.kernels.moe import route

    x = c.randn(T, hid)
    w, ids = route(c.randn(T, ne).float(), topk, True, c.dtype)
    return x, w, ids, c.randn(ne, 2 * inter, hid, scale=hid**-0.5), c.randn(ne, hid, inter, scale=inter**-0.5)
