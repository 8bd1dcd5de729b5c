"""Staging of KV pages: `KVPools` validates a rank's per-layer (K, V) pools and gathers
(sender) or scatters (receiver) the blocks of a copy template through one contiguous
staging buffer; `PoolTemplate` is a template located in one side's pools (its pool-row
indices built once, on the pools' device, and reused by every block).

Streams (CUDA): gathers and scatters run on the pools' own non-blocking copy stream, not
on the stream the engine computes on, so a gather waits only for the layers it reads
(the `ready` events recorded on the compute stream when each layer was submitted), not
for every kernel the engine queued after them, and a scatter does not queue behind a
decode step. Both only queue their copies and return an event; `wait` awaits it on a
waiter thread, so the transport loop keeps receiving, posting and acknowledging other
messages while copies run (one message on the wire while the next is gathered and the
previous scattered). A scatter waits for no event: the pages it writes were reserved on
the host after the engine synchronised the last step that read them (engines read
sampled tokens back every step)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from ..planning import messages as m
from ..planning.spans import SlabSpans

if TYPE_CHECKING:
    from .slab_copy import SlabIndex

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeviceBytes:
    """`nbytes` bytes of device memory at address `ptr` as a CUDA array (interface v2,
    uint8, 1-D): what UCX needs of a buffer. The memory must outlive it (pool regions:
    the pools do)."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "strides": None,
                                         "version": 2}

    @property
    def nbytes(self) -> int:
        return self.__cuda_array_interface__["shape"][0]


