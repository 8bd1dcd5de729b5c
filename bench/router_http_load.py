"""The client side of the HTTP routing bench (`bench/router_http.py`): multi-turn
conversations with shared system prompts, started at a Poisson rate, sent to one router
URL as `/v1/completions`.

Content comes from `phalanx.router.trace.multi_turn_trace` (its system prompts, user
messages and answer lengths); timing does not: conversations start as a Poisson process
of rate `rate / mean turns` (so requests arrive at about `rate` per second), and a turn
is sent when the previous answer is back plus a think time drawn from `think_s`. A
turn's prompt is the system prompt, every earlier (user message, answer the worker
really gave) pair, and the new user message, so each turn extends the previous one.
No turn is sent after `duration_s`; the run ends when every sent request is answered.
Everything random is drawn from `seed`: every router sees the same conversations, start
times and think times.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import aiohttp

from phalanx.router.trace import TraceSpec, multi_turn_trace

from router_http_text import decode, encode


@dataclass(frozen=True, slots=True)
class Conversation:
    """One conversation's script: its system prompt, user messages, answer lengths."""

    system: tuple[int, ...]
    users: tuple[tuple[int, ...], ...]
    answer_tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """A load: request rate, how long new turns are sent, think time, trace shape."""

    rate: float
    duration_s: float = 60.0
    think_s: tuple[float, float] = (0.5, 2.0)
    trace: TraceSpec = TraceSpec()
    seed: int = 0


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it."""

    conversation: int
    turn: int
    sent_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    ok: bool
    worker: str = ""  # who served it ("w2"): the proxy's group header or the worker's id


@dataclass(slots=True)
class LoadResult:
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0


def conversations(spec: TraceSpec) -> list[Conversation]:
    """The conversations of `multi_turn_trace(spec)`, as scripts."""
    turns: dict[int, list] = {}
    for r in multi_turn_trace(spec):
        turns.setdefault(r.conversation, []).append(r)
    out = []
    for c in sorted(turns):
        reqs = sorted(turns[c], key=lambda r: r.turn)
        system = reqs[0].prompt[:spec.system_tokens]
        users, start = [], spec.system_tokens
        for r in reqs:
            users.append(r.prompt[start:])
            start = len(r.prompt) + len(r.output)
        out.append(Conversation(system, tuple(users), tuple(len(r.output) for r in reqs)))
    return out


def _schedule(spec: LoadSpec, scripts: list[Conversation]) -> list[float]:
    """Start times of the conversations (Poisson, rate `rate / mean turns`), within
    `duration_s`; as many as fit, at most `len(scripts)`."""
    mean_turns = sum(len(s.users) for s in scripts) / len(scripts)
    rng = random.Random(spec.seed)
    starts, t = [], 0.0
    while len(starts) < len(scripts):
        t += rng.expovariate(spec.rate / mean_turns)
        if t >= spec.duration_s:
            break
        starts.append(t)
    return starts


async def _converse(session: aiohttp.ClientSession, url: str, c: int, script: Conversation,
                    start: float, spec: LoadSpec, t0: float, result: LoadResult) -> None:
    rng = random.Random((spec.seed << 20) + c)
    thinks = [rng.uniform(*spec.think_s) for _ in script.users]
    await asyncio.sleep(max(0.0, t0 + start - time.monotonic()))
    history = list(script.system)
    for k, user in enumerate(script.users):
        if time.monotonic() - t0 >= spec.duration_s:
            return
        history += user
        body = {"model": "sim-moe", "prompt": encode(history),
                "max_tokens": script.answer_tokens[k], "stream": False}
        sent = time.monotonic()
        group = None
        try:
            async with session.post(url + "/v1/completions", json=body) as resp:
                data = await resp.json(content_type=None) if resp.status == 200 else None
                group = resp.headers.get("X-Phalanx-Group")
        except aiohttp.ClientError:
            data = None
        latency = time.monotonic() - sent
        if data is None:
            result.outcomes.append(Outcome(c, k, sent - t0, latency, len(history), 0, False))
            return
        usage = data.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        worker = (f"w{group}" if group is not None  # the phalanx proxy names the group
                  else str(data.get("id") or "").rpartition("-")[0])  # SMG passes "w2-17"
        result.outcomes.append(Outcome(c, k, sent - t0, latency, len(history), cached, True,
                                       worker))
        history += decode(data["choices"][0]["text"])
        await asyncio.sleep(thinks[k])


async def run_load(url: str, spec: LoadSpec) -> LoadResult:
    """Drives `url` with `spec`'s conversations; returns what each request saw."""
    mean_turns = (spec.trace.turns[0] + spec.trace.turns[1]) / 2
    need = int(spec.rate * spec.duration_s / mean_turns * 1.5) + 8
    trace = TraceSpec(**{**{k: getattr(spec.trace, k) for k in spec.trace.__slots__},
                         "conversations": need})
    scripts = conversations(trace)
    starts = _schedule(spec, scripts)
    result = LoadResult()
    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(_converse(session, url, c, scripts[c], s, spec, t0, result)
                               for c, s in enumerate(starts)))
    result.wall_s = time.monotonic() - t0
    return result


__all__ = ["Conversation", "LoadResult", "LoadSpec", "Outcome", "conversations", "run_load"]
