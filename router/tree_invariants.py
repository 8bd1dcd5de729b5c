"""The invariants of a `PrefixTree` (its module docstring and page_runs.py's), asserted on
its internals: what `PrefixTree.check_integrity` runs, in tests and after random
operation sequences. O(nodes + runs x groups); never on a serving path.
"""

from __future__ import annotations

from typing import Any


def _runs(tree: Any) -> list[Any]:
    """Every run reachable from the roots, parents before children; checks the links."""
    out, stack = [], [(r, None) for r in tree._roots.values()]
    while stack:
        r, par = stack.pop()
        assert r.hashes, "an empty run"
        assert r.parent is par, f"run at {r.hashes[0]:#x}: wrong parent"
        want = 0 if par is None else par.depth0 + len(par.hashes)
        assert r.depth0 == want, f"run at {r.hashes[0]:#x}: depth {r.depth0} != {want}"
        home = tree._roots if par is None else par.kids
        assert home.get(r.hashes[0]) is r, f"run at {r.hashes[0]:#x}: not keyed by its first page"
        out.append(r)
        stack.extend((k, r) for k in r.kids.values())
    return out


def _check_run(tree: Any, r: Any, all_bits: int) -> None:
    size = len(r.hashes)
    assert r.held and max(r.held.values()) == size, \
        f"run at {r.hashes[0]:#x}: a page no group lists, or none listed"
    for bit, c in r.held.items():
        assert bit & all_bits and 0 < c <= size, f"run at {r.hashes[0]:#x}: bad count"
        if r.parent is not None:
            assert r.parent.held.get(bit) == len(r.parent.hashes), "prefix closure broken"
        kids = sum(1 for k in r.kids.values() if bit in k.held)
        assert r.nkids.get(bit, 0) == kids, f"run at {r.hashes[0]:#x}: child count"
        entries = r.ticks.get(bit, [])
        assert [p for p, _ in entries] == sorted({p for p, _ in entries}), "tick order"
        assert all(0 <= p < c and t >= 1 for p, t in entries), "a tick off the listed pages"
        if r.is_leaf_end(bit):
            assert entries and entries[-1][0] == c - 1, f"leaf of run {r.hashes[0]:#x}: no tick"
    assert not set(r.nkids) - set(r.held) and not set(r.ticks) - set(r.held), "stray group data"


def check_prefix_tree(tree: Any) -> None:
    """AssertionError naming the first broken invariant of `tree` (a `PrefixTree`; not
    imported here, which would make a cycle), if any."""
    runs = _runs(tree)
    assert sum(len(r.hashes) for r in runs) == tree.num_nodes(), "node count"
    all_bits = 0
    for bit, g in tree._owner.items():
        assert tree._groups[g].bit == bit, f"bit {bit} of {g!r} is not its group's"
        all_bits |= bit
    for r in runs:
        _check_run(tree, r, all_bits)
    for g, gr in tree._groups.items():
        mine = [r for r in runs if gr.bit in r.held]
        assert set(mine) == set(gr.runs), f"group {g!r}: its runs"
        assert gr.pages == sum(r.held[gr.bit] for r in mine), f"group {g!r}: page count"
        assert gr.pages <= tree.capacity(g), f"group {g!r} over capacity"
        leaves = {(t, d, id(r)) for t, d, _, r in gr.leaf_entries()}
        found = {(t, d, id(r.holding(d))) for t, d, _, r in gr.heap}
        assert leaves <= found, f"group {g!r}: a leaf missing from the heap"


__all__ = ["check_prefix_tree"]
