"""Unit and stateful tests of the paged-KV block pool and its chain-hash prefix cache."""

from __future__ import annotations

import collections
import itertools
import random

import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from phalanx.engine.block_pool import BlockPool, PoolExhausted, hash_pages


def _free_order(pool: BlockPool) -> list[int]:
    """The free list front to back (the order `allocate` hands pages out)."""
    return list(pool._free)


# -- hash_pages --------------------------------------------------------------------------

def test_hash_pages_only_full_pages():
    assert hash_pages([], 4, None) == []
    assert hash_pages([1, 2, 3], 4, None) == []
    assert len(hash_pages(list(range(4)), 4, None)) == 1
    assert len(hash_pages(list(range(11)), 4, None)) == 2
    assert len(hash_pages(list(range(12)), 4, None)) == 3


def test_hash_pages_deterministic_and_64_bit():
    toks = [5, 9, 2, 7, 7, 1, 0, 3]
    a = hash_pages(toks, 2, None)
    assert a == hash_pages(list(toks), 2, None)
    assert a == hash_pages(tuple(toks), 2, None)
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in a)
    assert len(set(a)) == len(a)


def test_hash_pages_chain_property():
    ps = 3
    toks = list(range(100, 100 + 5 * ps))
    base = hash_pages(toks, ps, None)
    assert len(base) == 5
    # Same prefix -> same hashes for the shared full pages, whatever follows.
    other = toks[:2 * ps + 1] + [999] * (3 * ps - 1)
    assert hash_pages(other, ps, None)[:2] == base[:2]
    # Changing one token of page i changes hashes i.. and none before.
    for i in range(5):
        changed = list(toks)
        changed[i * ps + 1] += 1
        h = hash_pages(changed, ps, None)
        assert h[:i] == base[:i]
        assert all(h[j] != base[j] for j in range(i, 5)), i


def test_hash_pages_parent_continues_the_chain():
    ps = 4
    toks = list(range(20))
    full = hash_pages(toks, ps, None)
    head = hash_pages(toks[:8], ps, None)
    tail = hash_pages(toks[8:], ps, head[-1])
    assert head + tail == full
    # The same page content under a different parent hashes differently.
    assert hash_pages(toks[8:12], ps, None) != [full[2]]
    assert hash_pages(toks[:4], ps, 0) != hash_pages(toks[:4], ps, None)


def test_hash_pages_position_sensitive_within_page():
    assert hash_pages([1, 2], 2, None) != hash_pages([2, 1], 2, None)
    # Page boundaries matter: same tokens, different page size.
    assert hash_pages([1, 2, 3, 4], 2, None)[-1] != hash_pages([1, 2, 3, 4], 4, None)[-1]


# -- construction / basics ---------------------------------------------------------------

@pytest.mark.parametrize("num_pages,page_size", [(0, 4), (4, 0), (-1, 4), (4, -2)])
def test_constructor_rejects_non_positive(num_pages, page_size):
    with pytest.raises(ValueError):
        BlockPool(num_pages, page_size)


def test_fresh_pool():
    pool = BlockPool(8, 4)
    assert pool.num_free_pages == 8
    assert pool.usage == 0.0
    assert pool.hit_rate == 0.0
    pool.check_integrity()


def test_allocate_release_roundtrip():
    pool = BlockPool(6, 2)
    a = pool.allocate(4)
    assert len(a) == len(set(a)) == 4
    assert all(pool.ref_counts[p] == 1 for p in a)
    assert pool.num_free_pages == 2
    assert pool.usage == pytest.approx(4 / 6)
    pool.check_integrity()
    b = pool.allocate(2)
    assert not set(a) & set(b)
    assert pool.num_free_pages == 0
    pool.check_integrity()
    pool.release(a)
    pool.release(b)
    assert pool.num_free_pages == 6
    assert all(rc == 0 for rc in pool.ref_counts)
    pool.check_integrity()


