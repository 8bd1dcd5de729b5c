"""Staging of KV pages: `_Pools` validates a rank's per-layer (K, V) pools and gathers
(sender) or scatters (receiver) the page runs of a copy table through one contiguous
staging buffer."""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Sequence

import numpy as np
import torch

from . import messages as m

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Pools:
    """Per-layer (K, V) pools `[num_pages, heads, page_size, head_dim]`, one dtype and
    device; gathers and scatters copy tables one (layer, kind, granule) run at a time."""

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
        self._index: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def check(self, table: np.ndarray, side: str) -> str:
        return m.check_copies(table, side, self.num_layers, self.num_pages, self.heads,
                              self.page_size)

    def copy_nbytes(self, table: np.ndarray) -> np.ndarray:
        return m.copy_nbytes(table, self.head_dim, self.row_bytes // self.head_dim)

    def nbytes(self, table: np.ndarray) -> int:
        return m.payload_nbytes(table, self.head_dim, self.row_bytes // self.head_dim)

    def _rows_of(self, table: np.ndarray, side: str, granule: int) -> torch.Tensor:
        """Row index of a run, cached by its geometry (every layer and kind repeats it)."""
        cols = list(m.SIDE_COLUMNS[side]) + [m.F_NUM_HEADS, m.F_NUM_TOKENS]
        key = (side, granule, np.ascontiguousarray(table[:, cols]).tobytes())
        idx = self._index.get(key)
        if idx is None:
            rows = m.copy_rows(table, side, self.heads, self.page_size, granule)
            idx = torch.from_numpy(rows).to(self.device)
            self._index[key] = idx
            if len(self._index) > 64:
                self._index.popitem(last=False)
        else:
            self._index.move_to_end(key)
        return idx

    def _runs(self, table: np.ndarray, side: str, buf: torch.Tensor):
        """(pool rows, index, payload rows) per run; `buf` holds exactly the payload."""
        flat, pos = buf.view(self.dtype), 0
        for layer, kind, g, a, b in m.segments(table, side, self.page_size):
            idx = self._rows_of(table[a:b], side, g)
            width = g * self.head_dim
            end = pos + idx.numel() * width
            yield (layer, self.pools[layer][kind].view(-1, width), idx,
                   flat[pos:end].view(-1, width))
            pos = end

    def gather(self, table: np.ndarray, out: torch.Tensor) -> None:
        """Source slabs of `table` into the uint8 buffer `out`, in payload order; done
        (device synchronised) on return, since UCX then reads `out` directly."""
        for _, pool, idx, rows in self._runs(table, "src", out):
            torch.index_select(pool, 0, idx, out=rows)
        self._sync()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def scatter(self, table: np.ndarray, payload: torch.Tensor) -> dict[int, int]:
        """Payload into the destination slots of `table`; token slots written per layer.
        On CPU through numpy (row assignment runs ~7x faster than torch's index_copy_)."""
        landed: dict[int, int] = defaultdict(int)
        as_int = _INT_OF_SIZE[self.row_bytes // self.head_dim]
        for layer, pool, idx, rows in self._runs(table, "dst", payload):
            if pool.device.type == "cpu":
                pool.view(as_int).numpy()[idx.numpy()] = rows.view(as_int).numpy()
            else:
                pool.index_copy_(0, idx, rows)
            landed[layer] += rows.numel() // self.head_dim
        self._sync()  # written before it is reported landed and the buffer is reused
        return landed

