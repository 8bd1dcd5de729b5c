"""An approximate prefix tree of what each group (DP group or prefill instance) caches.

Built from the token prefixes the router sent to each group, at page granularity: a node
is one full page, named by the same chain hash the ranks' block pools use
(`page_hashes`: hash(parent hash, page tokens)), so a node names its whole prefix and a
rank's report of the hashes it holds can be matched against the tree directly. It is
approximate: a rank may have evicted what the tree still lists until the next `refresh`.

Invariants (asserted by `check_integrity`):
- every node has at least one holder, and its parent (if any) is a node that lists it
  as a child; children point back to their parent;
- prefix closure: a group holding a node holds its parent (so a group's pages form a
  subtree hanging from the root, and a match walks down one path);
- `h in lru[g]` exactly when `g in node(h).holders`; `len(lru[g]) <= capacity(g)`;
- LRU order: in `lru[g]` (least recent first) every node comes before its parent, so the
  least recent entry is always a leaf of g's subtree and evicting it keeps closure.
  (A touch moves the path to the end leaf first, root last.)
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from typing import Collection, Hashable, Optional, Sequence

GroupId = Hashable


def page_hashes(tokens: Sequence[int], page_size: int,
                parent: Optional[int] = None) -> list[int]:
    """Chain hashes of the full pages of `tokens` (a partial last page is left out).

    Bit-identical to `phalanx.engine.block_pool.hash_pages` (blake2b-64 of the parent's
    8 little-endian bytes and the page's tokens as little-endian int64), without numpy.
    """
    n = len(tokens) // page_size * page_size
    if n == 0:
        return []
    data = struct.pack(f"<{n}q", *tokens[:n])
    step = 8 * page_size
    blake, from_bytes = hashlib.blake2b, int.from_bytes
    prev = b"" if parent is None else parent.to_bytes(8, "little")
    out: list[int] = []
    for off in range(0, 8 * n, step):
        prev = blake(prev + data[off:off + step], digest_size=8).digest()
        out.append(from_bytes(prev, "little"))
    return out


class _Node:
    __slots__ = ("parent", "children", "holders")

    def __init__(self, parent: Optional[int]) -> None:
        self.parent = parent
        self.children: set[int] = set()
        self.holders: set[GroupId] = set()


class PrefixTree:
    """Page-granular prefix tree over many groups (see the module docstring).

    `capacity_pages` bounds the pages listed per group (LRU eviction of leaves); a group
    may get its own bound with `set_capacity`. A logical `clock` ticks once per insert;
    `refresh(..., as_of=t)` keeps what was touched after tick t.
    """

    def __init__(self, page_size: int, capacity_pages: int) -> None:
        if not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        if not isinstance(capacity_pages, int) or capacity_pages <= 0:
            raise ValueError(f"capacity_pages must be a positive integer, got {capacity_pages!r}")
        self.page_size = page_size
        self.capacity_pages = capacity_pages
        self._nodes: dict[int, _Node] = {}
        self._lru: dict[GroupId, OrderedDict[int, int]] = {}  # group -> hash -> last tick
        self._capacity: dict[GroupId, int] = {}
        self._clock = 0

    # ---- reading -------------------------------------------------------------------

    @property
    def clock(self) -> int:
        """The current logical time (number of inserts so far)."""
        return self._clock

    def hashes(self, tokens: Sequence[int]) -> list[int]:
        """Chain hashes of the full pages of `tokens`."""
        return page_hashes(tokens, self.page_size)

    def groups(self) -> list[GroupId]:
        """Groups that hold at least one page, in first-insert order."""
        return [g for g, lru in self._lru.items() if lru]

    def pages(self, group: GroupId) -> int:
        """Number of pages listed for `group`."""
        lru = self._lru.get(group)
        return len(lru) if lru else 0

    def num_nodes(self) -> int:
        return len(self._nodes)

    def capacity(self, group: GroupId) -> int:
        return self._capacity.get(group, self.capacity_pages)

    def held_hashes(self, group: GroupId) -> set[int]:
        """The page hashes listed for `group`."""
        return set(self._lru.get(group, ()))

    def match(self, tokens: Sequence[int]) -> dict[GroupId, int]:
        """Tokens of the longest listed prefix of `tokens`, per group (groups with no
        match are absent). Read-only: touches no LRU state."""
        return self.match_hashes(self.hashes(tokens))

    def match_hashes(self, hashes: Sequence[int]) -> dict[GroupId, int]:
        """`match` from precomputed chain hashes; O(len(hashes) + groups)."""
        pages = self.match_pages(hashes)
        ps = self.page_size
        return {g: n * ps for g, n in pages.items()}

    def match_pages(self, hashes: Sequence[int]) -> dict[GroupId, int]:
        """Matched full pages per group (absent: none). Walks one path of the tree; by
        prefix closure the holders shrink along it, so a group's match ends where it
        stops being a holder."""
        out: dict[GroupId, int] = {}
        nodes = self._nodes
        alive: set[GroupId] = set()
        prev: Optional[int] = None
        depth = 0
        for h in hashes:
            node = nodes.get(h)
            if node is None or node.parent != prev:
                break
            holders = node.holders
            if depth and len(holders) != len(alive):
                for g in alive:
                    if g not in holders:
                        out[g] = depth
            alive = holders
            prev = h
            depth += 1
        for g in alive:
            out[g] = depth
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
        clock. A chain longer than the capacity is cut to it. Returns pages newly listed.
        """
        self._clock += 1
        lru = self._lru.setdefault(group, OrderedDict())
        path = self._build_path(hashes[:self.capacity(group)])
        added = 0
        tick = self._clock
        for h in reversed(path):  # leaf first: parents end up more recent than children
            node = self._nodes[h]
            if group not in node.holders:
                node.holders.add(group)
                added += 1
            lru[h] = tick
            lru.move_to_end(h)
        self._evict(group)
        return added

    def _build_path(self, hashes: Sequence[int]) -> list[int]:
        """Creates the missing nodes of a chain; returns the prefix of `hashes` that is now
        a path in the tree (it stops at a hash already used under another parent, i.e. a
        64-bit collision, which is left alone)."""
        nodes = self._nodes
        prev: Optional[int] = None
        for i, h in enumerate(hashes):
            node = nodes.get(h)
            if node is None:
                nodes[h] = _Node(prev)
                if prev is not None:
                    nodes[prev].children.add(h)
            elif node.parent != prev:
                return list(hashes[:i])
            prev = h
        return list(hashes)

    def refresh(self, group: GroupId, held: Collection[int], as_of: Optional[int] = None) -> int:
        """Reconciles `group` with the page hashes it reports holding: every listed page
        not in `held` is dropped with its subtree of the group, except pages touched after
        tick `as_of` (routed after the report was taken; None: no exception). Pages in
        `held` that the tree never listed are not added (their chain is unknown).
        Returns the number of pages dropped."""
        lru = self._lru.get(group)
        if not lru:
            return 0
        held = held if isinstance(held, (set, frozenset, dict)) else set(held)
        stale = [h for h, t in lru.items()
                 if h not in held and (as_of is None or t <= as_of)]
        return sum(self._drop_subtree(group, h) for h in stale)

    def forget(self, group: GroupId, evicted: Collection[int], as_of: Optional[int] = None) -> int:
        """Drops the pages `group` reports it evicted (with their subtrees of the group),
        except pages touched after tick `as_of` (as in `refresh`). Returns the number
        of pages dropped: the incremental form of `refresh`."""
        lru = self._lru.get(group)
        if not lru:
            return 0
        stale = [h for h in evicted if h in lru and (as_of is None or lru[h] <= as_of)]
        return sum(self._drop_subtree(group, h) for h in stale)

    def remove_group(self, group: GroupId) -> int:
        """Forgets every page of `group`; returns how many it had."""
        lru = self._lru.pop(group, None)
        self._capacity.pop(group, None)
        if not lru:
            return 0
        for h in lru:  # children before parents (LRU order), so nodes empty leaf-first
            self._release(group, h)
        return len(lru)

    def clear(self) -> None:
        self._nodes.clear()
        self._lru.clear()

    def _drop_subtree(self, group: GroupId, root: int) -> int:
        """Drops `root` and its descendants from `group`; returns pages dropped."""
        lru = self._lru[group]
        if root not in lru:
            return 0
        order: list[int] = []
        stack = [root]
        while stack:
            h = stack.pop()
            order.append(h)
            stack.extend(c for c in self._nodes[h].children if c in lru)
        for h in reversed(order):  # descendants before ancestors
            del lru[h]
            self._release(group, h)
        return len(order)

    def _evict(self, group: GroupId) -> None:
        lru = self._lru.get(group)
        if not lru:
            return
        cap = self.capacity(group)
        while len(lru) > cap:
            h, _ = lru.popitem(last=False)  # a leaf of the group's subtree (LRU order)
            self._release(group, h)

    def _release(self, group: GroupId, h: int) -> None:
        """Removes `group` from node `h`'s holders and deletes the node once unheld
        (its children are unheld too, by closure, hence already gone)."""
        node = self._nodes[h]
        node.holders.discard(group)
        if not node.holders:
            del self._nodes[h]
            if node.parent is not None:
                self._nodes[node.parent].children.discard(h)

    # ---- checking ------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Asserts the invariants of the module docstring; O(nodes + listed pages)."""
        nodes = self._nodes
        for h, node in nodes.items():
            assert node.holders, f"node {h:#x} has no holder"
            if node.parent is not None:
                parent = nodes.get(node.parent)
                assert parent is not None, f"node {h:#x}: parent {node.parent:#x} missing"
                assert h in parent.children, f"node {h:#x} not a child of its parent"
                assert node.holders <= parent.holders, \
                    f"node {h:#x}: holders {node.holders} not within its parent's"
            for c in node.children:
                assert c in nodes and nodes[c].parent == h, f"bad child {c:#x} of {h:#x}"
            for g in node.holders:
                assert h in self._lru.get(g, ()), f"node {h:#x} held by {g!r} not in its LRU"
        for g, lru in self._lru.items():
            assert len(lru) <= self.capacity(g), f"group {g!r} over capacity"
            pos = {h: i for i, h in enumerate(lru)}
            last_tick = 0
            for h, tick in lru.items():
                assert h in nodes and g in nodes[h].holders, f"{g!r} lists a foreign page"
                assert tick >= last_tick, f"group {g!r}: LRU ticks out of order"
                last_tick = tick
                parent = nodes[h].parent
                assert parent is None or pos.get(parent, -1) > pos[h], \
                    f"group {g!r}: page {h:#x} is not before its parent in LRU order"
        assert sum(len(n.holders) for n in nodes.values()) == \
            sum(len(lru) for lru in self._lru.values()), "holder count mismatch"


__all__ = ["GroupId", "PrefixTree", "page_hashes"]
