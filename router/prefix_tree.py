"""An approximate prefix tree of what each group (DP group or prefill instance) caches.

Built from the token prefixes the router sent to each group, at page granularity: a node
is one full page, named by the same chain hash the ranks' block pools use
(`page_hashes`: hash(parent hash, page tokens)), so a node names its whole prefix and a
rank's report of the hashes it holds can be matched against the tree directly. It is
approximate: a rank may have evicted what the tree still lists until the next `refresh`.

Layout (flat dicts keyed by chain hash, so a page costs no object of its own and nothing
the garbage collector must scan): `_parent[h]` (None for a first page), `_holders[h]` a
bitmask of the groups listing the page (`GroupPages.bit`), `_kids` the children lists
(`ChildLinks`). Each group's pages and their LRU order are a `GroupPages` (lazy ticks:
touching a path is O(1)).

Invariants (asserted by `check_integrity`):
- every node has at least one holder, and its parent (if any) is a node that lists it
  as a child; children point back to their parent;
- prefix closure: a group holding a node holds its parent (so a group's pages form a
  subtree hanging from the root, and a match walks down one path);
- `h in pages(g)` exactly when g's bit is in `_holders[h]`; `len(pages(g)) <= capacity(g)`;
- LRU: a page's tick (the last insert that covered it) is never below its children's, so
  the least recent page is a leaf and evicting it keeps closure (see `GroupPages`).

Matching is incremental: the prompt's hashes come from `PageHasher` (pages seen before
are not hashed again), and by prefix closure each group's match is found by bisecting the
path, not walking it. A chain whose hash collides (64 bits) with another chain's may
match past the collision, as the ranks' block pools would.
"""

from __future__ import annotations

from itertools import repeat
from operator import or_
from typing import Collection, Hashable, Iterator, Optional, Sequence

from .child_links import ChildLinks
from .group_pages import GroupPages
from .page_hasher import PageHasher, page_hashes
from .tree_invariants import check_prefix_tree

GroupId = Hashable

MEMO_SPARE_PAGES = 4096  # the hasher remembers up to 2 x nodes + this many pages


