"""One choice of a request, from token deltas to text events; and their merge.

`ChoiceRun` drives one prompt through the backend: `admit()` waits for the first
delta (so a `ValueError` from the backend surfaces before any response byte is sent),
`events()` turns deltas into text events (stop strings applied), records TTFT and
inter-token latency, and on exit — normal, early, error or cancellation — aborts the
backend request unless the backend already finished it.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional, Sequence, Union

from ..engine.logprobs import TokenLogprob
from ..engine.sampling_params import SamplingParams
from ..log import get_logger
from .backend import ServingBackend, TokenDelta
from .detokenizer import TextAssembler, TextRules
from .errors import SERVER_ERROR, OpenAIError
from .metrics import ServerMetrics

log = get_logger(__name__)

__all__ = ["ChoiceEvent", "ChoiceRun", "merge_runs"]


@dataclass(slots=True)
class ChoiceEvent:
    """New text of choice `index`; `finish_reason` ("stop"/"length") on its last event,
    with `stop_reason` (the stop string or `stop_token_ids` id that ended it, else None);
    `token_ids`: the tokens generated since the previous event of the choice."""

    index: int
    text: str
    finish_reason: Optional[str] = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[TokenLogprob]] = None  # one per token of `token_ids` (if asked)
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None  # on the first event
    stop_reason: Union[int, str, None] = None


class ChoiceRun:
    """One choice's generation. Counters (`num_tokens`, `num_cached_tokens`) are
    final once `events()` is exhausted. `keep_output=False` (echo with `max_tokens: 0`):
    the one token generated is dropped; the choice ends with "length" and no text."""

    def __init__(self, backend: ServingBackend, request_id: str, index: int,
                 prompt_token_ids: list[int], params: SamplingParams, rules: TextRules,
                 metrics: ServerMetrics, arrival: float, keep_output: bool = True) -> None:
        self.backend, self.request_id, self.index = backend, request_id, index
        self.prompt_token_ids, self.params = prompt_token_ids, params
        self.text = TextAssembler(backend.tokenizer, rules)
        self.metrics, self._last = metrics, arrival
        self._first_at = 0.0  # when the first token arrived
        self.num_tokens = 0
        self.num_cached_tokens = 0
        self._agen: Optional[AsyncIterator[TokenDelta]] = None
        self._first: Optional[TokenDelta] = None
        self._backend_done = False
        self._closed = False
        self._ids: list[int] = []  # tokens not yet carried by an event
        self._last_token: Optional[int] = None
        self._eos = frozenset(getattr(backend, "eos_token_ids", ()))
        self._lps: Optional[list[TokenLogprob]] = None  # their logprobs (if asked)
        self._prompt_lps: Optional[list] = None  # prompt logprobs for the next event
        self.keep_output = keep_output
        self.cumulative_logprob = 0.0  # of the tokens generated (requests with logprobs)
        self.finish_reason: Optional[str] = None  # once it finished

    async def admit(self) -> None:
        """Submit and wait for the first delta. Raises what the backend raises
        (ValueError: the request is invalid); the run is then closed."""
        self._agen = self.backend.generate(self.request_id, self.prompt_token_ids, self.params)
        try:
            self._first = await self._agen.__anext__()
        except StopAsyncIteration:
            await self.close()
            raise RuntimeError(f"backend ended {self.request_id} without a final delta") from None
        except ValueError:
            self._backend_done = True  # refused: the backend holds nothing to abort
            await self.close()
            raise
        except BaseException:
            await self.close()
            raise

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Text events up to and including the finishing one; closes the run at exit."""
        try:
            delta = self._first
            while delta is not None:
                event = self._consume(delta)
                if event is not None:
                    yield event
                    if event.finish_reason is not None:
                        return
                delta = await self._agen.__anext__()
        except StopAsyncIteration:
            raise RuntimeError(f"backend ended {self.request_id} without a final delta") from None
        finally:
            await self.close()

    def _consume(self, delta: TokenDelta) -> Optional[ChoiceEvent]:
        if delta.prompt_logprobs is not None:
            self._prompt_lps = delta.prompt_logprobs
        if delta.prefill_s >= 0:
            self.metrics.engine_times(delta.queued_s, delta.prefill_s)
        if not self.keep_output:
            delta = TokenDelta(delta.index, [], delta.finished, "length",
                               delta.num_cached_tokens)
        now = time.monotonic()
        n = len(delta.token_ids)
        if n:
            self.metrics.observe_tokens(n, now - self._last, first=self.num_tokens == 0)
            self._first_at = self._first_at or now
            self._last = now
        self.num_tokens += n
        self._ids.extend(delta.token_ids)
        if n:
            self._last_token = delta.token_ids[-1]
        if delta.logprobs is not None:
            self._lps = (self._lps or []) + delta.logprobs
            self.cumulative_logprob += sum(lp.logprob for lp in delta.logprobs)
        if delta.finished:
            self._backend_done = True
            self.num_cached_tokens = delta.num_cached_tokens
            if delta.finish_reason == "abort":
                self._finished("abort")
                raise OpenAIError(503, "The request was aborted by the server.",
                                  type=SERVER_ERROR, code="request_aborted")
        text = self.text.feed(delta.token_ids, final=delta.finished)
        if self.text.stopped:
            return self._event(text, "stop")
        if delta.finished:
            return self._event(text, delta.finish_reason or "stop")
        return self._event(text, None) if text or self._prompt_lps else None

    def _event(self, text: str, finish_reason: Optional[str]) -> ChoiceEvent:
        ids, self._ids = self._ids, []
        lps, self._lps = self._lps, None
        prompt, self._prompt_lps = self._prompt_lps, None
        if finish_reason is not None:
            self._finished(finish_reason)
        if lps is None and self.params.logprobs is not None:
            lps = []
        return ChoiceEvent(self.index, text, finish_reason, ids, lps, prompt,
                           self._stop_reason(finish_reason))

    def _stop_reason(self, finish_reason: Optional[str]) -> Union[int, str, None]:
        """vLLM's: the stop string that matched, or the `stop_token_ids` id sampled last
        (EOS, unless ignored, wins over a listed id: None)."""
        if self.text.stop_string is not None:
            return self.text.stop_string
        last = self._last_token
        if finish_reason != "stop" or last not in self.params.stop_token_ids:
            return None
        return None if last in self._eos and not self.params.ignore_eos else last

    def _finished(self, reason: str) -> None:
        self.finish_reason = reason
        self.metrics.finished(reason, len(self.prompt_token_ids), self.num_tokens,
                              self._last - self._first_at if self._first_at else 0.0)

    async def close(self) -> None:
        """Release the backend request (abort it unless it finished). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._agen is not None:
            try:
                await self._agen.aclose()
            except Exception as e:  # noqa: BLE001 - closing must not mask the real error
                log.warning("backend_close_failed", request_id=self.request_id, error=repr(e))
        if not self._backend_done:
            try:
                await self.backend.abort(self.request_id)
            except Exception as e:  # noqa: BLE001
                log.warning("backend_abort_failed", request_id=self.request_id, error=repr(e))


async def admit_all(runs: Sequence[ChoiceRun]) -> None:
    """Admit every run concurrently; if any fails, close them all and re-raise the
    first failure (a ValueError wins over other errors, so it can become a 400)."""
    results = await asyncio.gather(*(r.admit() for r in runs), return_exceptions=True)
    errors = [e for e in results if isinstance(e, BaseException)]
    if errors:
        for r in runs:
            await r.close()
        raise next((e for e in errors if isinstance(e, (ValueError, OpenAIError))), errors[0])


_DONE = object()


async def merge_runs(runs: Sequence[ChoiceRun]) -> AsyncIterator[ChoiceEvent]:
    """Events of several admitted runs as they come (one run: no extra task). On exit,
    every run is closed (unfinished ones aborted)."""
    if len(runs) == 1:
        async with aclosing(runs[0].events()) as events:
            async for event in events:
                yield event
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(run: ChoiceRun) -> None:
        try:
            async for event in run.events():
                queue.put_nowait(event)
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer below
            queue.put_nowait(e)
        finally:
            queue.put_nowait(_DONE)

    tasks = [asyncio.create_task(pump(r)) for r in runs]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for r in runs:
            await r.close()
