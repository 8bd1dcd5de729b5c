"""PrefixTree: matching, eviction, refresh, group removal; invariants under random use."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phalanx.router import PrefixTree, page_hashes

PS = 4


def toks(*pages: int, ps: int = PS) -> list[int]:
    """Tokens of pages given by a small id each (page i = [i]*ps)."""
    return [p for p in pages for _ in range(ps)]


def test_page_hashes_equal_the_block_pools():
    from phalanx.engine.block_pool import hash_pages
    t = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 123456789]
    for ps in (1, 3, 4, 16):
        assert page_hashes(t, ps) == hash_pages(t, ps, None)
        assert page_hashes(t, ps, parent=0xDEADBEEF) == hash_pages(t, ps, 0xDEADBEEF)
    assert page_hashes(t[:3], 4) == []


def test_match_counts_full_pages_per_group():
    tree = PrefixTree(PS, 100)
    tree.insert("a", toks(1, 2, 3))
    tree.insert("b", toks(1, 2, 7) + [9])  # the partial page is not listed
    tree.check_integrity()
    assert tree.match(toks(1, 2, 3, 4)) == {"a": 12, "b": 8}
    assert tree.match(toks(1, 2, 7) + [9, 9, 9, 9]) == {"a": 8, "b": 12}
    assert tree.match(toks(1) + [0]) == {"a": 4, "b": 4}
    assert tree.match(toks(2, 1)) == {}
    assert tree.match([1, 1]) == {}
    assert tree.pages("a") == 3 and tree.pages("b") == 3 and tree.num_nodes() == 4


def test_lru_evicts_leaves_of_the_least_recent_branch():
    tree = PrefixTree(PS, 4)
    tree.insert("g", toks(1, 2, 3))
    tree.insert("g", toks(1, 5))  # 1 is shared: 4 pages, at capacity
    tree.insert("g", toks(1, 2, 3))  # touch the first branch again
    tree.insert("g", toks(8))  # over capacity: the leaf of the least recent branch goes
    tree.check_integrity()
    assert tree.match(toks(1, 5)) == {"g": 4}
    assert tree.match(toks(1, 2, 3)) == {"g": 12}
    assert tree.pages("g") == 4


def test_eviction_of_several_pages_takes_them_in_lru_order():
    """Pages go least recent first even when several leave at once: a chain's parent that
    a later insert touched waits its turn behind an older leaf elsewhere."""
    tree = PrefixTree(PS, 100)
    tree.insert("g", toks(1, 2, 3))  # tick 1
    tree.insert("g", toks(4))  # tick 2
    tree.insert("g", toks(1, 2))  # tick 3: pages 1 and 2 are newer than 4, page 3 is not
    tree.set_capacity("g", 2)  # two leave: page 3 (tick 1), then page 4 (tick 2)
    tree.check_integrity()
    assert tree.match(toks(1, 2, 3)) == {"g": 8} and tree.match(toks(4)) == {}


def test_a_dropped_subtree_leaves_its_recency_to_its_parent():
    tree = PrefixTree(PS, 100)
    tree.insert("g", toks(1, 2))  # tick 1
    tree.insert("g", toks(5))  # tick 2
    tree.insert("g", toks(1, 2, 3))  # tick 3
    h3 = page_hashes(toks(1, 2, 3), PS)[2]
    assert tree.forget("g", [h3]) == 1  # page 3 goes; pages 1-2 were still used at tick 3
    tree.set_capacity("g", 2)  # so page 5 (tick 2) is the least recent
    tree.check_integrity()
    assert tree.match(toks(1, 2)) == {"g": 8} and tree.match(toks(5)) == {}


def test_a_chain_longer_than_capacity_is_cut():
    tree = PrefixTree(PS, 3)
    assert tree.insert("g", toks(1, 2, 3, 4, 5)) == 3
    tree.check_integrity()
    assert tree.match(toks(1, 2, 3, 4, 5)) == {"g": 12}


def test_refresh_drops_what_is_no_longer_held_with_its_subtree():
    tree = PrefixTree(PS, 100)
    tree.insert("g", toks(1, 2, 3))
    tree.insert("g", toks(1, 4))
    tree.insert("h", toks(1, 2, 3))
    h1, h2, h3 = page_hashes(toks(1, 2, 3), PS)
    h4 = page_hashes(toks(1, 4), PS)[1]
    # g reports page 3 but not page 2: 2 goes, and 3 with it (no match can reach it)
    assert tree.refresh("g", {h1, h3, h4}) == 2
    tree.check_integrity()
    assert tree.match(toks(1, 2, 3)) == {"g": 4, "h": 12}
    assert tree.match(toks(1, 4)) == {"g": 8, "h": 4}
    assert tree.refresh("g", []) == 2
    assert tree.match(toks(1, 4)) == {"h": 4}
    tree.check_integrity()


def test_refresh_keeps_pages_routed_after_the_report_was_taken():
    tree = PrefixTree(PS, 100)
    tree.insert("g", toks(1, 2))
    as_of = tree.clock
    tree.insert("g", toks(1, 3))  # routed after the snapshot: the rank has not seen it yet
    assert tree.refresh("g", set(), as_of=as_of) == 1  # only page 2 goes
    tree.check_integrity()
    assert tree.match(toks(1, 3)) == {"g": 8}
    assert tree.match(toks(1, 2)) == {"g": 4}


def test_forget_drops_evicted_pages_with_their_subtree():
    """The incremental report: pages a group evicted go (with the pages below them),
    except ones routed after the report was asked for; unknown hashes are ignored."""
    tree = PrefixTree(PS, 100)
    tree.insert("g", toks(1, 2, 3))
    tree.insert("h", toks(1, 2, 3))
    h1, h2, h3 = page_hashes(toks(1, 2, 3), PS)
    assert tree.forget("g", [h2, 12345]) == 2  # page 2 and page 3 under it
    tree.check_integrity()
    assert tree.match(toks(1, 2, 3)) == {"g": 4, "h": 12}
    as_of = tree.clock
    tree.insert("g", toks(1, 5))
    h5 = page_hashes(toks(1, 5), PS)[1]
    assert tree.forget("g", [h5], as_of=as_of) == 0  # routed after the report
    assert tree.forget("g", [h5]) == 1 and tree.forget("missing", [h1]) == 0
    tree.check_integrity()


def test_remove_group_and_capacity_changes():
    tree = PrefixTree(PS, 100)
    tree.insert("g", toks(1, 2, 3))
    tree.insert("h", toks(1, 2))
    assert tree.remove_group("g") == 3 and tree.remove_group("g") == 0
    tree.check_integrity()
    assert tree.match(toks(1, 2, 3)) == {"h": 8} and tree.num_nodes() == 2
    tree.set_capacity("h", 1)
    tree.check_integrity()
    assert tree.match(toks(1, 2)) == {"h": 4}
    with pytest.raises(ValueError, match="capacity_pages"):
        tree.set_capacity("h", 0)
    with pytest.raises(ValueError, match="page_size"):
        PrefixTree(0, 10)


# ---- property test against a brute-force model ----------------------------------------

GROUPS = ("a", "b", "c")
token_lists = st.lists(st.integers(0, 2), min_size=0, max_size=14)
ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), st.sampled_from(GROUPS), token_lists),
    st.tuples(st.just("refresh"), st.sampled_from(GROUPS), st.lists(st.integers(0, 63))),
    st.tuples(st.just("remove"), st.sampled_from(GROUPS), st.just(None)),
    st.tuples(st.just("match"), st.just(None), token_lists),
), max_size=40)


def _model_match(model: dict[str, set[tuple[int, ...]]], tokens: list[int], ps: int) -> dict:
    out = {}
    for g, prefixes in model.items():
        n = 0
        while (n + 1) * ps <= len(tokens) and tuple(tokens[:(n + 1) * ps]) in prefixes:
            n += 1
        if n:
            out[g] = n * ps
    return out


def _run(ops_list, ps: int, capacity: int):
    """Applies `ops_list` to a tree and to a model (group -> set of full-page token
    prefixes, eviction ignored); yields (tree match, model match) at every match."""
    tree = PrefixTree(ps, capacity)
    model: dict[str, set[tuple[int, ...]]] = {}
    for op, g, arg in ops_list:
        if op == "insert":
            tree.insert(g, arg)
            n = min(len(arg) // ps, capacity)
            model.setdefault(g, set()).update(tuple(arg[:k * ps]) for k in range(1, n + 1))
        elif op == "refresh":
            listed = sorted(model.get(g, ()))
            keep = {listed[i % len(listed)] for i in arg} if listed else set()
            tree.refresh(g, {page_hashes(p, ps)[-1] for p in keep})
            # the model keeps a prefix only if every page of it was reported held
            model[g] = {p for p in model.get(g, ()) if all(p[:k * ps] in keep
                                                          for k in range(1, len(p) // ps + 1))}
        elif op == "remove":
            tree.remove_group(g)
            model.pop(g, None)
        else:
            yield tree.match(arg), _model_match(model, arg, ps)
        tree.check_integrity()
        for x in GROUPS:
            assert tree.pages(x) <= capacity


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.sampled_from([1, 2, 3]))
def test_tree_equals_the_model_without_eviction(ops_list, ps):
    for got, want in _run(ops_list, ps, capacity=10_000):
        assert got == want


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.sampled_from([1, 2, 3]), st.integers(1, 6))
def test_tree_never_over_reports_under_eviction(ops_list, ps, capacity):
    for got, want in _run(ops_list, ps, capacity):
        for g, n in got.items():
            assert n <= want.get(g, 0), (g, got, want)


# ---- exact equivalence with a naive tree (eager LRU ticks, linear matching) -------------

class _NaiveTree:
    """The tree's contract written plainly: per group an ordered dict page -> tick where
    a touch moves the whole path to the end (leaf first), eviction pops the front, a
    match walks the path page by page; descendants are found by scanning."""

    def __init__(self, ps: int, capacity: int) -> None:
        self.ps, self.cap, self.clock = ps, capacity, 0
        self.parent: dict[int, int | None] = {}  # every listed page
        self.lru: dict[str, dict[int, int]] = {}
        self.caps: dict[str, int] = {}

    def capacity(self, g: str) -> int:
        return self.caps.get(g, self.cap)

    def _alive(self) -> set[int]:
        return {h for lru in self.lru.values() for h in lru}

    def insert(self, g: str, tokens: list[int]) -> int:
        self.clock += 1
        lru = self.lru.setdefault(g, {})
        alive, path, prev = self._alive(), [], None
        for h in page_hashes(tokens, self.ps)[:self.capacity(g)]:
            if h in alive and self.parent[h] != prev:
                break
            path.append(h)
            prev = h
        added = 0
        for i, h in reversed(list(enumerate(path))):
            self.parent[h] = path[i - 1] if i else None
            added += h not in lru
            lru.pop(h, None)
            lru[h] = self.clock
        self._evict(g)
        return added

    def _evict(self, g: str) -> None:
        lru = self.lru.get(g, {})
        while len(lru) > self.capacity(g):
            del lru[next(iter(lru))]

    def _below(self, g: str, root: int) -> set[int]:
        out = set()
        for h in self.lru[g]:
            x = h
            while x is not None and x != root:
                x = self.parent[x]
            if x == root:
                out.add(h)
        return out

    def _drop(self, g: str, stale: list[int]) -> int:
        n = 0
        for h in stale:
            if h in self.lru[g]:
                for x in self._below(g, h):
                    del self.lru[g][x]
                    n += 1
        return n

    def refresh(self, g: str, held: set[int], as_of) -> int:
        lru = self.lru.get(g)
        if not lru:
            return 0
        return self._drop(g, [h for h, t in lru.items()
                              if h not in held and (as_of is None or t <= as_of)])

    def forget(self, g: str, evicted: list[int], as_of) -> int:
        lru = self.lru.get(g)
        if not lru:
            return 0
        return self._drop(g, [h for h in evicted
                              if h in lru and (as_of is None or lru[h] <= as_of)])

    def remove_group(self, g: str) -> int:
        self.caps.pop(g, None)
        return len(self.lru.pop(g, {}))

    def set_capacity(self, g: str, cap: int) -> None:
        self.caps[g] = cap
        self._evict(g)

    def match(self, tokens: list[int]) -> dict[str, int]:
        out = {}
        hashes = page_hashes(tokens, self.ps)
        for g, lru in self.lru.items():
            n, prev = 0, None
            while n < len(hashes) and hashes[n] in lru and self.parent[hashes[n]] == prev:
                prev = hashes[n]
                n += 1
            if n:
                out[g] = n * self.ps
        return out

    def groups(self) -> list[str]:
        return [g for g, lru in self.lru.items() if lru]


def _pick(listed: list[int], picks: list[int]) -> set[int]:
    return {listed[i % len(listed)] for i in picks} if listed else set()


naive_ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), st.sampled_from(GROUPS), token_lists),
    st.tuples(st.just("refresh"), st.sampled_from(GROUPS),
              st.tuples(st.lists(st.integers(0, 63)), st.none() | st.integers(0, 4))),
    st.tuples(st.just("forget"), st.sampled_from(GROUPS),
              st.tuples(st.lists(st.integers(0, 63)), st.none() | st.integers(0, 4))),
    st.tuples(st.just("remove"), st.sampled_from(GROUPS), st.none()),
    st.tuples(st.just("capacity"), st.sampled_from(GROUPS), st.integers(1, 6)),
    st.tuples(st.just("match"), st.none(), token_lists),
), max_size=50)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(naive_ops, st.sampled_from([1, 2, 3]), st.integers(1, 8))
def test_tree_equals_a_naive_tree_op_by_op(ops_list, ps, capacity):
    """Matches, listed pages, eviction order (LRU with lazy ticks), refresh and forget
    with `as_of` (ticks back from now), removal and capacity changes: all as the naive
    tree's, after every operation."""
    tree, naive = PrefixTree(ps, capacity), _NaiveTree(ps, capacity)
    for op, g, arg in ops_list:
        if op == "insert":
            assert tree.insert(g, arg) == naive.insert(g, arg)
        elif op in ("refresh", "forget"):
            picks, back = arg
            as_of = None if back is None else max(0, naive.clock - back)
            chosen = _pick(sorted(naive.lru.get(g, {})), picks) | {12345}
            if op == "refresh":
                assert tree.refresh(g, chosen, as_of) == naive.refresh(g, chosen, as_of)
            else:
                evicted = sorted(chosen)
                assert tree.forget(g, evicted, as_of) == naive.forget(g, evicted, as_of)
        elif op == "remove":
            assert tree.remove_group(g) == naive.remove_group(g)
        elif op == "capacity":
            tree.set_capacity(g, arg)
            naive.set_capacity(g, arg)
        else:
            assert tree.match(arg) == naive.match(arg)
        tree.check_integrity()
        assert tree.groups() == naive.groups()
        assert tree.num_nodes() == len(naive._alive())
        for x in GROUPS:
            assert tree.held_hashes(x) == set(naive.lru.get(x, {}))


