"""A synthetic multi-turn chat trace with shared system prompts, for evaluating placement
(tests and `bench/router.py`); not used when serving.

Each conversation picks one of a few system prompts; turn k's prompt is the system
prompt, then every earlier (user, answer) pair, then the new user message — so a turn's
prompt extends the previous turn's prompt plus answer, and conversations sharing a system
prompt share its pages. Conversations start `start_gap_s` apart (with jitter); a turn
arrives after the previous answer is complete plus a think time. Token ids, lengths and
times come from one seeded `random.Random`: the same spec gives the same trace.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One turn: its prompt, the answer the model gives, and when it runs."""

    request_id: str
    conversation: int
    turn: int
    system_prompt: int
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    arrival_s: float
    duration_s: float


@dataclass(frozen=True, slots=True)
class TraceSpec:
    """Shape of a trace; ranges are inclusive (min, max) and drawn uniformly."""

    conversations: int = 96
    turns: tuple[int, int] = (3, 8)
    system_prompts: int = 3
    system_tokens: int = 512
    user_tokens: tuple[int, int] = (32, 256)
    answer_tokens: tuple[int, int] = (64, 384)
    start_gap_s: float = 1.0
    think_s: tuple[float, float] = (2.0, 10.0)
    seconds_per_output_token: float = 0.02
    vocab: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("turns", "user_tokens", "answer_tokens", "think_s"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"TraceSpec.{name}: need 0 <= min <= max, got {(lo, hi)}")
        if self.conversations < 1 or self.system_prompts < 1 or self.turns[0] < 1:
            raise ValueError("TraceSpec: need at least one conversation, system prompt, turn")
        if self.vocab < 2 or self.start_gap_s < 0 or self.seconds_per_output_token <= 0:
            raise ValueError("TraceSpec: vocab >= 2, start_gap_s >= 0, "
                             "seconds_per_output_token > 0")


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _conversation(spec: TraceSpec, rng: random.Random, c: int,
                  systems: list[list[int]]) -> list[TraceRequest]:
    sp = rng.randrange(len(systems))
    history = list(systems[sp])
    t = c * spec.start_gap_s + rng.uniform(0.0, spec.start_gap_s)
    out = []
    for k in range(rng.randint(*spec.turns)):
        history += _tokens(rng, rng.randint(*spec.user_tokens), spec.vocab)
        answer = _tokens(rng, max(1, rng.randint(*spec.answer_tokens)), spec.vocab)
        duration = len(answer) * spec.seconds_per_output_token
        out.append(TraceRequest(f"c{c}-t{k}", c, k, sp, tuple(history), tuple(answer),
                                t, duration))
        history += answer
        t += duration + rng.uniform(*spec.think_s)
    return out


def multi_turn_trace(spec: TraceSpec = TraceSpec()) -> list[TraceRequest]:
    """The trace of `spec`, in arrival order (ties: conversation, turn)."""
    rng = random.Random(spec.seed)
    systems = [_tokens(rng, spec.system_tokens, spec.vocab) for _ in range(spec.system_prompts)]
    reqs = [r for c in range(spec.conversations) for r in _conversation(spec, rng, c, systems)]
    reqs.sort(key=lambda r: (r.arrival_s, r.conversation, r.turn))
    return reqs


__all__ = ["TraceRequest", "TraceSpec", "multi_turn_trace"]
