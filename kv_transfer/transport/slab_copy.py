"""One-launch gather/scatter of KV slabs between the pools and a staging buffer (CUDA).

A template's slabs (runs of `granule` tokens of one head: contiguous in a pool and in the
payload) are described once per template on the device: `SlabIndex` holds, per slab,
its element offset inside one pool, its element offset inside the template's payload and
its length. A message's blocks (layer, kind, rows [r0, r1)) are slab ranges of that
index, so a message is one kernel launch over (block, slab) whatever layers, kinds and
granules it spans; the host sends only one 4-int64 row per block.

Layout contract: the pools are consecutive pieces of one allocation (K0, V0, K1, V1,
...), so pool (layer, kind) starts `(2 * layer + kind) * pool_numel` elements into it;
every offset and length is a multiple of head_dim (`ALIGN` hints the vector width).

Host cost per message (it is on the transport's per-message path, bench/NOTES.md v13):
the block rows are written into pinned host memory that the kernel reads in place (UVA:
pinned memory is device-accessible at its host address), and after a launch shape's
first launch through Triton's JIT, later ones go straight to its compiled kernel.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

from ...kernels.gpu.compiled_launch import CompiledLaunches

SLABS_PER_PROGRAM = 4
BLOCK = 1024  # most elements per load (2 KiB of a bf16 slab); the slab loop is unrolled
NUM_WARPS = 4


@triton.jit(do_not_specialize=["blocks_off"])
def _slab_copy_kernel(pool_ptr, pay_ptr, slab_pool_ptr, slab_pay_ptr, slab_len_ptr,
                      blocks_ptr, blocks_off, TO_PAYLOAD: tl.constexpr, SLABS: tl.constexpr,
                      BLOCK: tl.constexpr, MAX_LEN: tl.constexpr, ALIGN: tl.constexpr):
    b = tl.program_id(0)
    p = tl.program_id(1)
    row = blocks_ptr + blocks_off + b * 4
    s0 = tl.load(row)
    n = tl.load(row + 1)
    pool_base = tl.load(row + 2)
    pay_base = tl.load(row + 3)
    offs = tl.arange(0, BLOCK)
    for i in tl.static_range(SLABS):
        k = p * SLABS + i
        valid = k < n
        s = s0 + k
        src = tl.multiple_of(pool_base + tl.load(slab_pool_ptr + s, mask=valid, other=0), ALIGN)
        dst = tl.multiple_of(pay_base + tl.load(slab_pay_ptr + s, mask=valid, other=0), ALIGN)
        # every length is a multiple of ALIGN: said so the masked loads and stores stay
        # vectorised (a mask against an unknown bound is checked element by element)
        length = tl.multiple_of(tl.load(slab_len_ptr + s, mask=valid, other=0), ALIGN)
        for c in tl.static_range(0, MAX_LEN, BLOCK):
            mask = c + offs < length
            if TO_PAYLOAD:
                v = tl.load(pool_ptr + src + c + offs, mask=mask)
                tl.store(pay_ptr + dst + c + offs, v, mask=mask)
            else:
                v = tl.load(pay_ptr + dst + c + offs, mask=mask)
                tl.store(pool_ptr + src + c + offs, v, mask=mask)


class DescRing:
    """Pinned host memory (and device memory, for when the kernel cannot read the host
    memory) reused round robin for the block rows that each launch reads (CUDA). Use on
    one stream: rows are overwritten on the host only after a lap's launches have all
    run (waited for once per lap), and on the device only after the launches queued
    before them on that stream. Every slot starts 16-byte aligned."""

    def __init__(self, device: torch.device, capacity: int = 1 << 17) -> None:
        self.host = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        self._host_np = self.host.numpy()
        self.dev = torch.empty(capacity, dtype=torch.int64, device=device)
        self.pos = 0
        self.mapped = True  # kernels read the rows in host memory (until that fails once)

    def place(self, rows: np.ndarray) -> Optional[int]:
        """`rows` (int64) written into the host ring: their offset (elements), or None if
        they are larger than the ring."""
        n = rows.size
        if n > len(self._host_np):
            return None
        if self.pos + n > len(self._host_np):
            torch.cuda.current_stream(self.dev.device).synchronize()  # the lap's launches ran
            self.pos = 0
        a = self.pos
        self.pos += n + (n & 1)
        self._host_np[a:a + n] = rows.reshape(-1)
        return a

    def upload(self, rows: np.ndarray) -> torch.Tensor:
        """`rows` (int64) on the device, copied on the current stream."""
        a = self.place(rows)
        if a is None:  # larger than the ring: a pinned tensor of its own
            return torch.from_numpy(rows).pin_memory().to(self.dev.device, non_blocking=True)
        n = rows.size
        out = self.dev[a:a + n]
        out.copy_(self.host[a:a + n], non_blocking=True)
        return out.view(rows.shape)


# the slab kernel's launches after a shape's first go straight to its compiled kernel
_launches = CompiledLaunches(_slab_copy_kernel)


class SlabIndex:
    """A template's slabs on `device`: per slab its offset in one pool, its offset in
    the template's payload and its length (elements); per template row its first slab
    (host), to turn a block's rows into a slab range."""

    def __init__(self, runs: list[tuple[int, int, int, np.ndarray, np.ndarray]],
                 num_rows: int, head_dim: int, device: torch.device) -> None:
        """runs: (first row, stop row, granule, pool rows in `[-1, granule * head_dim]`
        units, per-row offsets into those pool rows), in template order."""
        pool_off, length = [], []
        row_slabs = np.zeros(num_rows, dtype=np.int64)
        for a, b, g, rows, off in runs:
            width = g * head_dim
            pool_off.append(rows.astype(np.int64) * width)
            length.append(np.full(len(rows), width, dtype=np.int64))
            row_slabs[a:b] = np.diff(off)
        self.row_first = np.concatenate(([0], np.cumsum(row_slabs)))
        pool_off = np.concatenate(pool_off) if pool_off else np.zeros(0, np.int64)
        length = np.concatenate(length) if length else np.zeros(0, np.int64)
        self.pay_cum = np.concatenate(([0], np.cumsum(length)))  # host: slab s is [s, s+1)
        self.head_dim = head_dim
        self.max_len = int(length.max()) if len(length) else 0
        self._dev = [torch.from_numpy(x).to(device)
                     for x in (pool_off, np.ascontiguousarray(self.pay_cum[:-1]), length)]

    def block_rows(self, blocks: np.ndarray, pool_numel: int) -> tuple[np.ndarray, int]:
        """Per block (first slab, slabs, pool base, payload base) in elements, the
        blocks' payloads laid end to end; and the most slabs in one block."""
        b = np.asarray(blocks, dtype=np.int64).reshape(-1, 4)
        s0, s1 = self.row_first[b[:, 2]], self.row_first[b[:, 3]]
        sizes = self.pay_cum[s1] - self.pay_cum[s0]
        starts = np.concatenate(([0], np.cumsum(sizes)))[:-1]
        out = np.stack([s0, s1 - s0, (2 * b[:, 0] + b[:, 1]) * pool_numel,
                        starts - self.pay_cum[s0]], axis=1)
        return np.ascontiguousarray(out), int((s1 - s0).max()) if len(b) else 0

    def copy(self, flat_pools: torch.Tensor, payload: torch.Tensor, blocks: np.ndarray,
             pool_numel: int, to_payload: bool, *, slabs: int = SLABS_PER_PROGRAM,
             block: int = BLOCK, num_warps: int = NUM_WARPS,
             ring: Optional[DescRing] = None) -> None:
        """Gather (`to_payload`) or scatter the blocks' slabs between `flat_pools` (the
        one allocation, 1-D) and `payload` (1-D, same dtype), queued on the current
        stream. slabs (per program), block (most elements per load), num_warps: the
        launch's shape (bench/probes/kv_copy_host.py --sweep). ring (CUDA): holds the block rows,
        which the kernel reads in place (or from the ring's device copy where it cannot);
        default a pinned tensor per call, copied to the device."""
        rows, most = self.block_rows(blocks, pool_numel)
        if most == 0:
            return
        block = min(block, triton.next_power_of_2(self.max_len))
        consts = (to_payload, slabs, block, triton.cdiv(self.max_len, block) * block,
                  16 if self.head_dim % 16 == 0 else 1)
        grid = (len(rows), triton.cdiv(most, slabs))
        if ring is not None and ring.mapped:
            off = ring.place(rows)
            if off is not None and self._launch_mapped(flat_pools, payload, ring, off, grid,
                                                       consts, num_warps):
                return
        desc = torch.from_numpy(rows)
        if ring is not None:
            desc = ring.upload(rows)
        elif flat_pools.device.type == "cuda":
            desc = desc.pin_memory().to(flat_pools.device, non_blocking=True)
        _slab_copy_kernel[grid](flat_pools, payload, *self._dev, desc, 0, *consts,
                                num_warps=num_warps)

    def _launch_mapped(self, flat_pools: torch.Tensor, payload: torch.Tensor,
                       ring: DescRing, off: int, grid: tuple[int, int], consts: tuple,
                       num_warps: int) -> bool:
        """Launch reading the block rows at `off` in the ring's host memory (through
        the shape's compiled kernel once there is one). False, and the ring no longer
        read in place, if the kernel cannot address host memory."""
        try:
            _launches(grid, (flat_pools, payload, *self._dev, ring.host, off), consts, num_warps)
        except ValueError:  # "cannot be accessed from Triton": no UVA mapping here
            ring.mapped = False
            return False
        return True

