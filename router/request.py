"""One request's record: the single source of truth of what its client has received.

The router keeps one `RequestRecord` per request from arrival to its end. Tokens come
back from the engines tagged with their index in the output; `accept` turns every such
message into the (index, token) pairs to forward to the client, so that the client sees
each index exactly once and in order, whatever the engines send:

- indexes below `next_index` are dropped (duplicates: a re-run after recovery replays
  tokens the client already has; with seeded sampling they are the same tokens);
- an index above `next_index` is a gap: `TokenGapError`, never a silent skip;
- nothing is forwarded once the request has ended (finished, aborted or failed).

After a fault, a request whose KV is lost is re-prefilled from `resume_tokens()` (prompt
plus every token emitted so far) and streams on from `next_index`.

States: QUEUED -> PREFILLING -> DECODING -> FINISHED, with ABORTED (client gone or
cancelled) and FAILED (unrecoverable) reachable from any live state; recovery moves a live
request back to QUEUED or PREFILLING. The three end states are final.
"""

from __future__ import annotations

import enum
import random
from dataclasses import InitVar, dataclass, field
from typing import Any, Hashable, Optional, Sequence

_SYSTEM_RNG = random.SystemRandom()
SEED_BITS = 63  # the engine draws seeds of this width too


class RequestState(enum.Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({RequestState.FINISHED, RequestState.ABORTED, RequestState.FAILED})
_LIVE = (RequestState.QUEUED, RequestState.PREFILLING, RequestState.DECODING)
_ALLOWED: dict[RequestState, frozenset[RequestState]] = {
    s: frozenset(_LIVE) | _TERMINAL for s in _LIVE
}
_ALLOWED.update({s: frozenset() for s in _TERMINAL})


class TokenGapError(ValueError):
    """Tokens arrived for an index past the next one the client is owed."""


class RequestStateError(RuntimeError):
    """An illegal state transition or an inconsistent finish."""


def _check_tokens(name: str, tokens: Sequence[int]) -> None:
    """ValueError unless every token is a plain non-negative int (bool is refused)."""
    if not set(map(type, tokens)) <= {int}:
        bad = next(t for t in tokens if type(t) is not int)
        raise ValueError(f"{name} must be non-negative integers, got {bad!r}")
    if tokens and min(tokens) < 0:
        raise ValueError(f"{name} must be non-negative integers, got {min(tokens)!r}")


@dataclass(slots=True, eq=False)
class RequestRecord:
    """Everything the router knows about one request (see the module docstring).

    `sampling_params` is opaque here (the engine's `SamplingParams`); the record reads
    `.max_tokens` (emitted tokens never exceed it) and pins `.seed` at construction when
    it is None and the params have `with_seed`, so a re-run after a fault samples the same
    tokens wherever it lands. `seed_rng` (construction only) draws that seed; default: the
    system's random source. `page_hashes` is the router's (see `Router.prepare`).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: Any = None
    seed_rng: InitVar[Optional[random.Random]] = None
    output_token_ids: list[int] = field(default_factory=list)
    state: RequestState = RequestState.QUEUED
    dp_group: Optional[Hashable] = None
    prefill_instance: Optional[Hashable] = None
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    recoveries: int = 0
    # page size -> chain hashes of the prompt's full pages: computed once per request (at
    # admission, `Router.prepare`, or at its first routing) and reused by every later one
    page_hashes: dict[int, Sequence[int]] = field(default_factory=dict, repr=False)

    def __post_init__(self, seed_rng: Optional[random.Random]) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        self.prompt_token_ids = tuple(self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: empty prompt")
        _check_tokens("prompt_token_ids", self.prompt_token_ids)
        p = self.sampling_params
        if p is not None and getattr(p, "seed", 0) is None and hasattr(p, "with_seed"):
            self.sampling_params = p.with_seed((seed_rng or _SYSTEM_RNG).getrandbits(SEED_BITS))

    # ---- what the client has --------------------------------------------------------

    @property
    def next_index(self) -> int:
        """Index of the next output token the client is owed (= tokens emitted)."""
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> Optional[int]:
        return getattr(self.sampling_params, "max_tokens", None)

    @property
    def done(self) -> bool:
        return self.state.terminal

    def resume_tokens(self) -> list[int]:
        """Prompt + emitted tokens: what a re-prefill after a fault runs from."""
        return [*self.prompt_token_ids, *self.output_token_ids]

    def remaining_tokens(self) -> Optional[int]:
        """Tokens still to generate under `max_tokens` (None: no bound known)."""
        m = self.max_tokens
        return None if m is None else m - self.next_index

    def accept(self, index: int, token_ids: Sequence[int], finished: bool = False,
               finish_reason: Optional[str] = None) -> list[tuple[int, int]]:
        """Takes tokens `token_ids` at output indexes `index, index+1, ...` (and the end of
        the request when `finished`); returns the new (index, token) pairs, in order, that
        the client must get now — each index is returned at most once over the record's
        life. Drops duplicates and anything after the end; raises `TokenGapError` on a gap,
        `RequestStateError` on a finish that contradicts tokens already emitted, and
        ValueError past `max_tokens` or on a bad token."""
        if self.state.terminal:
            return []
        if not isinstance(index, int) or index < 0:
            raise ValueError(f"request {self.request_id}: bad token index {index!r}")
        nxt = self.next_index
        if index > nxt:
            raise TokenGapError(f"request {self.request_id}: tokens from index {index} but "
                                f"the client is owed index {nxt} next")
        end = index + len(token_ids)
        if finished and end < nxt:
            raise RequestStateError(f"request {self.request_id}: finish after index {end} but "
                                    f"{nxt} tokens were already emitted")
        fresh = list(token_ids[nxt - index:]) if end > nxt else []
        if fresh:
            _check_tokens("token_ids", fresh)
            m = self.max_tokens
            if m is not None and end > m:
                raise ValueError(f"request {self.request_id}: {end} tokens exceed "
                                 f"max_tokens={m}")
            self.output_token_ids.extend(fresh)
            if self.state is not RequestState.DECODING:
                self.state = RequestState.DECODING
        if finished:
            self.state = RequestState.FINISHED
            self.finish_reason = finish_reason
        return list(enumerate(fresh, start=nxt))

    # ---- lifecycle ------------------------------------------------------------------

    def transition(self, new: RequestState) -> None:
        """Moves to `new`; RequestStateError if the move is not allowed (ends are final)."""
        if new is self.state:
            return
        if new not in _ALLOWED[self.state]:
            raise RequestStateError(f"request {self.request_id}: cannot go from "
                                    f"{self.state.value} to {new.value}")
        self.state = new

    def place(self, dp_group: Optional[Hashable] = None,
              prefill_instance: Optional[Hashable] = None) -> None:
        """Records where the request runs (None leaves a field as it is)."""
        if self.state.terminal:
            raise RequestStateError(f"request {self.request_id} has ended; cannot place it")
        if dp_group is not None:
            self.dp_group = dp_group
        if prefill_instance is not None:
            self.prefill_instance = prefill_instance

    def requeue(self) -> list[int]:
        """After a fault lost its KV: back to QUEUED, placement cleared, one more
        recovery counted; returns `resume_tokens()` to re-prefill from."""
        self.transition(RequestState.QUEUED)
        self.dp_group = None
        self.prefill_instance = None
        self.recoveries += 1
        return self.resume_tokens()

    def abort(self, reason: str = "abort") -> bool:
        """Ends the request (client gone / cancelled); False if it had already ended."""
        if self.state.terminal:
            return False
        self.state = RequestState.ABORTED
        self.finish_reason = reason
        return True

    def fail(self, error: str) -> bool:
        """Ends the request as unrecoverable with `error`; False if it had already ended."""
        if self.state.terminal:
            return False
        self.state = RequestState.FAILED
        self.error = error
        self.finish_reason = "error"
        return True


__all__ = ["RequestRecord", "RequestState", "RequestStateError", "SEED_BITS", "TokenGapError"]