class PrefixTree:
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
        self._parent: dict[int, Optional[int]] = {}
        self._holders: dict[int, int] = {}
        self._kids = ChildLinks()
        self._groups: dict[GroupId, GroupPages] = {}  # in first-insert order
        self._owner: dict[int, GroupId] = {}  # bit -> group
        self._free_bits: list[int] = []
        self._capacity: dict[GroupId, int] = {}
        self._clock = 0

    # ---- reading -------------------------------------------------------------------

    @property
    def clock(self) -> int:
        """The current logical time (number of inserts so far)."""
        return self._clock

    def hashes(self, tokens: Sequence[int], remember: bool = True) -> list[int]:
        """Chain hashes of the full pages of `tokens` (remembered for later calls)."""
        return self.hasher.hashes(tokens, remember=remember)

    def groups(self) -> list[GroupId]:
        """Groups that hold at least one page, in first-insert order."""
        return [g for g, gp in self._groups.items() if gp]

    def pages(self, group: GroupId) -> int:
        """Number of pages listed for `group`."""
        gp = self._groups.get(group)
        return len(gp) if gp else 0

    def num_nodes(self) -> int:
        return len(self._parent)

    def capacity(self, group: GroupId) -> int:
        return self._capacity.get(group, self.capacity_pages)

    def held_hashes(self, group: GroupId) -> set[int]:
        """The page hashes listed for `group`."""
        gp = self._groups.get(group)
        return set(gp.ticks) if gp else set()

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
        """Matched full pages per group (absent: none). By prefix closure the holders
        shrink along the path, so the path is bisected where they change:
        O(changes x log(len(hashes))) lookups. (Only the ends of the path check that a
        node hangs under the previous page: between them, a hash of the path that names
        a node elsewhere would be a 64-bit collision, and would only skew the estimate.)"""
        n = len(hashes)
        holders = self._holders
        m0 = self._mask(hashes, 0) if n else 0
        if not m0:
            return {}
        out: dict[GroupId, int] = {}
        m_end = self._mask(hashes, n - 1)
        if m_end:
            self._name_bits(m_end, n, out)
        get = holders.get
        lo, m_lo = 0, m0
        while m_lo != m_end:  # the next page past `lo` where the holders change
            a, b, m_b = lo, n - 1, m_end  # holders are m_lo at page a, differ at page b
            while b - a > 1:
                mid = (a + b) >> 1
                m = get(hashes[mid], 0)
                if m == m_lo:
                    a = mid
                else:
                    b, m_b = mid, m
            self._name_bits(m_lo & ~m_b, b, out)  # listed at page b-1, not at page b
            lo, m_lo = b, m_b
        return out

    def _mask(self, hashes: Sequence[int], i: int) -> int:
        """Holders of page i of the chain `hashes` (0: no such node under page i-1)."""
        h = hashes[i]
        m = self._holders.get(h, 0)
        if m and self._parent[h] != (hashes[i - 1] if i else None):
            return 0  # the hash is a node under another parent (a collision)
        return m

    def _name_bits(self, mask: int, depth: int, out: dict[GroupId, int]) -> None:
        owner = self._owner
        while mask:
            b = mask & -mask
            out[owner[b]] = depth
            mask ^= b

    def _listed_depth(self, bit: int, hashes: Sequence[int], n: int,
                      hint: Optional[int] = None) -> int:
        """Pages of `hashes[:n]` listed for the group of `bit` (a prefix, by closure);
        `hint`, a guess (e.g. from `match_pages`), is checked with two lookups."""
        mask = self._mask
        if hint is not None and 0 <= hint <= n and (hint == 0 or mask(hashes, hint - 1) & bit) \
                and (hint == n or not mask(hashes, hint) & bit):
            return hint
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if mask(hashes, mid - 1) & bit:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _known_depth(self, hashes: Sequence[int], lo: int, hi: int) -> int:
        """The first i in [lo, hi) where hashes[i] is no node (hi: none such); the nodes
        of a chain are a prefix of it (a node's parent is one), so this bisects."""
        holders = self._holders
        if lo >= hi or hashes[lo] not in holders:
            return lo
        if hashes[hi - 1] in holders:
            return hi
        a, b = lo, hi - 1  # a node at a, none at b
        while b - a > 1:
            mid = (a + b) >> 1
            if hashes[mid] in holders:
                a = mid
            else:
                b = mid
        return b

    def children(self, h: int) -> Iterator[int]:
        """The child nodes of node `h`."""
        return self._kids.children(h)

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

    def insert_hashes(self, group: GroupId, hashes: Sequence[int], *,
                      listed_hint: Optional[int] = None) -> int:
        """Lists the page chain `hashes` (from the root) for `group`, marks the whole path
        most recently used, evicts the group's LRU leaves past its capacity, and ticks the
        clock. A chain longer than the capacity is cut to it, and a chain reaching a hash
        already used under another parent (a 64-bit collision) stops before it. Returns
        pages newly listed. `listed_hint`: how many pages `match_pages` found listed."""
        self._clock += 1
        gp = self._groups.get(group)
        if gp is None:
            gp = self._groups[group] = GroupPages(self._new_bit(group))
        n = min(len(hashes), self.capacity(group))
        bit = gp.bit
        start = self._listed_depth(bit, hashes, n, listed_hint)
        n = self._hold_chain(bit, hashes, start, n)
        if n > start:
            gp.add_chain(hashes[start:n], hashes[start - 1] if start else None)
        if n:
            gp.end_path(hashes[n - 1], self._clock)
        self._evict(group)
        self.hasher.budget = 2 * len(self._parent) + MEMO_SPARE_PAGES
        return max(0, n - start)

    def _hold_chain(self, bit: int, hashes: Sequence[int], start: int, n: int) -> int:
        """Adds `bit` to the holders of pages start..n-1 of the chain `hashes` (page
        start-1 already has it), creating the nodes no group lists. Returns where the chain
        ends: n, or the first page whose hash is a node under another parent (a
        collision), which is left alone."""
        holders, parent = self._holders, self._parent
        prev = hashes[start - 1] if start else None
        i = self._known_depth(hashes, start, n)
        seen = hashes[start:i]  # pages other groups list: add this one, in bulk
        if seen and parent[seen[0]] == prev and list(map(parent.get, seen[1:])) == seen[:-1]:
            holders.update(zip(seen, map(or_, map(holders.__getitem__, seen), repeat(bit))))
            prev = seen[-1]
        else:  # one by one, stopping at a collision (a hash listed under another parent)
            i = start
            while i < n:
                h = hashes[i]
                m = holders.get(h)
                if m is None:
                    break
                if parent[h] != prev:
                    n = i
                    break
                holders[h] = m | bit
                prev = h
                i += 1
        if i < n:  # pages no group lists: new nodes, each the only child of the previous
            new = hashes[i:n]
            if any(map(holders.__contains__, new)):  # a collision further down
                n = i + next(j for j, h in enumerate(new) if h in holders)
                new = hashes[i:n]
            if new:
                holders.update(dict.fromkeys(new, bit))
                parent[new[0]] = prev
                parent.update(zip(new[1:], new))
                self._kids.first.update(zip(new, new[1:]))
                if prev is not None:
                    self._kids.link(new[0], prev)
        return n

    def refresh(self, group: GroupId, held: Collection[int], as_of: Optional[int] = None) -> int:
        """Reconciles `group` with the page hashes it reports holding: every listed page
        not in `held` is dropped with its subtree of the group, except pages touched after
        tick `as_of` (routed after the report was taken; None: no exception). Pages in
        `held` that the tree never listed are not added (their chain is unknown).
        Returns the number of pages dropped."""
        gp = self._groups.get(group)
        if not gp:
            return 0
        held = held if isinstance(held, (set, frozenset, dict)) else set(held)
        recent = gp.touched_after_all(as_of, self._parent.__getitem__) \
            if as_of is not None else ()
        stale = [h for h in gp.ticks if h not in held and h not in recent]
        return sum(self._drop_subtree(gp, h) for h in stale)

    def forget(self, group: GroupId, evicted: Collection[int], as_of: Optional[int] = None) -> int:
        """Drops the pages `group` reports it evicted (with their subtrees of the group),
        except pages touched after tick `as_of` (as in `refresh`). Returns the number
        of pages dropped: the incremental form of `refresh`."""
        gp = self._groups.get(group)
        if not gp:
            return 0
        dropped = 0
        for h in evicted:
            if h in gp.ticks and (as_of is None or
                                  not gp.touched_after(h, as_of, self.children)):
                dropped += self._drop_subtree(gp, h)
        return dropped

    def remove_group(self, group: GroupId) -> int:
        """Forgets every page of `group`; returns how many it had."""
        gp = self._groups.pop(group, None)
        self._capacity.pop(group, None)
        if gp is None:
            return 0
        del self._owner[gp.bit]
        self._free_bits.append(gp.bit)
        holders, keep = self._holders, ~gp.bit
        doomed: list[int] = []
        for h in gp.ticks:
            m = holders[h] & keep
            if m:
                holders[h] = m
            else:
                doomed.append(h)
        gone = set(doomed)  # closed downwards: an unheld node's children are unheld
        for h in doomed:
            p = self._parent.pop(h)
            del holders[h]
            if p is not None and p not in gone:
                self._kids.unlink(h, p)
            self._kids.forget(h)
        return len(gp)

    def clear(self) -> None:
        for d in (self._parent, self._holders, self._groups, self._owner):
            d.clear()
        self._kids.clear()
        self._free_bits.clear()
        self.hasher.clear()

    # ---- internals -----------------------------------------------------------------

    def _new_bit(self, group: GroupId) -> int:
        bit = self._free_bits.pop() if self._free_bits else 1 << len(self._owner)
        self._owner[bit] = group
        return bit

    def _unhold(self, h: int, bit: int) -> None:
        """Clears `bit` from node `h`, deleting the node once no group lists it (its
        children are unheld too, by closure, hence already gone)."""
        m = self._holders[h] & ~bit
        if m:
            self._holders[h] = m
            return
        del self._holders[h]
        p = self._parent.pop(h)
        if p is not None:
            self._kids.unlink(h, p)

    def _drop_subtree(self, gp: GroupPages, root: int) -> int:
        """Unlists `root` and its listed descendants for `gp`'s group; returns how many."""
        ticks = gp.ticks
        if root not in ticks:
            return 0
        order: list[int] = []
        stack = [root]
        while stack:
            h = stack.pop()
            order.append(h)
            if h in gp.kids:
                stack.extend(c for c in self.children(h) if c in ticks)
        order.reverse()  # descendants before ancestors
        n = gp.remove_subtree(order, self._parent[root])
        for h in order:
            self._unhold(h, gp.bit)
        return n

    def _evict(self, group: GroupId) -> None:
        gp = self._groups.get(group)
        if not gp:
            return
        over = len(gp) - self.capacity(group)
        if over <= 0:
            return
        gone = gp.evict(over, self._parent)
        assert len(gone) == over, "a group over capacity has leaves to evict"
        holders, parent, keep = self._holders, self._parent, ~gp.bit
        kids = self._kids
        first, prev, nxt = kids.first, kids.prev, kids.next
        for h in gone:  # children before parents
            m = holders[h] & keep
            if m:
                holders[h] = m
                continue
            del holders[h]  # no holder left: the node goes (its children went before)
            p = parent.pop(h)
            if p is None:
                continue
            if h in prev or h in nxt:
                kids.unlink(h, p)
            else:
                del first[p]  # h was p's only child

    # ---- checking ------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Asserts the invariants of the module docstring; O(nodes + listed pages)."""
        check_prefix_tree(self)


__all__ = ["GroupId", "PrefixTree", "page_hashes"]
