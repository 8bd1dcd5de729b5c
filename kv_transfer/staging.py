"""Staging of KV pages: `_Pools` validates a rank's per-layer (K, V) pools and gathers
(sender) or scatters (receiver) the blocks of a copy template through one contiguous
staging buffer; `_Template` is a template located in one side's pools (its pool-row
indices built once, on the pools' device, and reused by every block)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import torch

from . import messages as m

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Pools:
    """Per-layer (K, V) pools `[num_pages, heads, page_size, head_dim]`, one dtype and
    device; gathers and scatters template blocks, one indexed copy per granule run."""

    def __init__(self, pools: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
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

    def check(self, table: np.ndarray, side: str) -> str:
        return m.check_copies(table, side, self.num_layers, self.num_pages, self.heads,
                              self.page_size)

    def nbytes(self, table: np.ndarray) -> int:
        return m.payload_nbytes(table, self.head_dim, self.row_bytes // self.head_dim)

    def template(self, table: np.ndarray, side: str) -> "_Template":
        """Validate a template for `side` and locate it; ValueError naming what is wrong."""
        error = self.check(table, side)
        if error:
            raise ValueError(error)
        return _Template(self, table, side)

    def _block_runs(self, tmpl: "_Template", blocks: np.ndarray, buf: torch.Tensor):
        """(layer, pool rows, index, payload rows) per (block, granule run), in payload
        order; `buf` holds exactly the blocks' payload."""
        flat, pos = buf.view(self.dtype), 0
        for layer, kind, r0, r1 in blocks.tolist():
            for a, b, g, idx, off in tmpl.runs:
                lo, hi = max(a, r0), min(b, r1)
                if lo >= hi:
                    continue
                i0, i1 = int(off[lo - a]), int(off[hi - a])
                width = g * self.head_dim
                end = pos + (i1 - i0) * width
                yield (layer, self.pools[layer][kind].view(-1, width), idx[i0:i1],
                       flat[pos:end].view(-1, width))
                pos = end

    def gather(self, tmpl: "_Template", blocks: np.ndarray, out: torch.Tensor) -> None:
        """Source slabs of `blocks` into the uint8 buffer `out`, in payload order; done
        (device synchronised) on return, since UCX then reads `out` directly."""
        for _, pool, idx, rows in self._block_runs(tmpl, blocks, out):
            torch.index_select(pool, 0, idx, out=rows)
        self._sync()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def scatter(self, tmpl: "_Template", blocks: np.ndarray, payload: torch.Tensor
                ) -> dict[int, int]:
        """Payload into the destination slots of `blocks`; token slots written per layer.
        On CPU through numpy (row assignment runs ~7x faster than torch's index_copy_)."""
        as_int = _INT_OF_SIZE[self.row_bytes // self.head_dim]
        for _, pool, idx, rows in self._block_runs(tmpl, blocks, payload):
            if pool.device.type == "cpu":
                pool.view(as_int).numpy()[idx.numpy()] = rows.view(as_int).numpy()
            else:
                pool.index_copy_(0, idx, rows)
        self._sync()  # written before it is reported landed and the buffer is reused
        landed: dict[int, int] = defaultdict(int)
        for layer, _, r0, r1 in blocks.tolist():
            landed[layer] += int(tmpl.slots_cum[r1] - tmpl.slots_cum[r0])
        return landed


class _Template:
    """A template (copy table, layer/kind unused) located in one side's pools: for each
    run of rows with one granule g, the pool rows (`[-1, g * head_dim]` view) of every
    slab in payload order, and per row its offset into them; byte and slot prefix sums
    per row, so a block [r0, r1) is sized and indexed in O(runs)."""

    def __init__(self, pools: _Pools, table: np.ndarray, side: str) -> None:
        self.table = np.ascontiguousarray(table, dtype=np.dtype("<i4"))
        self.rows = len(table)
        slots = table[:, m.F_NUM_HEADS].astype(np.int64) * table[:, m.F_NUM_TOKENS]
        self.slots_cum = np.concatenate(([0], np.cumsum(slots)))
        self.bytes_cum = self.slots_cum * pools.row_bytes
        self.runs = []
        for _, _, g, a, b in m.segments(table, side, pools.page_size):
            rows = m.copy_rows(table[a:b], side, pools.heads, pools.page_size, g)
            off = np.concatenate(([0], np.cumsum(slots[a:b] // g)))
            self.runs.append((a, b, g, torch.from_numpy(rows).to(pools.device), off))

    def nbytes(self, blocks: np.ndarray) -> int:
        return int((self.bytes_cum[blocks[:, 3]] - self.bytes_cum[blocks[:, 2]]).sum())

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
