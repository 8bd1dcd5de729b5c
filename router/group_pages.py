"""The pages a prefix tree lists for one group, in least-recently-used order kept lazily:
touching a path of any length costs O(1), not a write per page.

The order the tree needs: a page's *tick* is the clock value of the last insert whose path
covered it; pages leave least recent tick first, and among equal ticks deepest first (so
the page that leaves is always a leaf and the group's pages stay prefix-closed). Stored
eagerly that would be one write per page of every routed prompt.

Lazily: `ticks[h]` stores a tick only where a path *ended* (0 elsewhere), and a page's
tick is the largest stored tick in its subtree of this group's pages — an insert covers
exactly the ancestors of its end. When a page leaves, its stored tick moves to its parent
(`max`), so the ticks of the pages that stay never change. Consequences:
- a leaf's tick is its stored tick, >= 1;
- two leaves never share a tick (one insert covers one path, which holds one leaf), so
  "least recent leaf" is well defined: it is the page the eager order would evict;
- `_heap` holds (tick, page) for every leaf at its current tick, plus stale entries
  (a page that left, gained a child, or was touched again), skipped when popped and
  dropped when the heap outgrows twice the pages.
"""

from __future__ import annotations

import heapq
from typing import Callable, Iterable, Optional, Sequence


class GroupPages:
    """One group's listed pages (module docstring). `bit` is the group's bit in the
    tree's holder masks. `kids[h]`: how many children of page `h` are listed too
    (absent: none, i.e. `h` is a leaf of the group's pages)."""

    __slots__ = ("bit", "ticks", "kids", "_heap")

    def __init__(self, bit: int) -> None:
        self.bit = bit
        self.ticks: dict[int, int] = {}  # listed page -> stored tick (0: no path ends here)
        self.kids: dict[int, int] = {}
        self._heap: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return len(self.ticks)

    # ---- growing -------------------------------------------------------------------

    def add_chain(self, pages: Sequence[int], parent: Optional[int]) -> None:
        """Lists `pages`, a chain (each the parent of the next) of pages not listed yet,
        under `parent` (listed, or None)."""
        if not pages:
            return
        self.ticks.update(dict.fromkeys(pages, 0))
        kids = self.kids
        kids.update(dict.fromkeys(pages[:-1], 1))  # unlisted pages had no listed children
        if parent is not None:
            kids[parent] = kids.get(parent, 0) + 1

    def end_path(self, h: int, tick: int) -> None:
        """An insert at `tick` ended at listed page `h`: `h` and its ancestors get `tick`."""
        self.ticks[h] = tick
        if h not in self.kids:
            self._push(tick, h)

    # ---- shrinking -----------------------------------------------------------------

    def evict(self, count: int, parent: dict[int, Optional[int]]) -> list[int]:
        """Unlists the `count` least recent pages (`parent`: the tree's parent of every
        page); returns them in the order they left (children before parents)."""
        heap, ticks, kids = self._heap, self.ticks, self.kids
        pop = heapq.heappop
        out: list[int] = []
        while count > 0 and heap:
            tick, h = pop(heap)
            if ticks.get(h) != tick or h in kids:
                continue  # stale: unlisted, touched again, or no longer a leaf
            # h is the least recent leaf. Its parent, once bare, is a leaf at tick
            # max(its stored tick, tick): the least recent again (leaves' ticks differ) when
            # its stored tick is not above `tick`. So whole chains leave in one go.
            chain = [h]
            p = parent[h]
            while len(chain) < count and p is not None and kids[p] == 1 and ticks[p] <= tick:
                chain.append(p)
                p = parent[p]
            for x in chain:
                del ticks[x]
            for x in chain[1:]:
                del kids[x]
            out += chain
            count -= len(chain)
            if p is None:
                continue
            left = kids[p] - 1
            if tick > ticks[p]:
                ticks[p] = tick
            if left:
                kids[p] = left
            else:
                del kids[p]
                self._push(ticks[p], p)
        return out

    def remove_subtree(self, pages: Iterable[int], parent: Optional[int]) -> int:
        """Unlists `pages` — a listed page and all its listed descendants — whose top's
        parent is `parent`; returns how many. Their largest tick goes to `parent`."""
        ticks, kids = self.ticks, self.kids
        top = n = 0
        for h in pages:
            t = ticks.pop(h)
            if t > top:
                top = t
            kids.pop(h, None)
            n += 1
        self._unlist_below(parent, top)
        return n

    def _unlist_below(self, parent: Optional[int], tick: int) -> None:
        """One child of `parent` was unlisted, with largest tick `tick` in its subtree."""
        if parent is None:
            return
        kids, ticks = self.kids, self.ticks
        left = kids[parent] - 1
        if tick > ticks[parent]:
            ticks[parent] = tick
        if left:
            kids[parent] = left
        else:
            del kids[parent]
            self._push(ticks[parent], parent)

    # ---- recency -------------------------------------------------------------------

    def touched_after(self, h: int, as_of: int, children: Callable[[int], Iterable[int]]) -> bool:
        """Whether listed page `h` has a tick > `as_of` (some listed page of its subtree
        stores one); `children(h)` lists a page's children in the tree."""
        ticks = self.ticks
        stack = [h]
        while stack:
            x = stack.pop()
            if ticks[x] > as_of:
                return True
            if x in self.kids:
                stack.extend(c for c in children(x) if c in ticks)
        return False

    def touched_after_all(self, as_of: int, parent_of: Callable[[int], Optional[int]]) -> set[int]:
        """Every listed page with a tick > `as_of`: the stored ones and their ancestors."""
        out: set[int] = set()
        for h in [h for h, t in self.ticks.items() if t > as_of]:
            while h is not None and h not in out:
                out.add(h)
                h = parent_of(h)
        return out

    # ---- heap ----------------------------------------------------------------------

    def _push(self, tick: int, h: int) -> None:
        heap = self._heap
        if len(heap) > 2 * len(self.ticks) + 64:  # mostly stale entries: rebuild
            kids = self.kids
            heap[:] = [(t, x) for x, t in self.ticks.items() if x not in kids and x != h]
            heapq.heapify(heap)
        heapq.heappush(heap, (tick, h))

    def check(self) -> None:
        """Asserts the heap invariant: every leaf has an entry at its stored tick >= 1."""
        entries = set(self._heap)
        for h, t in self.ticks.items():
            if h not in self.kids:
                assert t >= 1, f"leaf {h:#x} has no tick"
                assert (t, h) in entries, f"leaf {h:#x} (tick {t}) missing from the heap"


__all__ = ["GroupPages"]
