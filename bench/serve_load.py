"""Load for `bench/serve.py`: streamed completions against an OpenAI-compatible server,
closed loop (a fixed number of clients, each sending its next request when the last one
ends) or open loop (Poisson arrivals at a fixed rate), and the figures users quote.

A request is `/v1/completions` with the prompt as token ids, `stream: true`,
`ignore_eos: true` (so every request generates exactly `max_tokens`) and usage in the last
chunk. Per request: the time to the first token (TTFT), the gaps between later chunks
(inter-token latency, ITL: the server sends one token per chunk), the end-to-end time, and
the tokens the usage reports. Nothing here imports phalanx: any server speaking the API
can be measured.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Optional

import aiohttp

__all__ = ["Request", "Result", "closed_loop", "open_loop", "summarize", "percentile",
           "random_prompts", "multi_turn", "run_session", "stream_one"]


@dataclass(frozen=True, slots=True)
class Request:
    """prompt: token ids; follow_up: for a conversation's next turn, the user tokens
    appended after this turn's prompt and its actual reply (None: not a conversation)."""

    prompt: tuple[int, ...]
    max_tokens: int
    tag: str = ""  # e.g. "miss" / "hit", "turn0"
    follow_up: Optional[tuple[int, ...]] = None


@dataclass(slots=True)
class Result:
    request: Request
    sent: float
    first: Optional[float] = None
    done: Optional[float] = None
    chunks: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int = 0
    error: Optional[str] = None

    @property
    def ttft(self) -> float:
        return self.first - self.sent

    @property
    def e2e(self) -> float:
        return self.done - self.sent

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]


async def stream_one(session: aiohttp.ClientSession, url: str, model: str,
                     request: Request, prompt: Optional[tuple[int, ...]] = None) -> Result:
    """One streamed request (`prompt` overrides the request's: a conversation's later
    turn). A chunk with a choice is a token arrival; the usage chunk has none."""
    body = {"model": model, "prompt": list(prompt or request.prompt),
            "max_tokens": request.max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    res = Result(request, time.perf_counter())
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                for choice in chunk.get("choices") or ():
                    if res.first is None:
                        res.first = now
                    res.chunks.append(now)
                    res.token_ids.extend(choice.get("token_ids") or ())
                usage = chunk.get("usage")
                if usage:
                    res.output_tokens = usage.get("completion_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens") or 0
        res.done = time.perf_counter()
        if res.first is None:
            res.error = "no token streamed"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def _session(limit: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit),
                                 timeout=aiohttp.ClientTimeout(total=3600))


async def run_session(session: aiohttp.ClientSession, url: str, model: str,
                      requests: list[Request]) -> list[Result]:
    """A conversation's turns in order: a turn's prompt is the previous turn's prompt,
    its reply (the ids streamed back) and the previous turn's `follow_up` user tokens."""
    out: list[Result] = []
    prompt: Optional[tuple[int, ...]] = None
    for req in requests:
        res = await stream_one(session, url, model, req, prompt)
        out.append(res)
        if res.error is not None or not req.follow_up:
            prompt = None
            continue
        prompt = (prompt or req.prompt) + tuple(res.token_ids) + req.follow_up
    return out


async def closed_loop(url: str, model: str, sessions: list[list[Request]],
                      concurrency: int) -> tuple[list[Result], float]:
    """`concurrency` clients take the sessions in order (a session: one request, or a
    conversation's turns), one at a time each; the results and the wall time."""
    queue = list(reversed(sessions))
    out: list[Result] = []
    async with _session(concurrency) as session:
        async def client() -> None:
            while queue:
                out.extend(await run_session(session, url, model, queue.pop()))

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
    return out, time.perf_counter() - t0


async def open_loop(url: str, model: str, requests: list[Request], rate: float,
                    seed: int = 0) -> tuple[list[Result], float]:
    """Requests sent at Poisson arrivals of `rate` per second (exponential gaps, seeded),
    whatever the server's progress; the results and the wall time."""
    rng = random.Random(seed)
    async with _session(max(64, len(requests))) as session:
        t0 = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(stream_one(session, url, model, req)))
            await asyncio.sleep(rng.expovariate(rate))
        out = await asyncio.gather(*tasks)
    return list(out), time.perf_counter() - t0


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between ranks; nan for no values."""
    if not values:
        return float("nan")
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize(results: list[Result], wall_s: float) -> dict:
    """Output tok/s over the wall time; TTFT, ITL, end-to-end p50/p90/p99 in ms."""
    ok = [r for r in results if r.error is None]
    out = {"requests": len(results), "errors": len(results) - len(ok),
           "output_tok_s": sum(r.output_tokens for r in ok) / wall_s if wall_s > 0 else 0.0,
           "wall_s": wall_s}
    series = {"ttft": [r.ttft for r in ok], "itl": [g for r in ok for g in r.itl],
              "e2e": [r.e2e for r in ok]}
    for name, values in series.items():
        for q in (50, 90, 99):
            out[f"{name}_p{q}_ms"] = percentile(values, q) * 1e3
    if any(r.error for r in results):
        out["first_error"] = next(r.error for r in results if r.error)
    return out


def random_prompts(n: int, length: int, vocab: int, seed: int, max_tokens: int,
                   tag: str = "") -> list[Request]:
    """`n` prompts of `length` random token ids (away from the vocabulary's ends, where
    special tokens live)."""
    rng = random.Random(seed)
    return [Request(tuple(rng.randrange(16, vocab - 16) for _ in range(length)), max_tokens,
                    tag) for _ in range(n)]


def multi_turn(conversations: int, turns: int, system_prompts: int, system_len: int,
               user_len: int, max_tokens: int, vocab: int, seed: int) -> list[list[Request]]:
    """A shared-prefix trace: each conversation starts from one of `system_prompts` shared
    system prompts plus `user_len` tokens; each later turn sends the previous turn's
    prompt, the reply the server streamed back and `user_len` new tokens (so a turn's
    prompt is cached but for its new tokens). Per conversation its turns (tag "turn<t>")."""
    rng = random.Random(seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(16, vocab - 16) for _ in range(n))

    systems = [tokens(system_len) for _ in range(system_prompts)]
    return [[Request(systems[c % system_prompts] + tokens(user_len) if t == 0 else (),
                     max_tokens, f"turn{t}",
                     tokens(user_len) if t < turns - 1 else None)
             for t in range(turns)] for c in range(conversations)]
