"""An approximate prefix tree of what each group (DP group or prefill instance) caches.

Built from the token prefixes the router sent to each group, at page granularity: a node
is one full page, named by the same chain hash the ranks' block pools use
(`page_hashes`: hash(parent hash, page tokens)), so a node names its whole prefix and a
rank's report of the hashes it holds can be matched against the tree directly. It is
approximate: a rank may have evicted what the tree still lists until the next `refresh`.

Layout (page_runs.py): the pages are stored in runs, chains of pages that branch only at
their ends (a radix tree's compressed edges), with per-group listed counts and lazy LRU
ticks on each run, and nothing per page but its hash in its run's list (no index by
hash: matching walks down from `_roots`; `forget`, the one lookup by hash, indexes the
reporting group's pages for the call). Listing, matching and evicting cost per run, not
per page: a prompt new to a group is one slice, and a chat's next turn extends its run
in place.

Invariants (asserted by `check_integrity`):
- every page of a run is listed by some group (a run's largest `held` is its length),
  and `num_nodes()` counts the pages of the runs reachable from `_roots`;
- prefix closure: a group listing a child run lists all of its parent run, so a group's
  pages form a subtree hanging from the root and a match walks down one path;
- `pages(g)` is the sum of g's `held` counts and at most `capacity(g)`;
- LRU: eviction takes the least recent leaf first (deepest first among equal ticks:
  the order of per-page ticks stored eagerly, see page_runs.py), so the pages stay
  prefix-closed.

Matching is incremental: the prompt's hashes come from `PageHasher` (pages seen before
are not hashed again), and a match compares one hash per run on its path (the last one
it reaches; the pages between are equal unless a 64-bit collision makes two chains
agree on a page and disagree before it, which would only skew the estimate). A chain
whose hash collides with another chain's may match past the collision, as the ranks'
block pools would. Such a collision between two chains of the tree would also leave one
page hash in two places, and a rank's report of it apply to one of them only: like the
estimate, the reports are approximate for 2^-64-likely events, never inconsistent.
"""

from __future__ import annotations

from itertools import chain
from typing import Hashable, Optional, Sequence

from .page_hasher import PageHasher, page_hashes
from .page_runs import GroupRuns, PageRun, end_path
from .tree_invariants import check_prefix_tree
from .tree_pruning import TreePruning

GroupId = Hashable

MEMO_SPARE_PAGES = 4096  # the hasher remembers up to 2 x nodes + this many pages


def _equal_pages(run: list[int], hashes: Sequence[int], p: int, m: int) -> int:
    """How many first pages of `run` equal `hashes[p:]`, given that the first does and
    page m-1 does not (a chain that differs once differs after: bisect)."""
    a, b = 0, m - 1
    while b - a > 1:
        mid = (a + b) >> 1
        if run[mid] == hashes[p + mid]:
            a = mid
        else:
            b = mid
    return a + 1


