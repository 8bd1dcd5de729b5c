"""The children of every node of a prefix tree, as doubly linked lists kept in flat dicts
keyed by page hash: `first[p]` is one child of `p` (absent: `p` has none), `next[c]` /
`prev[c]` the siblings around `c` (absent at either end). No object per node, so a page
costs the garbage collector nothing, and most nodes (the inside of a chain: one child)
have a `first` entry only. Adding and removing a child are O(1).
"""

from __future__ import annotations

from typing import Iterable, Iterator


class ChildLinks:
    """Children lists of a tree's nodes (module docstring). The owner keeps the parents;
    the dicts are public for its bulk updates (a new chain: `first` from each node to the
    next)."""

    __slots__ = ("first", "next", "prev")

    def __init__(self) -> None:
        self.first: dict[int, int] = {}
        self.next: dict[int, int] = {}
        self.prev: dict[int, int] = {}

    def children(self, p: int) -> Iterator[int]:
        c = self.first.get(p)
        nxt = self.next
        while c is not None:
            yield c
            c = nxt.get(c)

    def link(self, c: int, p: int) -> None:
        """Makes `c` (in no list) a child of `p`, the first one."""
        old = self.first.get(p)
        self.first[p] = c
        if old is not None:
            self.next[c] = old
            self.prev[old] = c

    def unlink(self, c: int, p: int) -> None:
        """Takes child `c` out of `p`'s list."""
        pv = self.prev.pop(c, None)
        nx = self.next.pop(c, None)
        if pv is None:
            if nx is None:
                del self.first[p]
            else:
                self.first[p] = nx
                del self.prev[nx]
        else:
            if nx is None:
                del self.next[pv]
            else:
                self.next[pv] = nx
                self.prev[nx] = pv

    def forget(self, c: int) -> None:
        """Drops every entry of `c` without mending its siblings' (they go too: `c` and
        its whole family of siblings are being removed with their parent)."""
        self.first.pop(c, None)
        self.next.pop(c, None)
        self.prev.pop(c, None)

    def clear(self) -> None:
        self.first.clear()
        self.next.clear()
        self.prev.clear()

    def check(self, nodes: Iterable[int]) -> None:
        """Asserts that every entry names a node of `nodes` and that sibling links agree."""
        nodes = set(nodes)
        assert set(self.first) | set(self.next) | set(self.prev) <= nodes, \
            "a child link names a missing node"
        for c, nx in self.next.items():
            assert self.prev.get(nx) == c, f"sibling links of {c:#x}"
        for c, pv in self.prev.items():
            assert self.next.get(pv) == c, f"sibling links of {c:#x}"


__all__ = ["ChildLinks"]