class KVPools:
    """Per-layer (K, V) pools `[num_pages, heads, page_size, head_dim]`, one dtype and
    device; gathers and scatters template blocks: one indexed copy per message when the
    pools are one allocation, else one per (block, granule run)."""

    def __init__(self, pools: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 slab_kernel: Optional[bool] = None) -> None:
        """slab_kernel: copy through `slab_copy`'s one-launch kernel (needs the pools as
        one allocation); default: on CUDA when they are."""
        if not pools:
            raise ValueError("pools must hold one (k, v) pair per layer")
        first = pools[0][0]
        if first.dim() != 4:
            raise ValueError(f"pools must be [pages, heads, page_size, head_dim], "
                             f"got {tuple(first.shape)}")
        for layer, pair in enumerate(pools):
            for t in pair:
                if (t.shape != first.shape or t.dtype != first.dtype
                        or t.device != first.device or not t.is_contiguous()):
                    raise ValueError(f"layer {layer}: pools must be contiguous and share "
                                     f"shape {tuple(first.shape)}, dtype and device")
        self.num_layers = len(pools)
        self.num_pages, self.heads, self.page_size, self.head_dim = first.shape
        self.dtype, self.device = first.dtype, first.device
        self.row_bytes = self.head_dim * first.element_size()
        self.pools = [tuple(pair) for pair in pools]
        self._stream = (torch.cuda.Stream(self.device) if self.device.type == "cuda"
                        else None)
        self._waiter: Optional[concurrent.futures.ThreadPoolExecutor] = None
        # per pool: its address (CUDA) or its bytes as a numpy view (CPU), for `region`
        self._bases = [tuple(t.data_ptr() if self.device.type == "cuda"
                             else t.view(-1).view(torch.uint8).numpy() for t in pair)
                       for pair in self.pools]
        self._flat = self._flat_view()
        if slab_kernel is None:
            slab_kernel = self._flat is not None and self.device.type == "cuda"
        if slab_kernel and self._flat is None:
            raise ValueError("the slab kernel needs the pools as one allocation")
        self._slab_kernel = slab_kernel
        self._ring: Optional[Any] = None  # slab_copy.DescRing of the copy stream, made on use

    def _flat_view(self) -> Optional[torch.Tensor]:
        """One 1-D tensor over every pool when they are consecutive pieces of one
        allocation (K0, V0, K1, V1, ...: `allocate_kv_cache`'s layout), else None. A
        message is then one indexed copy, whatever layers it spans."""
        first = self.pools[0][0]
        step = first.numel() * first.element_size()
        for layer, pair in enumerate(self.pools):
            for kind, t in enumerate(pair):
                if t.data_ptr() != first.data_ptr() + (2 * layer + kind) * step:
                    return None
        total = 2 * self.num_layers * first.numel()
        storage = first.untyped_storage()
        if (first.storage_offset() + total) * first.element_size() > storage.nbytes():
            return None
        return torch.empty(0, dtype=self.dtype, device=self.device).set_(
            storage, first.storage_offset(), (total,))

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(num_pages, heads, page_size, head_dim) of every pool."""
        return (self.num_pages, self.heads, self.page_size, self.head_dim)

    def region(self, layer: int, kind: int, span: tuple[int, int]) -> Any:
        """Elements [start, stop) of pool (layer, kind) as a buffer UCX reads (sender) or
        writes (receiver) in place: a uint8 numpy view on CPU, a `DeviceBytes` on CUDA
        (a request posts one per (layer, kind): a tensor view costs ~10x more to make)."""
        esize = self.row_bytes // self.head_dim
        base = self._bases[layer][kind]
        if self.device.type == "cuda":
            return DeviceBytes(base + span[0] * esize, (span[1] - span[0]) * esize)
        return base[span[0] * esize:span[1] * esize]

    def ready_event(self) -> Optional["torch.cuda.Event"]:
        """An event on the calling thread's current stream (CUDA; None on CPU, or when
        everything that stream was given has already run): a gather given it reads what
        that stream wrote before this call."""
        if self._stream is None:
            return None
        stream = torch.cuda.current_stream(self.device)
        if stream.query():  # an event recorded now would not complete at once (~µs later)
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def check(self, table: np.ndarray, side: str) -> str:
        return m.check_copies(table, side, self.num_layers, self.num_pages, self.heads,
                              self.page_size)

    def nbytes(self, table: np.ndarray) -> int:
        return m.payload_nbytes(table, self.head_dim, self.row_bytes // self.head_dim)

    def template(self, table: np.ndarray, side: str) -> "PoolTemplate":
        """Validate a template for `side` and locate it; ValueError naming what is wrong."""
        error = self.check(table, side)
        if error:
            raise ValueError(error)
        return PoolTemplate(self, table, side)

    def _copies(self, tmpl: "PoolTemplate", blocks: np.ndarray, buf: torch.Tensor):
        """(pool rows `[-1, width]`, row index, payload rows `[-1, width]`) covering the
        blocks in payload order: one triple over the flat view when there is one and
        the template has one granule, else one per (block, granule run). `buf` holds
        exactly the blocks' payload."""
        payload = buf.view(self.dtype)
        if self._flat is not None and len(tmpl.granules) == 1:
            width = tmpl.granules[0] * self.head_dim
            per_pool = self.pools[0][0].numel() // width
            parts = [rows[i0:i1] + (2 * layer + kind) * per_pool
                     for layer, kind, i0, i1, rows in self._block_slices(tmpl, blocks)]
            idx = torch.from_numpy(np.concatenate(parts))
            if self.device.type == "cuda":
                idx = idx.pin_memory().to(self.device, non_blocking=True)
            yield self._flat.view(-1, width), idx, payload.view(-1, width)
            return
        pos = 0
        for layer, kind, i0, i1, _, g, dev_rows in self._block_slices(tmpl, blocks, self.device):
            width = g * self.head_dim
            end = pos + (i1 - i0) * width
            yield (self.pools[layer][kind].view(-1, width), dev_rows[i0:i1],
                   payload[pos:end].view(-1, width))
            pos = end

    @staticmethod
    def _block_slices(tmpl: "PoolTemplate", blocks: np.ndarray,
                      device: Optional[torch.device] = None):
        """Per (block, granule run) in payload order: (layer, kind, i0, i1, host rows
        [, granule, rows on `device`]): rows[i0:i1] are the run's slabs within the block."""
        for layer, kind, r0, r1 in blocks.tolist():
            for i, (a, b, g, off, host_rows) in enumerate(tmpl.runs):
                lo, hi = max(a, r0), min(b, r1)
                if lo < hi:
                    i0, i1 = int(off[lo - a]), int(off[hi - a])
                    yield ((layer, kind, i0, i1, host_rows, g, tmpl.device_rows(i, device))
                           if device is not None else (layer, kind, i0, i1, host_rows))

    def gather(self, tmpl: "PoolTemplate", blocks: np.ndarray, out: torch.Tensor,
               ready: Sequence[Any] = ()) -> Optional["torch.cuda.Event"]:
        """Source slabs of `blocks` into the uint8 buffer `out`, in payload order, after
        the `ready` events. CPU: done on return (None). CUDA: queued on the copy stream;
        returns the event after which `out` is complete (`wait` for it before UCX reads
        `out`)."""
        with self._on_copy_stream():
            for event in ready:
                if event is not None:
                    self._stream.wait_event(event)
            if self._slab_kernel:
                tmpl.slabs(self).copy(self._flat, out.view(self.dtype), blocks,
                                      self.pools[0][0].numel(), to_payload=True,
                                      ring=self._desc_ring())
            else:
                for pool, idx, rows in self._copies(tmpl, blocks, out):
                    torch.index_select(pool, 0, idx, out=rows)
        return self._record()

    def _record(self) -> Optional["torch.cuda.Event"]:
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def _desc_ring(self) -> Optional[Any]:
        """The copy stream's `slab_copy.DescRing` (CUDA), or None."""
        if self._ring is None and self._stream is not None:
            from .slab_copy import DescRing
            self._ring = DescRing(self.device)
        return self._ring

    def prebuild(self, tmpl: "PoolTemplate") -> None:
        """Build what a first gather or scatter of `tmpl` would (its pool rows; with the
        slab kernel, its device index), e.g. while the engine computes."""
        if self._slab_kernel:
            tmpl.slabs(self)
            self._desc_ring()
        else:
            tmpl.runs

    async def wait(self, event: Optional["torch.cuda.Event"]) -> None:
        """Until `event` (from gather/scatter) has happened, without blocking the loop:
        the wait runs on this pool's one waiter thread (events complete in queue order)."""
        if event is None or event.query():
            return
        if self._waiter is None:
            self._waiter = concurrent.futures.ThreadPoolExecutor(1, "phalanx-kv-copy-wait")
        await asyncio.get_running_loop().run_in_executor(self._waiter, event.synchronize)

    def sync(self) -> None:
        """Block until every queued gather and scatter is complete."""
        if self._stream is not None:
            self._stream.synchronize()

    def _on_copy_stream(self):
        return (torch.cuda.stream(self._stream) if self._stream is not None
                else contextlib.nullcontext())

    def scatter(self, tmpl: "PoolTemplate", blocks: np.ndarray, payload: torch.Tensor
                ) -> tuple[dict[int, int], Optional["torch.cuda.Event"]]:
        """Payload into the destination slots of `blocks`: (token slots written per layer,
        event). CPU: done on return, through numpy (one thread; its row assignment ran
        1.6x torch's one-thread index_copy_ for 4 KiB rows, ~0.8 of memcpy), event None. CUDA: queued on the copy stream; the slots hold
        their values and `payload` may be reused once the event has happened."""
        as_int = _INT_OF_SIZE[self.row_bytes // self.head_dim]
        with self._on_copy_stream():
            if self._slab_kernel:
                tmpl.slabs(self).copy(self._flat, payload.view(self.dtype), blocks,
                                      self.pools[0][0].numel(), to_payload=False,
                                      ring=self._desc_ring())
            else:
                for pool, idx, rows in self._copies(tmpl, blocks, payload):
                    if pool.device.type == "cpu":
                        pool.view(as_int).numpy()[idx.numpy()] = rows.view(as_int).numpy()
                    else:
                        pool.index_copy_(0, idx, rows)
        return tmpl.landed(blocks), self._record()


class PoolTemplate:
    """A template (copy table, layer/kind unused) located in one side's pools: for each
    run of rows with one granule g, the pool rows (`[-1, g * head_dim]` view) of every
    slab in payload order (on the host; on the device once a copy needs them), and per
    row its offset into them; byte and slot prefix sums per row, so a block [r0, r1) is
    sized and indexed in O(runs); its `spans` in this side's pools (which blocks move in
    place: those need no rows at all)."""

    def __init__(self, pools: KVPools, table: np.ndarray, side: str) -> None:
        self.table = np.ascontiguousarray(table, dtype=np.dtype("<i4"))
        self.rows, self._side, self._shape = len(table), side, (pools.heads, pools.page_size)
        self._slots = table[:, m.F_NUM_HEADS].astype(np.int64) * table[:, m.F_NUM_TOKENS]
        self.slots_cum = np.concatenate(([0], np.cumsum(self._slots)))
        self.bytes_cum = self.slots_cum * pools.row_bytes
        self.spans = SlabSpans(table, side, pools.heads, pools.page_size, pools.head_dim)
        self._runs: Optional[list[tuple]] = None
        self._slabs: Optional["SlabIndex"] = None
        self._device_rows: dict[int, torch.Tensor] = {}
        self._span_of: dict[tuple[int, int], Optional[tuple[int, int]]] = {}

    def span(self, r0: int, r1: int) -> Optional[tuple[int, int]]:
        """`spans.span(r0, r1)`, remembered: every (layer, kind) block of a template
        names the same rows."""
        key = (r0, r1)
        if key not in self._span_of:
            self._span_of[key] = self.spans.span(r0, r1)
        return self._span_of[key]

    @property
    def runs(self) -> list[tuple[int, int, int, np.ndarray, np.ndarray]]:
        """Per run of rows with one granule: (a, b, granule, offsets, host rows); built
        on first use (a template whose blocks all move in place never needs them)."""
        if self._runs is None:
            heads, page_size = self._shape
            self._runs = []
            for _, _, g, a, b in m.segments(self.table, self._side, page_size):
                rows = m.copy_rows(self.table[a:b], self._side, heads, page_size, g)
                off = np.concatenate(([0], np.cumsum(self._slots[a:b] // g)))
                self._runs.append((a, b, g, off, rows))
        return self._runs

    @property
    def granules(self) -> list[int]:
        return sorted({run[2] for run in self.runs})

    def device_rows(self, run: int, device: torch.device) -> torch.Tensor:
        """The pool rows of run `run` as an int64 tensor on `device` (copied once)."""
        rows = self._device_rows.get(run)
        if rows is None:
            rows = self._device_rows[run] = torch.from_numpy(self.runs[run][4]).to(device)
        return rows

    def slabs(self, pools: KVPools) -> "SlabIndex":
        """This template's `SlabIndex` on the pools' device (built on first use)."""
        if self._slabs is None:
            from .slab_copy import SlabIndex  # triton: only where the slab kernel runs
            self._slabs = SlabIndex([(a, b, g, host, off) for a, b, g, off, host in self.runs],
                                    self.rows, pools.head_dim, pools.device)
        return self._slabs

    def nbytes(self, blocks: np.ndarray) -> int:
        return int(self.block_bytes(blocks).sum())

    def block_bytes(self, blocks: np.ndarray) -> np.ndarray:
        """Payload bytes of each block (int64)."""
        return self.bytes_cum[blocks[:, 3]] - self.bytes_cum[blocks[:, 2]]

    def landed(self, blocks: np.ndarray) -> dict[int, int]:
        """Token slots (heads x tokens) that `blocks` write, per layer."""
        out: dict[int, int] = defaultdict(int)
        for layer, _, r0, r1 in blocks.tolist():
            out[layer] += int(self.slots_cum[r1] - self.slots_cum[r0])
        return out

    def cut(self, block: tuple[int, int, int, int], capacity: int) -> list[tuple[tuple, int]]:
        """`block` cut at row boundaries into pieces of at most `capacity` payload bytes:
        [(block, bytes)]. ValueError if one row alone is larger."""
        layer, kind, r0, r1 = block
        out, start = [], r0
        while start < r1:
            limit = self.bytes_cum[start] + capacity
            stop = min(int(np.searchsorted(self.bytes_cum, limit, side="right")) - 1, r1)
            if stop <= start:
                raise ValueError(f"a copy of {int(self.bytes_cum[start + 1] - self.bytes_cum[start])}"
                                 f" bytes exceeds the receiver's {capacity}-byte messages")
            out.append(((layer, kind, start, stop),
                        int(self.bytes_cum[stop] - self.bytes_cum[start])))
            start = stop
        return out
