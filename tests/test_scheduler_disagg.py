"""Scheduler support for the disaggregated layout, without a model: prefill pages held for
their readers (also across a preemption), decode pages reserved for arriving KV, and
admission of a request whose prompt KV landed elsewhere."""

from __future__ import annotations

from phalanx.engine.block_pool import BlockPool
from phalanx.engine.sampling_params import SamplingParams
from phalanx.engine.scheduler import Scheduler
from phalanx.engine.sequence import Sequence

PS = 4


def _sched(pages: int, max_seqs: int = 4, budget: int = 64) -> Scheduler:
    return Scheduler(BlockPool(pages, PS), max_seqs, budget, max_model_len=256)


def _run(s: Scheduler, token: int = 9) -> list:
    batch = s.schedule()
    return s.update(batch, {seq.request_id: token for seq, n in batch.items
                            if seq.num_computed_tokens + n == seq.num_tokens})


def test_prefill_pages_held_until_released():
    s = _sched(16)
    seq = Sequence("a", list(range(10)), SamplingParams(max_tokens=1), 0)
    seq.hold_kv = True
    s.add(seq)
    (done,) = _run(s)
    assert done.reason == "length" and s.held["a"] and s.pool.num_free_pages == 16 - 3
    assert s.release_held("a") and s.pool.num_free_pages == 16
    s.pool.check_integrity()


def test_preempted_streaming_prefill_keeps_its_old_pages_until_release():
    s = _sched(8, budget=8)
    hold = Sequence("h", list(range(12)), SamplingParams(max_tokens=1), 0)
    hold.hold_kv = True
    other = Sequence("o", list(range(100, 108)), SamplingParams(max_tokens=4), 1)
    s.add(other)
    s.add(hold)
    _run(s)  # "o" takes the budget; "h" waits
    _run(s)
    s.running.append(hold)  # force "h" in, then starve the pool so it is the victim
    hold.pages = s.pool.allocate(2)
    s._preempt(s.running.pop())
    assert len(s.held["h"]) == 2, "pages a transfer may still read are not freed"
    s.release_held("h")
    s.pool.check_integrity()


def test_reserve_admit_and_unreserve():
    s = _sched(10)
    assert s.reserve("r", list(range(9))) == (s.reserved["r"], 0) and len(s.reserved["r"]) == 3
    assert s.reserve("big", list(range(100, 140))) is None, "no room now: the caller retries"
    seq = Sequence("r", list(range(9)), SamplingParams(max_tokens=3), 0)
    seq.output_token_ids.append(5)  # the first token, sampled by prefill
    s.admit_prefilled(seq)
    assert seq.num_computed_tokens == 9 and s.num_waiting == 1
    batch = s.schedule()
    assert batch.items == [(seq, 1)], "only the first token is computed here"
    s.update(batch, {"r": 6})
    assert seq.output_token_ids == [5, 6]
    assert s.reserve("x", [7] * 4) is not None and s.unreserve("x") and not s.unreserve("x")
    s.abort("r")
    assert s.pool.num_free_pages == 10
    s.pool.check_integrity()


def test_reserve_reuses_the_cached_prefix_of_a_prompt():
    """A prompt whose leading full pages the decode pool caches (an earlier turn of the
    same conversation): those pages are reserved with a reference, only the rest is
    fresh, and the reservation says how many tokens are already there. The last page
    always comes from prefill, even when the whole prompt is cached."""
    s = _sched(16)
    first = Sequence("t1", list(range(10)), SamplingParams(max_tokens=2), 0)
    s.add(first)
    while s.has_unfinished():
        _run(s)
    # t1's KV: prompt + output, pages [0..4), [4..8) full and cached once computed
    follow = list(range(10)) + [9] + list(range(50, 57))  # t1's prompt + its output + more
    pages, cached = s.reserve("t2", follow)
    assert cached == 8 and len(pages) == 5
    assert pages[:2] == [s.pool.cached[h] for h in first.page_hashes[:2]]
    assert all(s.pool.ref_counts[p] == 1 for p in pages)
    same = list(range(8))  # all cached, but its last page still comes from prefill
    pages2, cached2 = s.reserve("t3", same)
    assert cached2 == 4 and pages2[0] == pages[0] and s.pool.ref_counts[pages[0]] == 2
    assert s.unreserve("t2") and s.unreserve("t3")
    assert s.pool.num_free_pages == 16
    s.pool.check_integrity()
    # a salted request shares no page with the unsalted one; its own salt's pages it does
    salt = SamplingParams(max_tokens=2, cache_salt="x").prefix_root
    assert s.reserve("t4", follow, salt)[1] == 0
    salted = Sequence("t5", list(range(10)), SamplingParams(max_tokens=2, cache_salt="x"), 1)
    s.unreserve("t4")
    s.add(salted)
    while s.has_unfinished():
        _run(s)
    assert s.reserve("t6", follow, salt)[1] == 8 and s.unreserve("t6")
