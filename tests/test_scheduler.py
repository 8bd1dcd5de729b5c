"""Scheduler tests against a fake, deterministic model that reads its input from a fake KV cache.

The fake model writes every computed token id into the page slot the scheduler gave it and,
when a sequence reaches its end, reads the whole history back out of the pages and samples
a token that is a deterministic function of that history. So a wrong page (a stale prefix
hit, a page shared while written, a preempted sequence recomputed wrongly) changes the
outputs or trips an assertion, and any correct schedule reproduces the reference outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from phalanx.engine.block_pool import BlockPool
from phalanx.engine.sampling_params import SamplingParams
from phalanx.engine.scheduler import Scheduler
from phalanx.engine.sequence import Sequence, SequenceStatus

V = 32


def history_token(request_id: str, history: list[int]) -> int:
    """The fake model: a deterministic function of the token history only."""
    h = 7
    for t in history:
        h = (h * 1_000_003 + t + 1) % (1 << 61)
    return (h >> 7) % V


def reference(prompt: list[int], params: SamplingParams, eos: tuple[int, ...],
              max_model_len: int, next_token=history_token, request_id: str = "") -> tuple[list[int], str]:
    """What a request must produce, computed without any scheduler."""
    out: list[int] = []
    while True:
        t = next_token(request_id, prompt + out)
        out.append(t)
        if t in params.stop_token_ids or (not params.ignore_eos and t in eos):
            return out, "stop"
        if len(out) >= params.max_tokens or len(prompt) + len(out) >= max_model_len:
            return out, "length"


class FakeModel:
    """Writes token ids into page slots; samples from the history read back out of them."""

    def __init__(self, pool: BlockPool, next_token: Callable[[str, list[int]], int] = history_token):
        self.pool = pool
        self.next_token = next_token
        self.kv: dict[int, list[Optional[int]]] = {}
        self.chunk_of: dict[int, tuple] = {}  # hash -> page content when first seen cached

    def execute(self, batch) -> dict[str, int]:
        pool, ps = self.pool, self.pool.page_size
        sampled = {}
        for seq, n in batch.items:
            start = seq.num_computed_tokens
            assert len(seq.pages) == -(-(start + n) // ps), "pages do not cover the step"
            for pos in range(start, start + n):
                page = seq.pages[pos // ps]
                assert pool.ref_counts[page] == 1, f"writing page {page} that is shared"
                assert pool.page_hash[page] is None, f"writing page {page} that is published"
                self.kv.setdefault(page, [None] * ps)[pos % ps] = seq.token_id(pos)
            if start + n == seq.num_tokens:
                history = [self.kv[seq.pages[pos // ps]][pos % ps] for pos in range(seq.num_tokens)]
                assert history == seq.prompt_token_ids + seq.output_token_ids, \
                    f"{seq.request_id}: KV read back differs from the token history"
                sampled[seq.request_id] = self.next_token(seq.request_id, history)
        return sampled

    def check_cached_pages(self) -> None:
        """A page stays unchanged for as long as it is published under a hash."""
        for h, p in self.pool.cached.items():
            content = tuple(self.kv[p])
            assert None not in content, f"published page {p} is not full"
            if self.chunk_of.get(h, content) != content:
                raise AssertionError(f"page {p} changed while published under {h:#x}")
            self.chunk_of[h] = content
        # Forget hashes no longer published, so a later re-publication starts fresh.
        for h in list(self.chunk_of):
            if h not in self.pool.cached:
                del self.chunk_of[h]


@dataclass
class Run:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    seqs: dict[str, Sequence] = field(default_factory=dict)
    batches: list[list[tuple[str, int]]] = field(default_factory=list)
    sampled: list[dict[str, int]] = field(default_factory=list)
    steps: int = 0
    num_preemptions: int = 0
    lookaheads: int = 0
    model: Optional[FakeModel] = None


def check_state(sched: Scheduler) -> None:
    pool = sched.pool
    ps = pool.page_size
    pool.check_integrity()
    assert len(sched.running) <= sched.max_num_seqs
    refs = [0] * pool.num_pages
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING
        assert len(seq.pages) == -(-seq.num_computed_tokens // ps)
        assert seq.num_computed_tokens < seq.num_tokens
        assert seq.num_registered_pages == seq.num_computed_tokens // ps
        for i in range(seq.num_registered_pages):
            assert pool.page_hash[seq.pages[i]] in (None, seq.page_hashes[i])
        for p in seq.pages:
            refs[p] += 1
    assert pool.ref_counts == refs, "ref counts differ from the pages running sequences hold"
    for seq in sched.waiting:
        assert seq.status is SequenceStatus.WAITING
        assert seq.pages == [] and seq.num_computed_tokens == 0
    assert not set(map(id, sched.running)) & set(map(id, sched.waiting))


def drive(sched: Scheduler, requests, *, next_token=history_token, max_steps: int = 10_000,
          on_step: Optional[Callable[[int, Scheduler, Run], None]] = None,
          model: Optional[FakeModel] = None, lookahead: bool = False) -> Run:
    """Run requests to completion. `requests`: (arrival step, request id, prompt, params).
    Pass the `model` of an earlier run on the same scheduler to keep its KV contents.
    `lookahead`: as the engine with overlapped steps, take the next batch from
    `continue_decode` right after each update (requests arriving meanwhile wait)."""
    model = model or FakeModel(sched.pool, next_token)
    run = Run(model=model)
    ahead = None
    pending = sorted(requests, key=lambda r: r[0])
    step = 0
    while pending or sched.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            seq = Sequence(rid, prompt, params, arrival=len(run.seqs))
            run.seqs[rid] = seq
            sched.add(seq)
        if on_step is not None:
            on_step(step, sched, run)
        if not sched.has_unfinished():
            step += 1
            continue
        running_before = {id(s) for s in sched.running}
        batch, ahead = ahead or sched.schedule(), None
        # Progress: unfinished work always yields a non-empty batch.
        assert batch, f"step {step}: empty batch with {sched.num_waiting} waiting"
        assert batch.num_tokens <= sched.max_num_batched_tokens
        assert len(batch.items) <= sched.max_num_seqs
        assert len(sched.running) <= sched.max_num_seqs
        ids = [s.request_id for s, _ in batch.items]
        assert len(ids) == len(set(ids))
        for seq, n in batch.items:
            assert 1 <= n <= seq.num_tokens - seq.num_computed_tokens
            assert seq.status is SequenceStatus.RUNNING
        if batch.preempted:
            # Waiting sequences are admitted only in steps that preempted nothing.
            assert all(id(s) in running_before for s, _ in batch.items)
            for v in batch.preempted:
                assert v.status is SequenceStatus.WAITING and v.pages == []
                assert v in sched.waiting and v not in sched.running
        run.num_preemptions += len(batch.preempted)
        sampled = model.execute(batch)
        run.batches.append([(s.request_id, n) for s, n in batch.items])
        run.sampled.append(sampled)
        for fin in sched.update(batch, sampled):
            assert fin.sequence.status is SequenceStatus.FINISHED
            assert fin.sequence.pages == []
            run.outputs[fin.sequence.request_id] = list(fin.sequence.output_token_ids)
            run.reasons[fin.sequence.request_id] = fin.reason
        check_state(sched)
        model.check_cached_pages()
        if lookahead:
            ahead = sched.continue_decode(batch)
            if ahead is not None:
                run.lookaheads += 1
        step += 1
        assert step < max_steps, "no progress"
    run.steps = step
    assert sched.pool.num_free_pages == sched.pool.num_pages
    assert all(rc == 0 for rc in sched.pool.ref_counts)
    sched.pool.check_integrity()
    return run


def make(num_pages=64, page_size=4, max_num_seqs=8, budget=64, max_model_len=1024, eos=(),
         caching=True) -> Scheduler:
    return Scheduler(BlockPool(num_pages, page_size, caching), max_num_seqs, budget,
                     max_model_len, eos)


def greedy(max_tokens=16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def prompt_of(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729 + (i * i) % 13) % V for i in range(n)]


def check_against_reference(run: Run, requests, eos=(), max_model_len=1024):
    for _, rid, prompt, params in requests:
        want = reference(prompt, params, eos, max_model_len, request_id=rid)
        assert (run.outputs[rid], run.reasons[rid]) == want, rid


# -- basics ------------------------------------------------------------------------------

def test_single_request_prefill_then_decode():
    sched = make(page_size=4, budget=64)
    reqs = [(0, "a", prompt_of(1, 10), greedy(5))]
    run = drive(sched, reqs)
    check_against_reference(run, reqs)
    assert run.batches == [[("a", 10)]] + [[("a", 1)]] * 4
    assert run.reasons["a"] == "length"
    assert len(run.outputs["a"]) == 5


def test_token_budget_and_max_num_seqs():
    reqs = [(i // 3, f"r{i}", prompt_of(i, 3 + 5 * i % 23), greedy(2 + i % 5)) for i in range(12)]
    sched = make(num_pages=200, page_size=4, max_num_seqs=3, budget=7)
    run = drive(sched, reqs)
    check_against_reference(run, reqs)
    assert max(sum(n for _, n in b) for b in run.batches) == 7  # the budget gets used up
    assert max(len(b) for b in run.batches) == 3  # and so does the sequence limit
    assert all(sum(n for _, n in b) <= 7 and len(b) <= 3 for b in run.batches)


def test_waiting_requests_admitted_oldest_first():
    reqs = [(0, f"r{i}", prompt_of(i, 4), greedy(3)) for i in range(5)]
    sched = make(max_num_seqs=1)
    order = []

    def on_step(step, sched, run):
        if sched.running and (not order or order[-1] != sched.running[0].request_id):
            order.append(sched.running[0].request_id)

    run = drive(sched, reqs, on_step=on_step)
    check_against_reference(run, reqs)
    assert order == ["r0", "r1", "r2", "r3", "r4"]


def test_long_prompt_is_chunked_and_samples_only_at_its_end():
    sched = make(num_pages=64, page_size=4, budget=16)
    prompt = prompt_of(3, 50)
    reqs = [(0, "long", prompt, greedy(3)), (0, "short", prompt_of(4, 3), greedy(2))]
    seen_pages, queued = [], []

    def on_step(step, sched, run):
        seqs = run.seqs
        queued.append(sched.num_waiting_tokens)
        if "long" in seqs:
            seen_pages.append(len(seqs["long"].pages))

    run = drive(sched, reqs, on_step=on_step)
    check_against_reference(run, reqs)
    # Running sequences first, each asking for the rest of its tokens within the budget;
    # the short request gets the leftovers of the last chunk.
    assert run.batches[:4] == [[("long", 16)], [("long", 16)], [("long", 16)],
                               [("long", 2), ("short", 3)]]
    assert run.batches[4:] == [[("long", 1), ("short", 1)], [("long", 1)]]
    # Samples only at the end of the prompt.
    assert [("long" in s) for s in run.sampled] == [False, False, False, True, True, True]
    # Pages grow with the chunks (before each schedule(): 0, 4, 8, 12, 13 ...).
    assert seen_pages[:5] == [0, 4, 8, 12, 13]
    # Tokens still to prefill (what the engine reports to a router): both prompts, then
    # the long prompt's rest chunk by chunk, then nothing while they decode.
    assert queued[:6] == [53, 37, 21, 5, 0, 0], queued


def test_chunk_boundaries_not_page_aligned():
    sched = make(num_pages=64, page_size=3, budget=5)
    reqs = [(0, "a", prompt_of(9, 23), greedy(4))]
    run = drive(sched, reqs)
    check_against_reference(run, reqs)
    assert [n for b in run.batches for _, n in b] == [5, 5, 5, 5, 3, 1, 1, 1]


def test_decoding_sequences_get_one_token_per_step():
    reqs = [(0, f"r{i}", prompt_of(i, 5 + i), greedy(6)) for i in range(4)]
    sched = make(budget=64)
    run = drive(sched, reqs)
    check_against_reference(run, reqs)
    assert run.batches[0] == [("r0", 5), ("r1", 6), ("r2", 7), ("r3", 8)]
    for b in run.batches[1:]:
        assert b == [(f"r{i}", 1) for i in range(4)]
    assert len(run.batches) == 6


def test_budget_of_one_token():
    reqs = [(0, "a", prompt_of(1, 3), greedy(2)), (0, "b", prompt_of(2, 2), greedy(2))]
    sched = make(budget=1)
    run = drive(sched, reqs)
    check_against_reference(run, reqs)
    assert all(b == [(b[0][0], 1)] for b in run.batches)
    # The oldest running sequence always goes first: a runs alone to its end.
    assert [b[0][0] for b in run.batches] == ["a"] * 4 + ["b"] * 3


# -- prefix caching ----------------------------------------------------------------------

def test_prefix_cache_hits_after_a_finished_request():
    ps = 4
    base = prompt_of(5, 40)
    sched = make(num_pages=128, page_size=ps, budget=64)
    first = [(0, "a", base, greedy(9))]
    run_a = drive(sched, first)
    check_against_reference(run_a, first)
    out_a = run_a.outputs["a"]
    assert run_a.seqs["a"].num_cached_tokens == 0
    assert sched.pool.query_tokens == 40 and sched.pool.hit_tokens == 0

    cases = {
        "shares30": (base[:30] + prompt_of(6, 10), 28),   # 7 full shared pages
        "identical": (list(base), 36),                  # last token recomputed: 9 pages, not 10
        "aligned8": (base[:8], 4),                      # 8 tokens = 2 pages, yet only 1 hits
        "one_page": (base[:4], 0),
        "shares3": (base[:3] + [(base[3] + 1) % V] * 10, 0),
        "with_out": (base + out_a[:8], 44),             # pages written while decoding count too
        "longer": (base + out_a[:8] + [1, 2, 3], 48),
    }
    for rid, (prompt, want) in cases.items():
        reqs = [(0, rid, prompt, greedy(3))]
        q, h = sched.pool.query_tokens, sched.pool.hit_tokens
        run = drive(sched, reqs, model=run_a.model)
        check_against_reference(run, reqs)
        seq = run.seqs[rid]
        assert seq.num_cached_tokens == want, rid
        assert seq.num_cached_tokens < len(prompt)
        assert run.batches[0] == [(rid, len(prompt) - want)], rid
        assert (sched.pool.query_tokens - q, sched.pool.hit_tokens - h) == (len(prompt), want)
    assert 0 < sched.pool.hit_rate < 1


def test_prefix_cache_hits_on_a_running_request():
    ps = 4
    base = prompt_of(8, 33)
    sched = make(num_pages=128, page_size=ps, budget=64)
    shared = []

    def on_step(step, sched, run):
        if step == 2:
            a, b = run.seqs["a"], run.seqs["b"]
            assert a.status is SequenceStatus.RUNNING and b.status is SequenceStatus.RUNNING
            shared.extend(a.pages[:7])
            assert b.pages[:7] == a.pages[:7]
            assert all(sched.pool.ref_counts[p] == 2 for p in a.pages[:7])
            assert not set(a.pages[7:]) & set(b.pages[7:])

    reqs = [(0, "a", base, greedy(6)), (1, "b", base[:29] + [0, 1, 2], greedy(6))]
    run = drive(sched, reqs, on_step=on_step)
    check_against_reference(run, reqs)
    assert run.seqs["b"].num_cached_tokens == 28
    assert run.batches[1] == [("a", 1), ("b", 4)]
    assert len(shared) == 7


def test_no_hits_on_pages_computed_in_the_same_step():
    prompt = prompt_of(2, 20)
    sched = make(page_size=4, budget=64)
    reqs = [(0, "a", prompt, greedy(3)), (0, "b", list(prompt), greedy(3))]
    run = drive(sched, reqs)
    check_against_reference(run, reqs)
    # Both admitted in one step; a's pages are not computed yet when b looks them up.
    assert run.seqs["b"].num_cached_tokens == 0
    assert run.batches[0] == [("a", 20), ("b", 20)]


def test_identical_prompt_one_token_per_page():
    sched = make(page_size=1, budget=64)
    prompt = prompt_of(4, 6)
    run1 = drive(sched, [(0, "a", prompt, greedy(2))])
    run2 = drive(sched, [(0, "b", list(prompt), greedy(2))], model=run1.model)
    assert run2.seqs["b"].num_cached_tokens == 5
    assert run2.batches[0] == [("b", 1)]
    assert run2.outputs["b"] == run1.outputs["a"]


def test_prefix_caching_disabled():
    base = prompt_of(5, 24)
    sched = make(page_size=4, caching=False)
    reqs = [(0, "a", base, greedy(4)), (3, "b", list(base), greedy(4)), (9, "c", base[:17], greedy(4))]
    run = drive(sched, reqs)
    check_against_reference(run, reqs)
    assert all(s.num_cached_tokens == 0 for s in run.seqs.values())
    assert sched.pool.cached == {}
    assert sched.pool.hit_tokens == 0


# -- preemption --------------------------------------------------------------------------

@pytest.mark.parametrize("page_size,extra_pages,budget",
                         [(2, 0, 64), (2, 1, 5), (4, 0, 16), (1, 0, 3), (1, 2, 64), (3, 1, 7)])
def test_preemption_reproduces_big_pool_outputs(page_size, extra_pages, budget):
    reqs = [(i % 3, f"r{i}", prompt_of(10 + i, 3 + (3 * i) % 7), greedy(3 + i % 4)) for i in range(7)]
    # Each request fits alone (the engine's admission rule); together they do not.
    num_pages = max(-(-(len(p) + sp.max_tokens) // page_size) for _, _, p, sp in reqs) + extra_pages
    small = make(num_pages=num_pages, page_size=page_size, max_num_seqs=4, budget=budget)
    run = drive(small, reqs)
    big = drive(make(num_pages=1000, page_size=page_size, max_num_seqs=4, budget=budget), reqs)
    assert small.num_preemptions > 0
    assert run.num_preemptions == small.num_preemptions
    assert sum(s.num_preemptions for s in run.seqs.values()) == small.num_preemptions
    assert set(run.outputs) == {rid for _, rid, _, _ in reqs}
    assert run.outputs == big.outputs and run.reasons == big.reasons
    check_against_reference(run, reqs)


def test_preempted_sequence_recomputes_prompt_and_outputs():
    # Two requests that cannot both hold their pages to the end: the later one is preempted
    # mid-decode and must recompute prompt + emitted tokens, then continue identically.
    ps = 2
    reqs = [(0, "a", prompt_of(1, 4), greedy(6)), (0, "b", prompt_of(2, 4), greedy(6))]
    sched = make(num_pages=6, page_size=ps, max_num_seqs=2, budget=64)
    events = []

    def on_step(step, sched, run):
        b = run.seqs.get("b")
        if b is not None:
            events.append((b.status, len(b.output_token_ids), b.num_computed_tokens))

    run = drive(sched, reqs, on_step=on_step)
    check_against_reference(run, reqs)
    b = run.seqs["b"]
    assert b.num_preemptions >= 1 and run.seqs["a"].num_preemptions == 0
    assert b.num_cached_tokens == 0  # set at first admission only
    # b was preempted after emitting tokens: it waited with outputs and no computed KV.
    assert any(st is SequenceStatus.WAITING and n_out > 0 and comp == 0 for st, n_out, comp in events)
    # Preemption never drops emitted tokens.
    outs = [n for _, n, _ in events]
    assert outs == sorted(outs)


def test_preemption_victim_is_most_recent_arrival():
    reqs = [(0, f"r{i}", prompt_of(i, 3), greedy(8)) for i in range(3)]
    sched = make(num_pages=8, page_size=2, max_num_seqs=3, budget=64)
    victims = []
    orig = sched._preempt

    def spy(seq):
        victims.append((seq.request_id, [s.request_id for s in sched.running]))
        orig(seq)

    sched._preempt = spy
    run = drive(sched, reqs)
    check_against_reference(run, reqs)
    assert victims
    for rid, running_after_pop in victims:
        # The victim was the last of the running list (popped before the spy ran).
        assert rid not in running_after_pop
        assert all(run.seqs[r].arrival < run.seqs[rid].arrival for r in running_after_pop)


# -- abort -------------------------------------------------------------------------------

def test_abort_frees_pages():
    sched = make(num_pages=32, page_size=4, budget=64)
    base = prompt_of(3, 17)
    reqs = [(0, "a", base, greedy(10)), (1, "b", base[:9] + [1] * 8, greedy(10)),
            (3, "c", prompt_of(4, 5), greedy(10))]
    aborted = {}

    def on_step(step, sched, run):
        if step == 2:
            free = sched.pool.num_free_pages
            b = run.seqs["b"]
            assert b.num_cached_tokens == 8 and sched.pool.ref_counts[b.pages[0]] == 2
            exclusive = [p for p in b.pages if sched.pool.ref_counts[p] == 1]
            assert sched.abort("b") is b
            aborted["b"] = b
            assert b.status is SequenceStatus.FINISHED and b.finish_reason == "abort"
            assert b.pages == [] and b not in sched.running
            assert sched.pool.num_free_pages == free + len(exclusive)
            check_state(sched)
        if step == 3:
            c = run.seqs["c"]
            assert c.status is SequenceStatus.WAITING
            assert sched.abort("c") is c and c.finish_reason == "abort"
            assert not sched.waiting
            assert sched.abort("c") is None
            assert sched.abort("nope") is None
            check_state(sched)

    run = drive(sched, reqs, on_step=on_step)
    assert set(run.outputs) == {"a"}
    check_against_reference(run, reqs[:1])
    assert sched.abort("a") is None  # finished already
    assert sched.pool.num_free_pages == 32


def test_abort_everything():
    sched = make(num_pages=16, page_size=2, budget=4)
    seqs = [Sequence(f"r{i}", prompt_of(i, 7), greedy(5), i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    model = FakeModel(sched.pool)
    for _ in range(3):
        batch = sched.schedule()
        sched.update(batch, model.execute(batch))
        check_state(sched)
    for s in seqs:
        assert sched.abort(s.request_id) is s
        check_state(sched)
    assert not sched.has_unfinished()
    assert sched.pool.num_free_pages == 16
    sched.pool.check_integrity()


# -- finishing ---------------------------------------------------------------------------

def scripted(script: dict[str, list[int]]):
    def next_token(rid, history):
        return script[rid][len(history) - base_len[rid]]
    base_len: dict[str, int] = {}
    return next_token, base_len


def run_scripted(script, reqs, eos=(), max_model_len=1024):
    next_token, base_len = scripted(script)
    for _, rid, prompt, _ in reqs:
        base_len[rid] = len(prompt)
    sched = make(eos=eos, max_model_len=max_model_len)
    return drive(sched, reqs, next_token=next_token)


def test_stop_token_finishes_with_stop():
    run = run_scripted({"a": [5, 6, 7, 8, 9]}, [(0, "a", [1, 2], greedy(10, stop_token_ids=[7, 30]))])
    assert run.outputs["a"] == [5, 6, 7] and run.reasons["a"] == "stop"
    assert run.seqs["a"].finish_reason == "stop"


def test_eos_and_ignore_eos():
    script = {"a": [5, 9, 6, 9, 4, 4], "b": [5, 9, 6, 9, 4, 4], "c": [5, 9, 6, 9, 4, 4]}
    reqs = [(0, "a", [1], greedy(6)),
            (0, "b", [1], greedy(6, ignore_eos=True)),
            (0, "c", [1], greedy(6, ignore_eos=True, stop_token_ids=(6,)))]
    run = run_scripted(script, reqs, eos=(9, 11))
    assert (run.outputs["a"], run.reasons["a"]) == ([5, 9], "stop")
    assert (run.outputs["b"], run.reasons["b"]) == ([5, 9, 6, 9, 4, 4], "length")
    assert (run.outputs["c"], run.reasons["c"]) == ([5, 9, 6], "stop")


def test_max_tokens_finishes_with_length():
    run = run_scripted({"a": [3] * 10, "b": [3] * 10},
                       [(0, "a", [1, 2, 3], greedy(4)), (0, "b", [1], greedy(1))])
    assert (run.outputs["a"], run.reasons["a"]) == ([3] * 4, "length")
    assert (run.outputs["b"], run.reasons["b"]) == ([3], "length")
    assert run.batches[0] == [("a", 3), ("b", 1)]  # b finishes right after its prefill


def test_stop_on_last_allowed_token_reports_stop():
    run = run_scripted({"a": [3, 3, 7]}, [(0, "a", [1], greedy(3, stop_token_ids=[7]))], eos=())
    assert (run.outputs["a"], run.reasons["a"]) == ([3, 3, 7], "stop")
    run = run_scripted({"a": [3, 3, 9]}, [(0, "a", [1], greedy(3))], eos=(9,))
    assert (run.outputs["a"], run.reasons["a"]) == ([3, 3, 9], "stop")


def test_max_model_len_finishes_with_length():
    reqs = [(0, "a", [1, 2, 3, 4, 5], greedy(100)), (0, "b", [1] * 7, greedy(100))]
    run = run_scripted({"a": [2] * 10, "b": [2] * 10}, reqs, max_model_len=8)
    assert (run.outputs["a"], run.reasons["a"]) == ([2, 2, 2], "length")
    assert run.seqs["a"].num_tokens == 8
    assert (run.outputs["b"], run.reasons["b"]) == ([2], "length")


def test_stop_token_included_and_pages_freed_midway():
    sched = make(num_pages=20, page_size=2, eos=(0,))
    reqs = [(0, f"r{i}", prompt_of(i, 5 + i), greedy(30)) for i in range(6)]
    run = drive(sched, reqs)
    check_against_reference(run, reqs, eos=(0,))
    for rid, out in run.outputs.items():
        if run.reasons[rid] == "stop":
            assert out[-1] == 0 and 0 not in out[:-1]


# -- random mixes ------------------------------------------------------------------------

@st.composite
def workloads(draw):
    page_size = draw(st.integers(1, 8))
    bases = [draw(st.lists(st.integers(0, V - 1), min_size=8, max_size=60)) for _ in range(2)]
    reqs = []
    for i in range(draw(st.integers(1, 8))):
        base = bases[draw(st.integers(0, 1))]
        k = draw(st.one_of(st.just(len(base)), st.integers(0, len(base))))
        suffix = draw(st.lists(st.integers(0, V - 1), min_size=1 if k == 0 else 0, max_size=20))
        prompt = (base[:k] + suffix)[:60]
        params = greedy(draw(st.integers(1, 10)), ignore_eos=draw(st.booleans()),
                        stop_token_ids=draw(st.lists(st.integers(0, V - 1), max_size=1)))
        reqs.append((draw(st.integers(0, 12)), f"r{i}", prompt, params))
    longest = max(len(p) for _, _, p, _ in reqs)
    max_model_len = draw(st.one_of(st.just(1000), st.integers(longest + 1, longest + 8)))
    need = max(-(-min(len(p) + sp.max_tokens, max_model_len) // page_size) for _, _, p, sp in reqs)
    num_pages = draw(st.one_of(st.just(need), st.just(need + 1), st.integers(need, need + 4),
                               st.integers(need, 4 * need)))
    eos = tuple(draw(st.lists(st.integers(0, V - 1), max_size=1)))
    return dict(page_size=page_size, num_pages=num_pages, reqs=reqs, eos=eos,
                max_model_len=max_model_len, budget=draw(st.integers(1, 64)),
                max_num_seqs=draw(st.integers(1, 8)),
                caching=draw(st.sampled_from([True, True, True, False])))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_match_reference(w):
    sched = Scheduler(BlockPool(w["num_pages"], w["page_size"], w["caching"]), w["max_num_seqs"],
                      w["budget"], w["max_model_len"], w["eos"])
    run = drive(sched, w["reqs"])
    assert set(run.outputs) == {rid for _, rid, _, _ in w["reqs"]}
    check_against_reference(run, w["reqs"], w["eos"], w["max_model_len"])
    big = Scheduler(BlockPool(2000, w["page_size"]), w["max_num_seqs"], w["budget"],
                    w["max_model_len"], w["eos"])
    ref = drive(big, w["reqs"])
    assert big.num_preemptions == 0
    assert run.outputs == ref.outputs and run.reasons == ref.reasons
    if sched.num_preemptions:
        event("preempted")
    if sched.pool.hit_tokens:
        event("prefix-cache hits")
    if any(r == "stop" for r in run.reasons.values()):
        event("stopped early")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_with_lookahead_match_reference(w):
    """Batches taken from `continue_decode` (the engine's overlapped steps) give the
    reference tokens, keep every invariant, and leave no page behind."""
    sched = Scheduler(BlockPool(w["num_pages"], w["page_size"], w["caching"]), w["max_num_seqs"],
                      w["budget"], w["max_model_len"], w["eos"])
    run = drive(sched, w["reqs"], lookahead=True)
    check_against_reference(run, w["reqs"], w["eos"], w["max_model_len"])
    if run.lookaheads:
        event("looked ahead")


def test_continue_decode_only_for_steady_decode():
    sched = make(num_pages=6, page_size=4, max_num_seqs=4)
    a = Sequence("a", prompt_of(1, 3), greedy(20), arrival=0)
    sched.add(a)
    batch = sched.schedule()
    sched.update(batch, {"a": 5})  # prompt done, first token out
    assert sched.continue_decode(batch) is None  # the batch was the prompt (3 tokens)
    batch = sched.schedule()
    assert batch.items == [(a, 1)] and len(a.pages) == 1
    sched.update(batch, {"a": 6})
    nxt = sched.continue_decode(batch)
    assert nxt.items == [(a, 1)] and len(a.pages) == 2  # grown for position 4
    sched.update(nxt, {"a": 7})
    sched.add(Sequence("b", prompt_of(2, 3), greedy(4), arrival=1))
    assert sched.continue_decode(nxt) is None  # b waits: schedule normally


def test_continue_decode_needs_free_pages():
    sched = make(num_pages=2, page_size=4, max_num_seqs=4, caching=False)
    a = Sequence("a", prompt_of(1, 7), greedy(20), arrival=0)
    sched.add(a)
    batch = sched.schedule()
    sched.update(batch, {"a": 5})
    batch = sched.schedule()
    assert batch.items == [(a, 1)]
    sched.update(batch, {"a": 6})  # 9 tokens: the 9th (position 8) needs a third page
    assert sched.continue_decode(batch) is None and len(a.pages) == 2
