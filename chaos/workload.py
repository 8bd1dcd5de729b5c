"""A drill's workload: streamed completions through the SDK (`AsyncClient` against a
server's URL, or `LocalClient` in this process), each stream's tokens recorded with the
server's `return_token_ids` so the checker compares token ids, not text.

Requests (`make_requests`, seeded): text prompts that share one of a few long "system"
prefixes (prefix-cache hits and the router's placement by prefix) with a question of
their own, 8-48 new tokens (`ignore_eos`, so a length is fixed), half greedy and half
sampled at temperature 0.8 with a seed of their own (the same tokens on every run), and a
tenth that the client cuts off after a few chunks (a client that goes away mid-stream).
"""

from __future__ import annotations

import random
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["ChaosRequest", "StreamRecord", "make_requests", "stream_request"]

_WORDS = ("river stone cloud amber signal harbor quiet lantern orbit meadow copper thunder "
          "willow falcon ember glacier prism velvet canyon beacon").split()


@dataclass(frozen=True, slots=True)
class ChaosRequest:
    prompt: str
    body: dict  # the request's fields besides the prompt (max_tokens, temperature, seed, ...)
    cut_after: int = 0  # the client stops reading after this many chunks (0: never)


@dataclass(slots=True)
class StreamRecord:
    request: int  # index into the workload's requests
    start: float  # time.time()
    end: float = 0.0
    chunks: list = field(default_factory=list)  # token ids per chunk, as they arrived
    times: list = field(default_factory=list)  # arrival of each chunk (time.time())
    error: Optional[tuple] = None  # (HTTP status or None, code) of the error that ended it
    cut_off: bool = False

    @property
    def tokens(self) -> int:
        return sum(len(c) for c in self.chunks)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def make_requests(n: int, seed: int, prefixes: int = 4, cut_share: float = 0.1
                  ) -> list[ChaosRequest]:
    """`n` requests (see the module doc), the same for the same `seed`."""
    rng = random.Random(seed)
    systems = [f"System {i}: {_words(rng, 40)}." for i in range(prefixes)]
    out = []
    for i in range(n):
        body = dict(max_tokens=rng.randint(8, 48), ignore_eos=True, temperature=0.0)
        if i % 2:
            body.update(temperature=0.8, seed=rng.randrange(1 << 30))
        cut = rng.randint(1, 3) if rng.random() < cut_share else 0
        out.append(ChaosRequest(f"{rng.choice(systems)} Q{i}: {_words(rng, rng.randint(3, 20))}?",
                                body, cut))
    return out


async def stream_request(client: Any, index: int, req: ChaosRequest,
                         cut: bool = True) -> StreamRecord:
    """Stream `req` (cut off as it says unless `cut` is False); never raises: an error
    ends the record (`error`)."""
    rec = StreamRecord(index, time.time())
    try:
        stream = client.stream(req.prompt, return_token_ids=True, **req.body)
        async with aclosing(stream) as chunks:
            async for chunk in chunks:
                for choice in chunk.choices:
                    ids = choice.token_ids if isinstance(choice.token_ids, list) else []
                    rec.chunks.append(list(ids))
                    rec.times.append(time.time())
                if cut and req.cut_after and len(rec.chunks) >= req.cut_after:
                    rec.cut_off = True
                    break
    except Exception as e:  # noqa: BLE001 - the checker judges it
        rec.error = (getattr(e, "status", None), str(getattr(e, "code", None)
                                                      or type(e).__name__))
    rec.end = time.time()
    return rec