# ---- layout: runs of pages ---------------------------------------------------------------

def _runs(tree: PrefixTree) -> list[list[int]]:
    out, stack = [], list(tree._roots.values())
    while stack:
        r = stack.pop()
        out.append(r.hashes)
        stack.extend(r.kids.values())
    return out


def test_a_growing_conversation_stays_one_run_and_a_branch_splits_it():
    """Each turn extends the previous prompt: one run, listed by count, however many
    turns; a prompt leaving it in the middle cuts it there (three runs), and matches,
    counts and eviction see pages, not runs."""
    tree = PrefixTree(PS, 100)
    turns = [toks(1, 2), toks(1, 2, 3, 4), toks(1, 2, 3, 4, 5, 6, 7)]
    for t in turns:
        tree.insert("g", t)
    assert len(_runs(tree)) == 1 and tree.pages("g") == 7
    tree.insert("h", toks(1, 2, 9))  # branches off after page 2
    tree.check_integrity()
    assert sorted(map(len, _runs(tree))) == [1, 2, 5]
    assert tree.match(toks(1, 2, 3, 4, 5)) == {"g": 20, "h": 8}
    assert tree.match(toks(1, 2, 9, 9)) == {"g": 8, "h": 12}
    tree.set_capacity("g", 3)  # g's least recent pages: the end of its run, leaf first
    tree.check_integrity()
    assert tree.match(toks(1, 2, 3, 4, 5)) == {"g": 12, "h": 8}
    assert tree.forget("g", page_hashes(toks(1, 2, 3), PS)[1:2]) == 2
    assert tree.match(toks(1, 2, 3)) == {"g": 4, "h": 8}
    tree.check_integrity()
    assert tree.remove_group("h") == 3 and tree.num_nodes() == 1
    tree.check_integrity()


def test_a_path_of_many_runs_is_dropped_and_removed_without_recursion():
    """A branch at every page of one path (prompts sharing ever longer prefixes) makes
    a path of more runs than Python's recursion limit: dropping it from the top and
    removing its group walk it iteratively."""
    n = 1050
    path = page_hashes(list(range(n)), 1)
    tree = PrefixTree(1, 10_000)
    for i in range(1, n):  # pages 0..i-1 of the path, then a page of its own
        tree.insert_hashes("g", path[:i] + page_hashes([n + i], 1, parent=path[i - 1]))
    assert tree.match_pages(path) == {"g": n - 1}
    tree.insert_hashes("h", path)
    assert tree.forget("g", path[:1]) == 2 * (n - 1)  # the path and a leaf off each page
    tree.check_integrity()
    assert tree.match_pages(path) == {"h": n}
    assert tree.remove_group("h") == n and tree.num_nodes() == 0
    tree.check_integrity()