def test_pages_freed_together_come_back_consecutive():
    """Cached pages are freed tail first (evicted first); re-allocated, they come back
    ascending, as runs of consecutive pages (what the KV transport moves in place)."""
    pool = BlockPool(12, 2)
    first = pool.allocate(8)
    for i, p in enumerate(first):
        pool.register(p, 500 + i)
    pool.release(first)
    assert pool.allocate(4) == [8, 9, 10, 11]  # never used: first in the free list
    assert pool.allocate(8) == first == list(range(8))
    pool.check_integrity()


def test_allocate_zero():
    pool = BlockPool(2, 2)
    assert pool.allocate(0) == []
    assert pool.num_free_pages == 2


def test_pool_exhausted_leaves_state_unchanged():
    pool = BlockPool(4, 2)
    held = pool.allocate(3)
    pool.register(held[0], 111)
    before = (_free_order(pool), list(pool.ref_counts), dict(pool.cached))
    with pytest.raises(PoolExhausted):
        pool.allocate(2)
    assert (_free_order(pool), list(pool.ref_counts), dict(pool.cached)) == before
    pool.check_integrity()
    assert isinstance(PoolExhausted("x"), RuntimeError)


def test_pool_exhausted_counts_idle_cached_pages_as_free():
    pool = BlockPool(3, 1)
    pages = pool.allocate(3)
    for i, p in enumerate(pages):
        pool.register(p, 1000 + i)
    pool.release(pages)
    # All three pages are cached but idle: they can all be evicted.
    again = pool.allocate(3)
    assert sorted(again) == sorted(pages)
    assert pool.cached == {}
    assert pool.page_hash == [None, None, None]
    with pytest.raises(PoolExhausted):
        pool.allocate(1)
    pool.check_integrity()


def test_release_more_than_acquired_raises():
    pool = BlockPool(4, 2)
    with pytest.raises(RuntimeError, match="released more"):
        pool.release([0])
    p = pool.allocate(1)
    pool.release(p)
    with pytest.raises(RuntimeError):
        pool.release(p)
    pool.check_integrity()
    # Shared page: two references, three releases.
    q = pool.allocate(1)
    pool.register(q[0], 42)
    pool.acquire(q)
    pool.release(q)
    pool.release(q)
    with pytest.raises(RuntimeError):
        pool.release(q)
    pool.check_integrity()


def test_release_same_page_twice_in_one_call_raises_when_singly_held():
    pool = BlockPool(2, 2)
    p = pool.allocate(1)
    with pytest.raises(RuntimeError):
        pool.release(p + p)


# -- register / match_prefix / acquire ---------------------------------------------------

def test_register_and_match_prefix():
    ps = 2
    pool = BlockPool(8, ps)
    toks = [1, 2, 3, 4, 5, 6, 7]
    hashes = hash_pages(toks, ps, None)
    pages = pool.allocate(4)
    for p, h in zip(pages, hashes):
        pool.register(p, h)
    assert pool.match_prefix(hashes) == pages[:3]
    assert pool.match_prefix(hashes[:2]) == pages[:2]
    assert pool.match_prefix([]) == []
    # A miss stops the match, even if later hashes are cached.
    assert pool.match_prefix([12345] + hashes[1:]) == []
    assert pool.match_prefix(hashes[:1] + [12345] + hashes[2:]) == pages[:1]
    # match_prefix takes no reference.
    assert [pool.ref_counts[p] for p in pages] == [1, 1, 1, 1]
    pool.check_integrity()


def test_match_prefix_after_release_and_acquire():
    ps = 2
    pool = BlockPool(6, ps)
    hashes = hash_pages([1, 2, 3, 4, 5], ps, None)
    pages = pool.allocate(3)
    for p, h in zip(pages, hashes):
        pool.register(p, h)
    pool.release(pages)
    assert pool.num_free_pages == 6
    hits = pool.match_prefix(hashes)
    assert hits == pages[:2]
    assert pool.num_free_after_acquire(hits) == 4
    pool.acquire(hits)
    assert pool.num_free_pages == 4
    assert [pool.ref_counts[p] for p in hits] == [1, 1]
    pool.check_integrity()
    # A second sharer: acquiring referenced pages takes nothing off the free list.
    assert pool.num_free_after_acquire(hits) == 4
    pool.acquire(hits)
    assert pool.num_free_pages == 4
    assert [pool.ref_counts[p] for p in hits] == [2, 2]
    pool.release(hits)
    pool.release(hits)
    assert pool.num_free_pages == 6
    assert pool.match_prefix(hashes) == pages[:2]  # still cached
    pool.check_integrity()


