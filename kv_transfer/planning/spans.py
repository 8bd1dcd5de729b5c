"""Where the rows of a copy template lie in one side's pools, as runs of memory: which
blocks of rows can be moved in place (sent from, or received into, the pool itself)
instead of through a staging buffer.

A template row is one copy's slab `[num_heads, num_tokens, head_dim]` of a (layer, kind)
pool `[num_pages, heads, page_size, head_dim]` (HND pages, row-major). The slab is one
piece of memory when it holds a single head or whole pages' worth of tokens of several
heads (`num_tokens == page_size`, offset 0). Consecutive rows *link* when both are one
piece and the second starts where the first ends; a *span* is a run of linked rows: in
payload order (row by row) it is exactly the pool's elements [start, stop). A request
whose pages are consecutive on a side and whose copies hold all of that side's heads is
therefore one span per (layer, kind) for its whole pages (a partial last page is a
span of its own per head). `direct_spans` checks where a direct message says its blocks
land.

Pure logic: numpy only.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from . import messages as m


class SlabSpans:
    """The spans of a template's rows on one side (`side` "src" or "dst" of the copy
    table; `heads`, `page_size`, `head_dim` of that side's pools). Element offsets are
    within one (layer, kind) pool; every query is O(1) or O(log rows + spans)."""

    def __init__(self, table: np.ndarray, side: str, heads: int, page_size: int,
                 head_dim: int) -> None:
        head_c, page_c, off_c = m.SIDE_COLUMNS[side]
        t = table.astype(np.int64)
        nh, nt, off = t[:, m.F_NUM_HEADS], t[:, m.F_NUM_TOKENS], t[:, off_c]
        self.rows = len(t)
        self.start = ((t[:, page_c] * heads + t[:, head_c]) * page_size + off) * head_dim
        self.size = nh * nt * head_dim
        self.whole = (nh == 1) | ((nt == page_size) & (off == 0))  # one piece of memory
        link = (self.whole[:-1] & self.whole[1:]
                & (self.start[1:] == self.start[:-1] + self.size[:-1]))
        # breaks[i]: rows among 0..i-1 that do not link to their successor
        self._breaks = np.concatenate(([0], np.cumsum(~link)))
        self._chain_starts = np.flatnonzero(~link) + 1  # rows that begin a new run
        self._size_cum = np.concatenate(([0], np.cumsum(self.size)))

    def span(self, r0: int, r1: int) -> Optional[tuple[int, int]]:
        """Elements [start, stop) of the pool that rows [r0, r1) are, in payload order,
        or None when they are not one span."""
        if not (0 <= r0 < r1 <= self.rows) or not self.whole[r0]:
            return None
        if self._breaks[r1 - 1] - self._breaks[r0]:
            return None
        return int(self.start[r0]), int(self.start[r0] + self._size_cum[r1] - self._size_cum[r0])

    def split(self, r0: int, r1: int, min_elements: int) -> list[tuple[int, int, bool]]:
        """Rows [r0, r1) cut into pieces in row order: (a, b, in_place) where in_place
        pieces are maximal spans of at least `min_elements` elements and the rest are
        the runs of rows between them (in_place False)."""
        inner = self._chain_starts[np.searchsorted(self._chain_starts, r0, side="right"):
                                   np.searchsorted(self._chain_starts, r1, side="left")]
        bounds = np.concatenate(([r0], inner, [r1]))
        a, b = bounds[:-1], bounds[1:]
        big = self.whole[a] & (self._size_cum[b] - self._size_cum[a] >= min_elements)
        out: list[tuple[int, int, bool]] = []
        pos = r0
        for i in np.flatnonzero(big).tolist():
            lo, hi = int(a[i]), int(b[i])
            if pos < lo:
                out.append((pos, lo, False))
            out.append((lo, hi, True))
            pos = hi
        if pos < r1:
            out.append((pos, r1, False))
        return out


def direct_spans(blocks: np.ndarray, starts: bytes, sizes: list[int], layers: range,
                 num_layers: int, pool_elements: int, head_dim: int, element_bytes: int
                 ) -> list[tuple[int, int, tuple[int, int]]]:
    """Where a direct message's blocks land (`TransferRequest.dst_starts`): per block
    (layer, kind, elements [start, stop) of that (layer, kind) pool). ValueError naming
    the first block that is not whole token slots (`head_dim` elements) of one pool of
    `pool_elements`, among `layers`, or when blocks, starts and sizes disagree in number."""
    first = np.frombuffer(starts, dtype="<i8") if len(starts) % 8 == 0 else np.empty(0, np.int64)
    if not len(first) == len(sizes) == len(blocks):
        raise ValueError(f"direct message of {len(blocks)} blocks, {len(first)} starts and "
                         f"{len(sizes)} sizes")
    nbytes = np.array(sizes, dtype=np.int64)
    count = nbytes // element_bytes
    layer, kind = blocks[:, 0], blocks[:, 1]
    bad = ((layer < max(layers.start, 0)) | (layer >= min(layers.stop, num_layers))
           | (kind < 0) | (kind > 1) | (nbytes <= 0) | (nbytes % (head_dim * element_bytes) != 0)
           | (first < 0) | (first % head_dim != 0) | (first + count > pool_elements))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"direct block {i} (layer {int(layer[i])}, kind {int(kind[i])}, "
                         f"start {int(first[i])}, {sizes[i]} bytes) is not whole token slots "
                         f"of a pool among layers [{layers.start}, {layers.stop})")
    return [(lk[0], lk[1], (a, a + n))
            for lk, a, n in zip(blocks[:, :2].tolist(), first.tolist(), count.tolist())]
