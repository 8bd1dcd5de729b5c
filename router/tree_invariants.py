"""The invariants of a `PrefixTree` (its module docstring), asserted on its internals:
what `PrefixTree.check_integrity` runs, in tests and after random operation sequences.
O(nodes + listed pages); never on a serving path.
"""

from __future__ import annotations

from typing import Any


def check_prefix_tree(tree: Any) -> None:
    """AssertionError naming the first broken invariant of `tree` (a `PrefixTree`; not
    imported here, which would make a cycle), if any."""
    parent, holders = tree._parent, tree._holders
    assert parent.keys() == holders.keys(), "node tables disagree"
    tree._kids.check(parent)
    all_bits = 0
    for bit, g in tree._owner.items():
        assert tree._groups[g].bit == bit, f"bit {bit} of {g!r} is not its group's"
        all_bits |= bit
    for h, p in parent.items():
        m = holders[h]
        assert m and not m & ~all_bits, f"node {h:#x}: bad holders {m:#x}"
        if p is not None:
            assert p in parent, f"node {h:#x}: parent {p:#x} missing"
            assert h in set(tree.children(p)), f"node {h:#x} not a child of its parent"
            assert not m & ~holders[p], f"node {h:#x}: holders not within its parent's"
        kids = list(tree.children(h))
        assert len(kids) == len(set(kids)), f"node {h:#x}: a child listed twice"
        for c in kids:
            assert parent.get(c) == h, f"bad child {c:#x} of {h:#x}"
    for g, gp in tree._groups.items():
        assert len(gp) <= tree.capacity(g), f"group {g!r} over capacity"
        listed = {h for h, m in holders.items() if m & gp.bit}
        assert listed == set(gp.ticks), f"group {g!r}: listed pages != holder bits"
        for h in gp.ticks:
            n = sum(1 for c in tree.children(h) if c in gp.ticks)
            assert gp.kids.get(h, 0) == n, f"group {g!r}: child count of {h:#x}"
        assert not set(gp.kids) - set(gp.ticks), f"group {g!r}: counts of unlisted pages"
        gp.check()


__all__ = ["check_prefix_tree"]
