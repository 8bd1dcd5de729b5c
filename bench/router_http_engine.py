"""A simulated inference engine behind one HTTP worker of the routing bench
(`bench/router_http.py`): a prefix cache with LRU eviction, `slots` concurrent requests,
a prefill that costs time per uncached token, and a decode that costs time per output
token. Pure asyncio; no model.

Model (one engine):
- A request waits for one of `slots` (FIFO), then for the engine's single prefill lane
  (FIFO): prefills never overlap, decodes do. Its prefix hit is measured when its
  prefill starts: the longest run of its prompt's pages, from the first, that the cache
  holds then (the ground truth the bench reports). The prefill takes
  `prefill_fixed_s + uncached tokens * prefill_s_per_token`; then the prompt's pages are
  cached (most recent) and the first token is out; the decode takes
  `output tokens * decode_s_per_token`; then prompt + output pages are cached.
- The cache holds at most `capacity_pages` page hashes (`page_hashes`, the block pools'
  chain hash); past it the least recently used go first, leaf pages before their
  parents (a chain is touched leaf first), and each eviction is logged with a sequence
  number so a reader can ask what left since its last look (`evicted_since`), as a
  rank's block pool answers `held_prefix_changes`.
- The answer is `max_tokens` ids drawn from a generator seeded by the prompt, so the
  same prompt gets the same answer whichever worker serves it.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional, Sequence

from phalanx.router.prefix_tree import page_hashes
from phalanx.router.replay import SimulatedKV

EVICTION_LOG = 1 << 16  # evictions remembered for `evicted_since`


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Cost model and sizes of one simulated engine (see the module docstring)."""

    slots: int = 4
    page_size: int = 16
    capacity_pages: int = 1024
    prefill_fixed_s: float = 0.005
    prefill_s_per_token: float = 500e-6
    decode_s_per_token: float = 0.5e-3
    vocab: int = 32000


class PrefixCache:
    """Page hashes held, LRU (`router.replay.SimulatedKV`), with its evictions numbered
    from 1 (`evictions` = the last one) and the latest of them logged."""

    def __init__(self, capacity_pages: int) -> None:
        self._kv = SimulatedKV(capacity_pages)
        self._log: deque[int] = deque(maxlen=EVICTION_LOG)  # the last evicted hashes
        self.evictions = 0

    def match_pages(self, hashes: Sequence[int]) -> int:
        """Leading pages of `hashes` held (read-only)."""
        return self._kv.match_pages(hashes)

    def insert(self, hashes: Sequence[int]) -> None:
        """Caches a chain as most recent (leaf touched first, so it is evicted first)."""
        evicted = self._kv.insert(hashes)
        self._log.extend(evicted)
        self.evictions += len(evicted)

    def held(self) -> list[int]:
        return list(self._kv.held())

    def evicted_since(self, since: int) -> Optional[list[int]]:
        """Hashes evicted after eviction number `since`; None when the log no longer
        reaches back that far (the reader needs a full list)."""
        missing = self.evictions - since
        if missing < 0 or missing > len(self._log):
            return None
        return list(self._log)[len(self._log) - missing:] if missing else []


@dataclass(slots=True)
class Counters:
    """Ground truth since start: requests prefilled, their prompt tokens, cache hits."""

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    prefill_busy_s: float = 0.0  # time the prefill lane was held (simulated prefills)


@dataclass(slots=True)
class _Pending:
    hashes: list[int]
    prompt_tokens: int


class SimEngine:
    """One simulated engine (see the module docstring). Drive it from one event loop."""

    def __init__(self, config: EngineConfig = EngineConfig()) -> None:
        self.config = config
        self.cache = PrefixCache(config.capacity_pages)
        self.counters = Counters()
        self._slots = asyncio.Semaphore(config.slots)
        self._prefill_lane = asyncio.Lock()
        self._waiting = 0  # requests waiting for a slot
        self._running = 0  # requests holding a slot
        self._running_tokens = 0
        self._unprefilled: dict[int, _Pending] = {}  # request serial -> prompt pages
        self._serial = 0

    def answer(self, prompt: Sequence[int], max_tokens: int) -> list[int]:
        """The answer this engine gives `prompt` (a function of the prompt alone)."""
        rng = random.Random(hash((len(prompt), tuple(prompt[-8:]))))
        return [rng.randrange(self.config.vocab) for _ in range(max(1, max_tokens))]

    async def generate(self, prompt: Sequence[int], max_tokens: int,
                       on_first: Callable[[int, int], Awaitable[None]]) -> tuple[list[int], int]:
        """Serves one request: (answer tokens, prompt tokens served from the cache).
        `on_first(first token, cached tokens)` is awaited when the prefill is done."""
        cfg = self.config
        hashes = page_hashes(prompt, cfg.page_size)
        answer = self.answer(prompt, max_tokens)
        self._serial += 1
        serial = self._serial
        self._unprefilled[serial] = _Pending(hashes, len(prompt))
        self._waiting += 1
        try:
            async with self._slots:
                self._waiting -= 1
                self._running += 1
                self._running_tokens += len(prompt)
                try:
                    async with self._prefill_lane:
                        cached = min(self.cache.match_pages(hashes) * cfg.page_size,
                                     len(prompt))
                        busy = (cfg.prefill_fixed_s
                                + (len(prompt) - cached) * cfg.prefill_s_per_token)
                        await asyncio.sleep(busy)
                        self.counters.prefill_busy_s += busy
                        self.cache.insert(hashes)
                        del self._unprefilled[serial]
                        self._count(len(prompt), cached)
                    await on_first(answer[0], cached)
                    await asyncio.sleep(len(answer) * cfg.decode_s_per_token)
                    self.cache.insert(page_hashes(list(prompt) + answer, cfg.page_size))
                finally:
                    self._running -= 1
                    self._running_tokens -= len(prompt)
        finally:
            self._unprefilled.pop(serial, None)
        return answer, cached

    def _count(self, prompt_tokens: int, cached: int) -> None:
        c = self.counters
        c.requests += 1
        c.prompt_tokens += prompt_tokens
        c.hit_tokens += cached

    # ---- what the worker reports -----------------------------------------------------

    @property
    def num_waiting(self) -> int:
        """Requests not yet prefilled (waiting for a slot or for the prefill lane)."""
        return len(self._unprefilled)

    @property
    def num_running(self) -> int:
        """Requests past their prefill, decoding."""
        return self._running - (len(self._unprefilled) - self._waiting)

    def waiting_tokens(self) -> int:
        """Prompt tokens still to prefill, as the cache stands now (what an engine's
        scheduler reports as `num_waiting_tokens`)."""
        ps = self.config.page_size
        return sum(max(0, p.prompt_tokens - self.cache.match_pages(p.hashes) * ps)
                   for p in self._unprefilled.values())

    def kv_usage(self) -> float:
        """Share of the cache the admitted requests' prompts occupy (0..1)."""
        cap = self.config.capacity_pages * self.config.page_size
        return min(1.0, self._running_tokens / cap)


__all__ = ["Counters", "EngineConfig", "PrefixCache", "SimEngine"]