class PrefixTree(TreePruning):
    """Page-granular prefix tree over many groups (see the module docstring).

    `capacity_pages` bounds the pages listed per group (LRU eviction of leaves); a group
    may get its own bound with `set_capacity`. A logical `clock` ticks once per insert;
    `refresh(..., as_of=t)` keeps what was touched after tick t. `hasher` computes (and
    remembers) page chain hashes of this tree's page size: up to twice as many pages as
    the tree has nodes, plus `MEMO_SPARE_PAGES` (about 200 bytes a page).
    """

    def __init__(self, page_size: int, capacity_pages: int) -> None:
        if not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        if not isinstance(capacity_pages, int) or capacity_pages <= 0:
            raise ValueError(f"capacity_pages must be a positive integer, got {capacity_pages!r}")
        self.page_size = page_size
        self.capacity_pages = capacity_pages
        self.hasher = PageHasher(page_size, MEMO_SPARE_PAGES)
        self._roots: dict[int, PageRun] = {}  # first page hash -> run
        self._nodes = 0  # pages in the runs
        self._groups: dict[GroupId, GroupRuns] = {}  # in first-insert order
        self._owner: dict[int, GroupId] = {}  # bit -> group
        self._free_bits: list[int] = []
        self._capacity: dict[GroupId, int] = {}
        self._clock = 0

    # ---- reading -------------------------------------------------------------------

    @property
    def clock(self) -> int:
        """The current logical time (number of inserts so far)."""
        return self._clock

    def hashes(self, tokens: Sequence[int], remember: bool = True,
               parent: Optional[int] = None) -> Sequence[int]:
        """Chain hashes of the full pages of `tokens`, an array('Q') (remembered for later
        calls); `parent`: a salted sequence's root (the engine's `salt_root`)."""
        return self.hasher.hashes(tokens, parent=parent, remember=remember)

    def groups(self) -> list[GroupId]:
        """Groups that hold at least one page, in first-insert order."""
        return [g for g, gr in self._groups.items() if gr.pages]

    def pages(self, group: GroupId) -> int:
        """Number of pages listed for `group`."""
        gr = self._groups.get(group)
        return gr.pages if gr else 0

    def num_nodes(self) -> int:
        return self._nodes

    def capacity(self, group: GroupId) -> int:
        return self._capacity.get(group, self.capacity_pages)

    def held_hashes(self, group: GroupId) -> set[int]:
        """The page hashes listed for `group`."""
        gr = self._groups.get(group)
        if not gr:
            return set()
        bit = gr.bit
        return set(chain.from_iterable(r.hashes[:r.held[bit]] for r in gr.runs))

    def match(self, tokens: Sequence[int]) -> dict[GroupId, int]:
        """Tokens of the longest listed prefix of `tokens`, per group (groups with no
        match are absent). Read-only: touches no LRU state."""
        return self.match_hashes(self.hashes(tokens, remember=False))

    def match_hashes(self, hashes: Sequence[int]) -> dict[GroupId, int]:
        """`match` from precomputed chain hashes."""
        pages = self.match_pages(hashes)
        ps = self.page_size
        return {g: n * ps for g, n in pages.items()}

    def match_pages(self, hashes: Sequence[int]) -> dict[GroupId, int]:
        """Matched full pages per group (absent: none): the path of runs `hashes` walks
        down, each group's match ending where its listed pages on the path do."""
        n = len(hashes)
        r = self._roots.get(hashes[0]) if n else None
        out: dict[GroupId, int] = {}
        owner, p = self._owner, 0
        while r is not None:
            hs = r.hashes
            size = len(hs)
            m = min(size, n - p)
            k = m if hs[m - 1] == hashes[p + m - 1] else _equal_pages(hs, hashes, p, m)
            nxt = r.kids.get(hashes[p + size]) if k == size < n - p else None
            on = nxt.held if nxt is not None else ()
            for bit, c in r.held.items():
                if bit not in on:  # the group's match ends on this run
                    out[owner[bit]] = p + (c if c < k else k)
            p += size
            r = nxt
        return out

    # ---- writing -------------------------------------------------------------------

    def set_capacity(self, group: GroupId, capacity_pages: int) -> None:
        """Bounds `group` to `capacity_pages` pages (evicting LRU leaves at once)."""
        if not isinstance(capacity_pages, int) or capacity_pages <= 0:
            raise ValueError(f"capacity_pages must be a positive integer, got {capacity_pages!r}")
        self._capacity[group] = capacity_pages
        self._evict(group)

    def insert(self, group: GroupId, tokens: Sequence[int]) -> int:
        """Lists the full pages of `tokens` for `group`; see `insert_hashes`."""
        return self.insert_hashes(group, self.hashes(tokens))

    def insert_hashes(self, group: GroupId, hashes: Sequence[int]) -> int:
        """Lists the page chain `hashes` (from the root) for `group`, marks the whole path
        most recently used, evicts the group's LRU leaves past its capacity, and ticks the
        clock. A chain longer than the capacity is cut to it. Returns pages newly
        listed."""
        self._clock += 1
        gr = self._groups.get(group)
        if gr is None:
            gr = self._groups[group] = GroupRuns(self._new_bit(group))
        n = min(len(hashes), self.capacity(group))
        added = 0
        if n:
            added, run, pos = self._hold_path(gr, hashes, n)
            if run is not None:
                end_path(run.ticks.setdefault(gr.bit, []), pos, self._clock)
                if pos + 1 == run.held[gr.bit] and run.is_leaf_end(gr.bit):
                    gr.push_leaf(run, pos, self._clock)
            gr.pages += added
        self._evict(group)
        self.hasher.budget = 2 * self._nodes + MEMO_SPARE_PAGES
        return added

    def _hold_path(self, gr: GroupRuns, hashes: Sequence[int], n: int
                   ) -> tuple[int, Optional[PageRun], int]:
        """Lists `hashes[:n]` for the group: the runs on the path get its count, a run the
        path leaves in its middle is split there, and the pages no run holds extend the
        last run (when nothing hangs under it) or start a child run. Returns (pages newly
        listed, the run and position where the path ends; None if it is empty)."""
        bit = gr.bit
        r, par, p, added = self._roots.get(hashes[0]), None, 0, 0
        while r is not None:
            hs = r.hashes
            m = min(len(hs), n - p)
            k = m if hs[m - 1] == hashes[p + m - 1] else _equal_pages(hs, hashes, p, m)
            if k < len(hs) and p + k < n:
                self._split(r, k)  # the path leaves r after its page k-1
            c = r.held.get(bit, 0)
            if c < k:
                if not c:
                    gr.runs[r] = None
                    if par is not None:
                        par.nkids[bit] = par.nkids.get(bit, 0) + 1
                r.held[bit] = k
                added += k - c
            p += k
            if p == n:
                return added, r, k - 1
            par, r = r, r.kids.get(hashes[p])
        return self._grow(gr, par, hashes[p:n], added)

    def _grow(self, gr: GroupRuns, par: Optional[PageRun], new: Sequence[int], added: int
              ) -> tuple[int, Optional[PageRun], int]:
        """Lists `new` (non-empty), pages under the last page of `par` (None: first
        pages) that no run holds."""
        bit = gr.bit
        new = list(new)
        if par is not None and not par.kids:  # nothing hangs under par: extend it
            run = par
            run.hashes += new
        else:
            run = PageRun(new, par, par.depth0 + len(par.hashes) if par is not None else 0)
            (self._roots if par is None else par.kids)[new[0]] = run
            if par is not None:
                par.nkids[bit] = par.nkids.get(bit, 0) + 1
            gr.runs[run] = None
        self._nodes += len(new)
        run.held[bit] = run.held.get(bit, 0) + len(new)
        return added + len(new), run, len(run.hashes) - 1

    def _split(self, r: PageRun, k: int) -> None:
        """Cuts `r` after its page k-1 (0 < k < len): its pages from k on become a child
        run, carrying the groups' counts, child runs and stored ticks past the cut."""
        tail = PageRun(r.hashes[k:], r, r.depth0 + k)
        tail.cut_to, r.cut_to = r.cut_to, tail
        del r.hashes[k:]
        tail.kids, r.kids = r.kids, {tail.hashes[0]: tail}
        for kid in tail.kids.values():
            kid.parent = tail
        for bit, c in r.held.items():
            if c <= k:
                continue
            tail.held[bit], r.held[bit] = c - k, k
            self._groups[self._owner[bit]].runs[tail] = None
            nk = r.nkids.pop(bit, None)
            if nk:
                tail.nkids[bit] = nk
            r.nkids[bit] = 1
            entries = r.ticks.get(bit)
            if entries and entries[-1][0] >= k:
                i = next(j for j, (q, _) in enumerate(entries) if q >= k)
                tail.ticks[bit] = [(q - k, t) for q, t in entries[i:]]
                del entries[i:]

    def remove_group(self, group: GroupId) -> int:
        """Forgets every page of `group`; returns how many it had."""
        gr = self._groups.pop(group, None)
        self._capacity.pop(group, None)
        if gr is None:
            return 0
        del self._owner[gr.bit]
        self._free_bits.append(gr.bit)
        self._remove_runs(gr)
        return gr.pages

    def clear(self) -> None:
        for d in (self._roots, self._groups, self._owner):
            d.clear()
        self._nodes = 0
        self._free_bits.clear()
        self.hasher.clear()

    # ---- internals -----------------------------------------------------------------

    def _new_bit(self, group: GroupId) -> int:
        bit = self._free_bits.pop() if self._free_bits else 1 << len(self._owner)
        self._owner[bit] = group
        return bit

    def _evict(self, group: GroupId) -> None:
        gr = self._groups.get(group)
        if gr:
            over = gr.pages - self.capacity(group)
            if over > 0:
                self._evict_pages(gr, over)

    # ---- checking ------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Asserts the invariants of the module docstring; O(nodes + runs x groups)."""
        check_prefix_tree(self)


__all__ = ["GroupId", "PrefixTree", "page_hashes"]
