"""The pieces a prefix tree is made of: runs of pages (compressed edges) and, per group,
which pages of them it lists and in which least-recently-used order.

A `PageRun` is a chain of pages, `hashes[i]` the parent page of `hashes[i+1]`, hanging
under the last page of `parent` (None: its first page is a first page). Runs branch only
at their last page (`kids`, keyed by the child run's first hash), so one chat
conversation, which only ever grows at its end, stays one run however many turns it has.
A run costs one object, not one per page; listing, matching and evicting a run's pages
is a slice, a count or a comparison, not a loop over them.

Per group (its `bit` in the tree) a run records:
- `held[bit]`: how many of its pages the group lists, always a prefix (prefix closure);
  at least one, else absent. A run with no holder at all is no longer in the tree.
- `nkids[bit]`: how many child runs the group lists (absent: none); a group lists a child
  run only if it lists all of this run.
- `ticks[bit]`: the group's *stored ticks* on this run, `(position, tick)` by ascending
  position: the clock of the last insert whose path ended at that page (or the tick a
  page inherited when pages below it left). A page's recency is the largest stored tick
  in its subtree (lazy LRU, as in the eager order: an insert covers the ancestors of
  where it ends). A stored tick that a deeper one on the same run is at least as large
  as is dropped (it can never decide anything): a path end clears the entries above it.

A group's *leaf* is the page at `held - 1` of a run whose next page it does not list and,
at the run's end, none of whose child runs it lists. Every leaf has a stored tick, and two
leaves of one group never share one (an insert's path holds one leaf).
"""

from __future__ import annotations

import heapq
from typing import Optional

TickEntries = list[tuple[int, int]]  # (position in the run, tick), ascending position


class PageRun:
    """A chain of pages of the tree (module docstring). `depth0` is the position of
    `hashes[0]` in its sequence (the parent run's `depth0 + len(hashes)`)."""

    __slots__ = ("hashes", "parent", "depth0", "kids", "held", "nkids", "ticks", "cut_to")

    def __init__(self, hashes: list[int], parent: Optional["PageRun"], depth0: int) -> None:
        self.hashes = hashes
        self.parent = parent
        self.depth0 = depth0
        # the run that took this run's pages past its end when it was cut (None: never
        # cut), so that a heap entry naming this run still finds a page that moved
        self.cut_to: Optional[PageRun] = None
        self.kids: dict[int, PageRun] = {}
        self.held: dict[int, int] = {}
        self.nkids: dict[int, int] = {}
        self.ticks: dict[int, TickEntries] = {}

    def holding(self, depth: int) -> Optional["PageRun"]:
        """The run that holds the page at `depth` of this run's chain, following cuts
        (None: that page is gone)."""
        r: Optional[PageRun] = self
        while r is not None and depth >= r.depth0 + len(r.hashes):
            r = r.cut_to
        return r

    def is_leaf_end(self, bit: int) -> bool:
        """Whether the group of `bit` (which lists some of this run) has its leaf here."""
        return self.held[bit] < len(self.hashes) or not self.nkids.get(bit)


HeapEntry = tuple[int, int, int, PageRun]  # (tick, depth, sequence number, run)


class GroupRuns:
    """One group's side of the tree: its bit, the runs it lists pages of, how many pages
    it lists, and a heap of (tick, depth, sequence number, run) holding every leaf at its
    tick plus stale entries (skipped when popped; rebuilt when they dominate). An entry
    names the run its page was on when pushed (`PageRun.holding` finds it after a cut);
    the sequence number keeps runs from ever being compared."""

    __slots__ = ("bit", "runs", "pages", "heap", "_seq")

    def __init__(self, bit: int) -> None:
        self.bit = bit
        self.runs: dict[PageRun, None] = {}
        self.pages = 0
        self.heap: list[HeapEntry] = []
        self._seq = 0

    def push_leaf(self, run: PageRun, pos: int, tick: int) -> None:
        """Page `pos` of `run` became (or is again) a leaf at `tick`."""
        heap = self.heap
        if len(heap) > 2 * self.pages + 64:  # mostly stale entries: rebuild from the runs
            heap[:] = self.leaf_entries()
            heapq.heapify(heap)
        self._seq += 1
        heapq.heappush(heap, (tick, run.depth0 + pos, self._seq, run))

    def leaf_entries(self) -> list[HeapEntry]:
        """A heap entry for every leaf of the group."""
        bit, out = self.bit, []
        for r in self.runs:
            if r.is_leaf_end(bit):
                self._seq += 1
                out.append((r.ticks[bit][-1][1], r.depth0 + r.held[bit] - 1, self._seq, r))
        return out


def stored_tick(entries: Optional[TickEntries], pos: int) -> int:
    """The stored tick at `pos` (0: none)."""
    if entries:
        for p, t in reversed(entries):
            if p == pos:
                return t
            if p < pos:
                break
    return 0


def end_path(entries: TickEntries, pos: int, tick: int) -> None:
    """An insert at `tick` (the newest) ended at `pos`: the entries at or above `pos`
    are at most `tick`, so they are dropped, and `(pos, tick)` goes first."""
    i = 0
    while i < len(entries) and entries[i][0] <= pos:
        i += 1
    entries[:i] = [(pos, tick)]


def raise_tick(entries: TickEntries, pos: int, tick: int) -> int:
    """Makes the stored tick at `pos` at least `tick`; returns it."""
    i = len(entries)
    while i and entries[i - 1][0] > pos:
        i -= 1
    if i and entries[i - 1][0] == pos:
        if entries[i - 1][1] >= tick:
            return entries[i - 1][1]
        entries[i - 1] = (pos, tick)
    else:
        entries.insert(i, (pos, tick))
    return tick


def cut_ticks(entries: TickEntries, pos: int) -> int:
    """Drops the entries at `pos` and below it; returns the largest tick dropped (0)."""
    top = 0
    while entries and entries[-1][0] >= pos:
        t = entries.pop()[1]
        if t > top:
            top = t
    return top


__all__ = ["GroupRuns", "HeapEntry", "PageRun", "TickEntries", "cut_ticks", "end_path", "raise_tick",
           "stored_tick"]