def test_num_free_after_acquire_counts_only_idle_pages():
    pool = BlockPool(5, 1)
    a = pool.allocate(2)
    pool.register(a[0], 1)
    pool.register(a[1], 2)
    pool.release(a[1:])
    # a[0] referenced, a[1] idle.
    assert pool.num_free_pages == 4
    assert pool.num_free_after_acquire(a) == 3
    assert pool.num_free_after_acquire([]) == 4


def test_register_first_writer_wins():
    pool = BlockPool(4, 2)
    a, b = pool.allocate(2)
    pool.register(a, 7)
    pool.register(b, 7)  # duplicate hash: ignored
    assert pool.cached == {7: a}
    assert pool.page_hash[a] == 7
    assert pool.page_hash[b] is None
    # A page keeps its first hash.
    pool.register(a, 8)
    assert pool.cached == {7: a}
    assert pool.page_hash[a] == 7
    pool.check_integrity()
    # Once the first writer's page is evicted, the hash is free again.
    pool.release([a])
    pool.release([b])
    pool.check_integrity()
    got = pool.allocate(4)
    assert pool.cached == {}
    pool.register(got[0], 7)
    assert pool.cached == {7: got[0]}
    pool.check_integrity()


def test_prefix_caching_disabled():
    pool = BlockPool(4, 2, enable_prefix_caching=False)
    hashes = hash_pages([1, 2, 3, 4], 2, None)
    pages = pool.allocate(2)
    for p, h in zip(pages, hashes):
        pool.register(p, h)
    assert pool.cached == {}
    assert pool.page_hash == [None] * 4
    assert pool.match_prefix(hashes) == []
    pool.release(pages)
    pool.check_integrity()


def test_allocate_evicts_hash():
    pool = BlockPool(1, 2)
    (p,) = pool.allocate(1)
    pool.register(p, 99)
    pool.release([p])
    assert pool.match_prefix([99]) == [p]
    assert pool.allocate(1) == [p]
    assert pool.match_prefix([99]) == []
    assert pool.page_hash[p] is None
    pool.check_integrity()


# -- eviction order ----------------------------------------------------------------------

def test_unhashed_pages_reused_before_cached_ones():
    pool = BlockPool(4, 2)
    pages = pool.allocate(4)
    pool.register(pages[0], 10)
    pool.register(pages[1], 11)
    pool.release(pages)
    pool.check_integrity()
    first = pool.allocate(2)
    assert sorted(first) == sorted(pages[2:])
    assert pool.cached == {10: pages[0], 11: pages[1]}
    pool.check_integrity()


def test_unhashed_page_released_late_still_goes_before_cached():
    pool = BlockPool(4, 1)
    cached = pool.allocate(2)
    pool.register(cached[0], 1)
    pool.register(cached[1], 2)
    pool.release(cached)
    scratch = pool.allocate(1)  # the two never-used pages come first
    assert scratch[0] not in cached
    pool.release(scratch)  # released after the cached ones, yet evicted before them
    pool.check_integrity()
    assert pool.allocate(1) == scratch


def test_least_recently_released_cached_page_evicted_first():
    pool = BlockPool(3, 1)
    a, b, c = pool.allocate(3)
    for p, h in ((a, 1), (b, 2), (c, 3)):
        pool.register(p, h)
    pool.release([b])
    pool.release([c])
    pool.release([a])
    assert pool.allocate(1) == [b]
    assert pool.allocate(1) == [c]
    assert pool.allocate(1) == [a]


