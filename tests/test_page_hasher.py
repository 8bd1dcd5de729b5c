"""PageHasher: memoized chain hashes equal the reference (and the ranks' block pools) on
sequences that share, extend and diverge from what it remembers, under a tiny budget;
each test runs with the C page hashing and with its Python fallback."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phalanx.engine.block_pool import hash_pages
from phalanx.router import page_hash, page_hasher
from phalanx.router.page_hasher import PageHasher, page_hashes


@pytest.fixture(autouse=True, params=["c", "python"])
def impl(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(page_hasher, "pack", page_hash.pack_py)
        monkeypatch.setattr(page_hasher, "walk", page_hash.walk_py)
        monkeypatch.setattr(page_hasher, "PageIndex", page_hash.PageIndexPy)
    return request.param


def test_reference_equals_the_block_pools():
    rng = random.Random(0)
    for ps in (1, 3, 16):
        t = [rng.randrange(1 << 20) for _ in range(5 * ps + 2)]
        assert page_hashes(t, ps) == hash_pages(t, ps, None)
        assert page_hashes(t, ps, parent=0xDEADBEEF) == hash_pages(t, ps, 0xDEADBEEF)


def test_a_repeated_prefix_is_not_hashed_again():
    rng = random.Random(1)
    h = PageHasher(16)
    chat = [rng.randrange(32000) for _ in range(16 * 40 + 5)]
    assert list(h.hashes(chat)) == page_hashes(chat, 16)
    assert (h.hashed, h.reused) == (40, 0)
    turn = chat + [rng.randrange(32000) for _ in range(16 * 3)]  # the next turn: 3 more pages
    assert list(h.hashes(turn)) == page_hashes(turn, 16)
    # page 0 to find the run, the partial page that now is full, then 2 new ones
    assert (h.hashed - 40, h.reused) == (4, 39)
    forked = chat[:16 * 10] + [7] + chat[16 * 10 + 1:]  # differs inside page 10
    assert list(h.hashes(forked, remember=False)) == page_hashes(forked, 16)


def test_continuing_from_a_parent_page():
    rng = random.Random(2)
    h = PageHasher(4)
    t = [rng.randrange(50) for _ in range(4 * 12)]
    head = h.hashes(t[:4 * 5])
    tail = h.hashes(t[4 * 5:], parent=head[-1], first_page=5)
    assert list(head + tail) == page_hashes(t, 4)
    assert h.hashed == 12
    # the tail grew the head's run: one run, found by hashing its first page
    assert list(h.hashes(t)) == page_hashes(t, 4)
    assert (h.hashed, h.reused) == (13, 11)
    with pytest.raises(ValueError, match="parent"):
        h.hashes(t, first_page=3)
    assert list(h.hashes(t[:3])) == []



def test_the_budget_bounds_what_is_remembered():
    rng = random.Random(3)
    h = PageHasher(2, budget=8)
    for _ in range(50):
        t = [rng.randrange(4) for _ in range(rng.randrange(0, 30))]
        assert list(h.hashes(t)) == page_hashes(t, 2)
        # the budget, or over it by the last run alone (the most recent is always kept)
        assert h.remembered_pages <= 8 + 14


sequences = st.lists(st.lists(st.integers(0, 3), max_size=24), min_size=1, max_size=25)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequences, st.sampled_from([1, 2, 3]), st.integers(1, 40), st.data())
def test_memoized_hashes_always_equal_the_reference(seqs, ps, budget, data):
    """Sequences over a tiny alphabet share and diverge at every offset; each is hashed
    whole, or as a continuation of its own head, or without being remembered."""
    h = PageHasher(ps, budget=budget)
    for t in seqs:
        want = page_hashes(t, ps)
        how = data.draw(st.sampled_from(["whole", "split", "read"]))
        if how == "split" and len(want) >= 2:
            k = data.draw(st.integers(1, len(want) - 1))
            got = list(h.hashes(t[:k * ps]) + h.hashes(t[k * ps:], parent=want[k - 1],
                                                             first_page=k))
        else:
            got = list(h.hashes(t, remember=how != "read"))
        assert got == want


def test_a_chat_turn_hashes_its_new_pages_and_at_most_two_jumps():
    """Conversations over one shared system prompt: each turn costs a blake2b per page
    it adds plus one per run it jumps to (the system prompt's, its conversation's), not
    one per earlier turn, and the runs branch where the conversations do."""
    rng = random.Random(4)
    h = PageHasher(4)
    system = [rng.randrange(1000) for _ in range(4 * 8)]
    chats = [list(system) for _ in range(3)]
    h.hashes(system)
    for turn in range(6):
        for chat in chats:
            new_pages = 2 + turn % 3
            chat += [rng.randrange(1000) for _ in range(4 * new_pages)]
            before = h.hashed
            assert list(h.hashes(chat)) == page_hashes(chat, 4)
            assert h.hashed - before <= new_pages + 2
    assert h.remembered_pages == 8 + sum(len(c) // 4 - 8 for c in chats)


def test_a_dropped_run_is_reaped_a_bounded_number_of_entries_per_call():
    """Dropping a run past the budget costs the dropping call O(1): the run is found no
    more at once (its pages are hashed again, correctly), and its index entries go a
    bounded number per later call (as many as the call remembers + REAP_SPARE)."""
    from phalanx.router.page_hasher import REAP_SPARE
    rng = random.Random(5)
    h = PageHasher(2, budget=1 << 20)
    big = [rng.randrange(1000) for _ in range(2 * 600)]
    assert list(h.hashes(big)) == page_hashes(big, 2)
    h.budget = 8
    seen = h.hashed
    small = [rng.randrange(1000) for _ in range(2 * 4)]
    assert list(h.hashes(small)) == page_hashes(small, 2)  # drops `big`'s run
    assert h.remembered_pages == 4
    assert h.dropped_pages == 600 - (4 + REAP_SPARE)
    assert list(h.hashes(big, remember=False)) == page_hashes(big, 2)  # not taken from the run
    assert h.hashed - seen == 4 + 600
    while h.dropped_pages:
        before = h.dropped_pages
        t = [rng.randrange(1000) for _ in range(2 * 3)]
        assert list(h.hashes(t)) == page_hashes(t, 2)
        assert before - h.dropped_pages <= 3 + REAP_SPARE
    assert len(h._at) == h.remembered_pages  # every entry of a dropped run is gone
