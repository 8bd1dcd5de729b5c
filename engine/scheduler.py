"""Token-budget scheduler: no prefill/decode phases.

Each step hands out at most `max_num_batched_tokens` tokens to at most `max_num_seqs`
sequences. Running sequences go first, in arrival order, each asking for the rest of its
uncomputed tokens (one for a decoding sequence, a chunk of a long prompt otherwise).
When pages run out, the most recently arrived running sequence is preempted: its pages
are released (they stay in the prefix cache) and it is recomputed later from its prompt
plus the tokens it already emitted. Waiting sequences are admitted only in steps that
preempted nothing, oldest first, after a prefix-cache lookup.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional
from typing import Sequence as Seq

from .block_pool import BlockPool, hash_pages
from .sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: `(sequence, number of new tokens)` in batch order."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


@dataclass(slots=True)
class FinishedSequence:
    sequence: Sequence
    reason: str


class Scheduler:
    """Admits, schedules, preempts and finishes the sequences of one rank."""

    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Disaggregation (ARCHITECTURE §2): pages of finished prefills still being read
        # by decode ranks; pages reserved for KV arriving from prefill; sequences whose
        # KV has landed, waiting for a running slot.
        self.held: dict[str, list[int]] = {}
        self.reserved: dict[str, list[int]] = {}
        self.prefilled: deque[Sequence] = deque()

    # -- admission -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Optional[Sequence]:
        self.release_held(request_id)
        self.unreserve(request_id)
        for queue in (self.running, self.waiting, self.prefilled):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq, "abort")
                    return seq
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.prefilled)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.prefilled)

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens still to prefill: all uncomputed tokens of waiting sequences (a
        preempted one recomputes its output too) plus the prompt rest of running ones
        in chunked prefill. What a router weighs as a group's queued work."""
        waiting = sum(seq.num_tokens - seq.num_computed_tokens for seq in self.waiting)
        return waiting + sum(max(seq.num_prompt_tokens - seq.num_computed_tokens, 0)
                             for seq in self.running)

    # -- KV that crosses groups (prefill → decode) -----------------------------------
    def release_held(self, request_id: str) -> bool:
        """Free the pages a finished prefill kept for its readers."""
        pages = self.held.pop(request_id, None)
        if pages is not None:
            self.pool.release(pages)
        return pages is not None

    def reserve(self, request_id: str, prompt_token_ids: Seq[int],
                prefix_root: Optional[int] = None) -> Optional[tuple[list[int], int]]:
        """Pages for a prompt's KV that will arrive from prefill: (pages, cached tokens),
        or None when the pool cannot spare them now (the caller retries later). The
        prompt's longest cached chain of full pages (short of its last token: at least
        one page always comes from prefill) is reused, so only the tokens from `cached`
        on need to arrive. `prefix_root`: the request's `SamplingParams.prefix_root`."""
        if request_id in self.reserved:
            raise ValueError(f"request_id {request_id!r} already has a reservation")
        ps, n = self.pool.page_size, len(prompt_token_ids)
        hits = self.pool.match_prefix(hash_pages(prompt_token_ids[:n - 1], ps, prefix_root))
        need = -(-n // ps) - len(hits)
        if need > self.pool.num_free_after_acquire(hits):
            return None
        self.pool.acquire(hits)
        self.reserved[request_id] = pages = hits + self.pool.allocate(need)
        return list(pages), len(hits) * ps

    def unreserve(self, request_id: str) -> bool:
        pages = self.reserved.pop(request_id, None)
        if pages is not None:
            self.pool.release(pages)
        return pages is not None

    def admit_prefilled(self, seq: Sequence) -> None:
        """Queue `seq` (prompt + its first token) whose prompt KV has landed in the pages
        reserved under its id; it joins the running batch when a slot is free."""
        pages = self.reserved.pop(seq.request_id, None)
        if pages is None:
            raise ValueError(f"request_id {seq.request_id!r} has no reservation")
        seq.pages = pages
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.status = SequenceStatus.WAITING
        self.prefilled.append(seq)

    # -- one step --------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        while self.prefilled and len(self.running) < self.max_num_seqs:
            seq = self.prefilled.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self._grow(seq, n, batch):
                batch.items.append((seq, n))
                budget -= n
                i += 1
        if not batch.preempted:
            budget = self._admit(budget, batch)
        return batch

    def continue_decode(self, batch: ScheduledBatch, in_flight: bool = False
                        ) -> Optional[ScheduledBatch]:
        """The next step's batch when `schedule()` would return `batch` again with every
        sequence one token further: `batch` (already `update`d) was all decode, nothing
        finished or was preempted, nothing waits, and the pages for one more token each
        are free; those pages are then allocated. None otherwise (schedule normally).

        `in_flight`: `batch`'s own tokens are not in yet (not `update`d); every sequence
        is assumed to go on, with pages grown for the token after the one in flight. A
        sequence that then finishes has its row of the returned batch ignored."""
        ahead = 2 if in_flight else 1
        items = batch.items
        if (batch.preempted or self.waiting or self.prefilled
                or len(self.running) != len(items) or len(items) > self.max_num_batched_tokens):
            return None
        need = 0
        for (seq, n), running in zip(items, self.running):
            if seq is not running or n != 1 or seq.num_tokens - seq.num_computed_tokens != 1:
                return None
            need += self._pages_for(seq, ahead)
        if need > self.pool.num_free_pages:
            return None
        for seq, _ in items:
            grow = self._pages_for(seq, ahead)
            if grow:
                seq.pages.extend(self.pool.allocate(grow))
        return ScheduledBatch([(seq, 1) for seq, _ in items])

    def _pages_for(self, seq: Sequence, n: int) -> int:
        need = -(-(seq.num_computed_tokens + n) // self.pool.page_size)
        return max(0, need - len(seq.pages))

    def _grow(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Give `seq` pages for `n` more tokens, preempting later arrivals if needed.
        Returns False when `seq` itself had to be preempted."""
        need = self._pages_for(seq, n)
        while need > self.pool.num_free_pages:
            victim = self.running.pop()
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        seq.pages.extend(self.pool.allocate(need))
        return True

    def _preempt(self, seq: Sequence) -> None:
        if seq.hold_kv:  # pages may still be read by an in-flight KV transfer: keep them
            self.held.setdefault(seq.request_id, []).extend(seq.pages)
        else:
            self.pool.release(seq.pages)
        seq.pages = []
        seq.num_computed_tokens = 0
        seq.num_registered_pages = 0
        if not seq.output_token_ids:
            seq.prompt_logprobs.clear()  # scored again from the first position
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _admit(self, budget: int, batch: ScheduledBatch) -> int:
        ps = self.pool.page_size
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # The last token is always recomputed: its logits are needed. Prompt logprobs
            # need every position's logits: such a prompt reuses no cached page.
            hits = [] if _scores_prompt(seq) else \
                self.pool.match_prefix(seq.full_page_hashes(ps, seq.num_tokens - 1))
            computed = len(hits) * ps
            n = min(seq.num_tokens - computed, budget)
            need = -(-(computed + n) // ps) - len(hits)
            if need > self.pool.num_free_after_acquire(hits):
                break
            self.waiting.popleft()
            self.pool.acquire(hits)
            seq.pages = hits + self.pool.allocate(need)
            seq.num_computed_tokens = computed
            seq.num_registered_pages = len(hits)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = computed
                self.pool.record_lookup(seq.num_tokens, computed)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.items.append((seq, n))
            budget -= n
        return budget

    # -- results ---------------------------------------------------------------------
    def update(self, batch: ScheduledBatch, sampled: dict[str, int]) -> list[FinishedSequence]:
        """Advance every scheduled sequence; append the token sampled for each sequence
        whose step reached its end. Returns the sequences that finished."""
        finished = []
        for seq, n in batch.items:
            seq.num_computed_tokens += n
            self._register_full_pages(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            token = sampled[seq.request_id]
            seq.output_token_ids.append(token)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
                finished.append(FinishedSequence(seq, reason))
        return finished

    def _register_full_pages(self, seq: Sequence) -> None:
        ps = self.pool.page_size
        hashes = seq.full_page_hashes(ps, seq.num_computed_tokens)
        for i in range(seq.num_registered_pages, len(hashes)):
            self.pool.register(seq.pages[i], hashes[i])
        seq.num_registered_pages = len(hashes)

    def _stop_reason(self, seq: Sequence, token: int) -> Optional[str]:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.hold_kv and reason != "abort":
            self.held.setdefault(seq.request_id, []).extend(seq.pages)
        else:
            self.pool.release(seq.pages)
        seq.pages = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason


def _scores_prompt(seq: Sequence) -> bool:
    return seq.params.prompt_logprobs is not None and not seq.output_token_ids