def test_acquire_refreshes_lru_position():
    pool = BlockPool(3, 1)
    a, b, c = pool.allocate(3)
    for p, h in ((a, 1), (b, 2), (c, 3)):
        pool.register(p, h)
    pool.release([a])
    pool.release([b])
    pool.release([c])
    # a is touched again (a prefix-cache hit) and released: now most recent.
    assert pool.match_prefix([1]) == [a]
    pool.acquire([a])
    pool.release([a])
    pool.check_integrity()
    assert [pool.allocate(1)[0] for _ in range(3)] == [b, c, a]  # eviction order


def test_tail_pages_of_released_sequence_evicted_before_head():
    pool = BlockPool(4, 2)
    pages = pool.allocate(4)
    hashes = hash_pages(list(range(8)), 2, None)
    for p, h in zip(pages, hashes):
        pool.register(p, h)
    pool.release(pages)
    pool.check_integrity()
    # Eviction eats the chain from its tail, so the longest prefix stays matchable.
    for k in range(4, 0, -1):
        assert pool.match_prefix(hashes) == pages[:k]
        assert pool.allocate(1) == [pages[k - 1]]
    assert pool.match_prefix(hashes) == []


def test_older_sequence_evicted_before_newer():
    pool = BlockPool(4, 1)
    s1 = pool.allocate(2)
    s2 = pool.allocate(2)
    for i, p in enumerate(s1 + s2):
        pool.register(p, 100 + i)
    pool.release(s1)
    pool.release(s2)
    assert [pool.allocate(1)[0] for _ in range(4)] == [s1[1], s1[0], s2[1], s2[0]]


# -- hit counters ------------------------------------------------------------------------

def test_hit_counters():
    pool = BlockPool(2, 2)
    assert pool.hit_rate == 0.0
    pool.record_lookup(10, 4)
    assert (pool.query_tokens, pool.hit_tokens) == (10, 4)
    assert pool.hit_rate == pytest.approx(0.4)
    pool.record_lookup(10, 0)
    assert pool.hit_rate == pytest.approx(0.2)
    pool.record_lookup(0, 0)
    assert pool.hit_rate == pytest.approx(0.2)


# -- check_integrity catches corruption --------------------------------------------------

def test_check_integrity_detects_corruption():
    pool = BlockPool(3, 1)
    a = pool.allocate(1)
    pool.ref_counts[a[0]] = 0  # referenced nowhere, yet not free
    with pytest.raises(AssertionError):
        pool.check_integrity()

    pool = BlockPool(3, 1)
    a = pool.allocate(1)
    pool.cached[5] = a[0]  # stale index entry
    with pytest.raises(AssertionError):
        pool.check_integrity()

    pool = BlockPool(3, 1)
    a = pool.allocate(2)
    pool.register(a[0], 5)
    pool.release(a[:1])
    pool._free.move_to_end(a[0], last=False)  # cached page ahead of unhashed ones
    with pytest.raises(AssertionError):
        pool.check_integrity()


# -- model-checked random drives -------------------------------------------------------

class _Seq:
    """A simulated sequence: its token ids (None: raw pages) and the pages that hold them."""

    __slots__ = ("tokens", "pages", "num_registered")

    def __init__(self, tokens, pages, num_registered):
        self.tokens = tokens
        self.pages = pages
        self.num_registered = num_registered


class PoolModel:
    """Drives a pool the way the scheduler does and checks it against a model.

    Model: ref counts are the multiplicity of each page over live sequences; every page
    holds the tokens its owner wrote to it (`content`); a cached page's content is the
    token chunk its hash names (so a prefix hit never returns overwritten KV); `allocate`
    never returns a referenced page; and among idle pages, unhashed ones go first, then
    cached ones by release time, tail pages of one release before head pages.
    """

    def __init__(self, num_pages: int, page_size: int, caching: bool) -> None:
        self.pool = BlockPool(num_pages, page_size, caching)
        self.ps = page_size
        self.seqs: list[_Seq] = []
        self.content: dict[int, tuple] = {}  # page -> tokens written to it
        self.chunk_of: dict[int, tuple] = {}  # hash -> the page tokens it names
        self.release_time: dict[int, int] = {}  # idle cached page -> when released
        self.clock = itertools.count()
        self.events: collections.Counter = collections.Counter()

    def _event(self, name: str) -> None:
        self.events[name] += 1
        if currently_in_test_context():
            event(name)

    # -- pool calls, checked
    def _allocate(self, n: int) -> list[int]:
        pool = self.pool
        idle = [p for p in range(pool.num_pages) if pool.ref_counts[p] == 0]
        unhashed = {p for p in idle if pool.page_hash[p] is None}
        hashed_before = {p: pool.page_hash[p] for p in idle if pool.page_hash[p] is not None}
        got = pool.allocate(n)
        assert len(got) == n == len(set(got))
        for p in got:
            assert p in idle, f"allocate handed out referenced page {p}"
            assert pool.ref_counts[p] == 1
            assert pool.page_hash[p] is None
        took_cached = [p for p in got if p not in unhashed]
        if took_cached:
            self._event("allocate evicted cached pages")
            # Every unhashed idle page goes before any cached one...
            assert unhashed <= set(got), "evicted a cached page while unhashed pages were idle"
            # ...and cached pages go least recently released first.
            left = [p for p in hashed_before if p not in got]
            newest_evicted = max(self.release_time[p] for p in took_cached)
            assert all(self.release_time[p] > newest_evicted for p in left)
            for p in took_cached:
                assert hashed_before[p] not in pool.cached
        for p in got:
            self.content[p] = ()
            self.release_time.pop(p, None)
        return got

    def _release(self, pages: list[int]) -> None:
        for p in reversed(pages):  # the documented "tail pages first"
            if self.pool.ref_counts[p] == 1 and self.pool.page_hash[p] is not None:
                self.release_time[p] = next(self.clock)
        self.pool.release(pages)

    def _write(self, seq: _Seq, start: int) -> None:
        ps = self.ps
        for i in range(start // ps, len(seq.pages)):
            p = seq.pages[i]
            assert self.pool.ref_counts[p] == 1, "writing a shared page"
            assert self.pool.page_hash[p] is None, "writing a published page"
            self.content[p] = tuple(seq.tokens[i * ps:(i + 1) * ps])

    def _register(self, seq: _Seq) -> None:
        pool, ps = self.pool, self.ps
        hashes = hash_pages(seq.tokens, ps, None)
        for i in range(seq.num_registered, len(hashes)):
            p, h = seq.pages[i], hashes[i]
            self.chunk_of[h] = tuple(seq.tokens[i * ps:(i + 1) * ps])
            owner_before = pool.cached.get(h)
            pool.register(p, h)
            if not pool.enable_prefix_caching:
                assert pool.page_hash[p] is None and h not in pool.cached
            elif owner_before is not None:
                self._event("duplicate hash ignored")
                assert pool.cached[h] == owner_before  # first writer wins
            else:
                assert pool.cached[h] == p and pool.page_hash[p] == h
        seq.num_registered = len(hashes)

    def _live(self) -> list[_Seq]:
        return [s for s in self.seqs if s.tokens is not None]

    # -- operations
    def admit(self, tokens: list[int], publish: bool) -> None:
        pool, ps = self.pool, self.ps
        hashes = hash_pages(tokens, ps, None)
        hits = pool.match_prefix(hashes)
        assert len(hits) == len(set(hits))
        if hits:
            self._event("prefix-cache hit")
            if any(pool.ref_counts[p] for p in hits):
                self._event("hit on a page another sequence holds")
        for i, p in enumerate(hits):
            assert pool.page_hash[p] == hashes[i]
            assert self.content[p] == tuple(tokens[i * ps:(i + 1) * ps]), "stale cache hit"
        need = -(-len(tokens) // ps) - len(hits)
        free_after = pool.num_free_after_acquire(hits)
        pool.acquire(hits)
        for p in hits:
            self.release_time.pop(p, None)
        assert pool.num_free_pages == free_after
        if need > free_after:
            self._event("admit: pool exhausted")
            with pytest.raises(PoolExhausted):
                pool.allocate(need)
            self._release(hits)
            return
        seq = _Seq(list(tokens), hits + self._allocate(need), len(hits))
        self._write(seq, len(hits) * ps)
        self.seqs.append(seq)
        if publish:
            self._register(seq)

    def allocate_raw(self, n: int) -> None:
        if n > self.pool.num_free_pages:
            with pytest.raises(PoolExhausted):
                self.pool.allocate(n)
            return
        self.seqs.append(_Seq(None, self._allocate(n), 0))

    def grow(self, k: int, extra: list[int], publish: bool) -> None:
        live = self._live()
        if not live:
            return
        seq = live[k % len(live)]
        start = len(seq.tokens)
        need = -(-(start + len(extra)) // self.ps) - len(seq.pages)
        if need > self.pool.num_free_pages:
            with pytest.raises(PoolExhausted):
                self.pool.allocate(need)
            return
        seq.tokens.extend(extra)
        seq.pages.extend(self._allocate(need))
        self._write(seq, start)
        if publish:
            self._register(seq)

    def register(self, k: int) -> None:
        live = self._live()
        if live:
            self._register(live[k % len(live)])

    def release(self, k: int) -> None:
        if self.seqs:
            self._release(self.seqs.pop(k % len(self.seqs)).pages)

    def over_release(self, k: int) -> None:
        pool = self.pool
        idle = [p for p in range(pool.num_pages) if pool.ref_counts[p] == 0]
        if not idle:
            return
        before = (_free_order(pool), list(pool.ref_counts))
        with pytest.raises(RuntimeError):
            pool.release([idle[k % len(idle)]])
        assert (_free_order(pool), list(pool.ref_counts)) == before

    def check(self) -> None:
        pool = self.pool
        pool.check_integrity()
        expected = [0] * pool.num_pages
        for s in self.seqs:
            for p in s.pages:
                expected[p] += 1
        assert pool.ref_counts == expected
        assert pool.num_free_pages == expected.count(0)
        for h, p in pool.cached.items():
            assert self.content[p] == self.chunk_of[h], "cached page content changed"
        # Idle cached pages sit in the free list in release order.
        idle_cached = [p for p in _free_order(pool) if pool.page_hash[p] is not None]
        times = [self.release_time[p] for p in idle_cached]
        assert times == sorted(times)


_BASES = ([0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
          [2, 0, 0, 2, 1, 1, 2, 0, 0, 2, 1, 1])
# Prompts that often share prefixes: a prefix of one of a few bases plus a short suffix.
TOKENS = st.builds(lambda base, k, suffix: _BASES[base][:k] + suffix,
                   st.integers(0, len(_BASES) - 1), st.integers(0, 12),
                   st.lists(st.integers(0, 2), min_size=1, max_size=3))
SMALL = st.integers(0, 1000)


class PoolMachine(RuleBasedStateMachine):
    """Hypothesis-driven random operations on `PoolModel`, checked after every step."""

    model: PoolModel | None = None

    @initialize(num_pages=st.integers(1, 16), page_size=st.integers(1, 3),
                caching=st.sampled_from([True, True, True, False]))
    def setup(self, num_pages, page_size, caching):
        self.model = PoolModel(num_pages, page_size, caching)

    @rule(tokens=TOKENS, publish=st.booleans())
    def admit(self, tokens, publish):
        self.model.admit(tokens, publish)

    @rule(n=st.integers(0, 4))
    def allocate_raw(self, n):
        self.model.allocate_raw(n)

    @rule(k=SMALL, extra=st.lists(st.integers(0, 2), min_size=1, max_size=6),
          publish=st.booleans())
    def grow(self, k, extra, publish):
        self.model.grow(k, extra, publish)

    @rule(k=SMALL)
    def register(self, k):
        self.model.register(k)

    @rule(k=SMALL)
    def release(self, k):
        self.model.release(k)

    @rule(k=SMALL)
    def over_release(self, k):
        self.model.over_release(k)

    @invariant()
    def consistent(self):
        if self.model is not None:
            self.model.check()


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


def test_random_walks_against_model():
    """Seeded random walks (long ones, with a bias towards reuse) over the same model;
    also asserts that the interesting paths were actually taken."""
    total: collections.Counter = collections.Counter()
    for seed in range(40):
        rng = random.Random(seed)
        m = PoolModel(rng.randint(2, 14), rng.randint(1, 3), caching=seed % 8 != 7)
        for _ in range(250):
            op = rng.random()
            if op < 0.35:
                base = rng.choice(_BASES)
                tokens = base[:rng.randint(0, 12)] + [rng.randint(0, 2)
                                                      for _ in range(rng.randint(1, 3))]
                m.admit(tokens, publish=rng.random() < 0.8)
            elif op < 0.45:
                m.grow(rng.randrange(1000), [rng.randint(0, 2) for _ in range(rng.randint(1, 5))],
                       publish=rng.random() < 0.8)
            elif op < 0.5:
                m.register(rng.randrange(1000))
            elif op < 0.55:
                m.allocate_raw(rng.randint(0, 3))
            elif op < 0.6:
                m.over_release(rng.randrange(1000))
            else:
                m.release(rng.randrange(1000))
            m.check()
        while m.seqs:
            m.release(0)
            m.check()
        assert m.pool.num_free_pages == m.pool.num_pages
        total.update(m.events)
    for name in ("prefix-cache hit", "hit on a page another sequence holds",
                 "allocate evicted cached pages", "admit: pool exhausted",
                 "duplicate hash ignored"):
        assert total[name] > 0, (name, total)


@settings(max_examples=60, deadline=None)
@given(st.data(), st.lists(st.integers(0, 50), min_size=1, max_size=40), st.integers(1, 6))
def test_hash_pages_prefix_property(data, tokens, ps):
    """hash_pages of any prefix equals the prefix of hash_pages; a change at position k
    changes exactly the hashes of the pages from k // ps on."""
    full = hash_pages(tokens, ps, None)
    cut = data.draw(st.integers(0, len(tokens) - 1))
    assert hash_pages(tokens[:cut], ps, None) == full[:cut // ps]
    new = (tokens[cut] + data.draw(st.integers(1, 50))) % 51
    changed = tokens[:cut] + [new] + tokens[cut + 1:]
    h = hash_pages(changed, ps, None)
    k = cut // ps
    assert len(h) == len(full)
    assert h[:k] == full[:k]
    assert all(a != b for a, b in zip(h[k:], full[k:]))


def test_evictions_are_logged_for_incremental_reports():
    """`evicted_since(n)`: the hashes evicted after eviction n that are not cached again;
    None once the log no longer reaches back (the reader then asks for a full list)."""
    from phalanx.engine import block_pool as bp

    pool = BlockPool(4, 2)
    pages = pool.allocate(4)
    for i, page in enumerate(pages):
        pool.register(page, 100 + i)
    pool.release(pages)
    assert pool.evicted_since(0) == (0, [])
    got = pool.allocate(2)  # evicts the two least recently released
    evicted = [h for h in range(100, 104) if h not in pool.cached]
    n, since0 = pool.evicted_since(0)
    assert n == 2 and sorted(since0) == evicted
    assert pool.evicted_since(1)[1] == since0[1:] and pool.evicted_since(2) == (2, [])
    assert pool.evicted_since(3) == (2, None)  # ahead of this pool: another pool's count
    pool.register(got[0], since0[0])  # cached again: no longer reported as gone
    assert pool.evicted_since(0) == (2, since0[1:])
    pool.check_integrity()

    old, bp.EVICTION_LOG = bp.EVICTION_LOG, 3
    try:
        small = BlockPool(2, 2)
        for round_ in range(4):  # 6 evictions (none in the first round), a 3-entry log
            ps = small.allocate(2)
            for i, page in enumerate(ps):
                small.register(page, 1000 + 10 * round_ + i)
            small.release(ps)
        assert small.evictions == 6
        assert small.evicted_since(0) == (6, None) and small.evicted_since(2) == (6, None)
        assert small.evicted_since(3)[1] is not None and len(small.evicted_since(3)[1]) == 3
    finally:
        bp.EVICTION_LOG = old
