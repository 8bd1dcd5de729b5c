"""`POST /v1/completions` and `POST /v1/chat/completions`.

Both routes share one flow: decode + validate the body (protocol.py), make it a `Plan`
(plans.py: model checked, prompts tokenized and fitted to the context), admit every
choice with the backend (`running`: a backend ValueError becomes a 400 before any byte
is sent), then answer in one JSON body (`collect`) or as SSE (`chunks`). The plan /
running / collect / chunks steps know nothing of HTTP: `phalanx.server.LocalClient`
drives them in-process. Whatever way a request ends — done, client gone, handler
cancelled, error — its unfinished backend requests are aborted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
import time
from contextlib import AsyncExitStack, aclosing, asynccontextmanager
from typing import Any, AsyncIterator, Optional, Union

import msgspec
from aiohttp import web

from ..log import get_logger
from . import protocol as proto
from .backend import ServingBackend
from .drain import InFlight, ShutdownDrain, shutting_down_error
from .errors import SERVER_ERROR, OpenAIError
from ..openai_types import Usage
from .formats import ChoiceResult, make_usage
from .generation import ChoiceRun, admit_all, merge_runs
from .metrics import ServerMetrics
from .plans import OFFLOAD_CHARS, Plan, PlanBuilder, render_chat, text_chars
from .resumable import ResumableStreams, StreamLog, parse_event_id
from .request_keys import ARRIVAL, CLIENT_ID, REQUEST_ID
from .sse import SSEStream

log = get_logger(__name__)
_encoder = msgspec.json.Encoder()

__all__ = ["GenerationHandlers", "render_chat", "error_body"]


class GenerationHandlers:
    """The two generation routes over one backend. Plans of long prompts are built on one
    tokenizer thread (tokenizers are used from one thread at a time there; short prompts
    stay on the loop, where the hop would cost more than the work)."""

    def __init__(self, backend: ServingBackend, metrics: ServerMetrics, model_name: str, *,
                 resume_grace_s: float = 10.0) -> None:
        self.backend, self.metrics, self.model_name = backend, metrics, model_name
        self._tokenizer_thread = concurrent.futures.ThreadPoolExecutor(1, "phalanx-tokenize")
        self.drain = ShutdownDrain()  # the app drains it at shutdown
        self.plans = PlanBuilder(backend, model_name)
        self.streams = ResumableStreams(resume_grace_s)  # streams, resumable by Last-Event-ID

    # -- routes ----------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        if "Last-Event-ID" in request.headers:
            return await self.resume(request)
        req = proto.decode_request(await request.read(), proto.CompletionRequest)
        return await self._execute(request, await self.plan(req))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        if "Last-Event-ID" in request.headers:
            return await self.resume(request)
        req = proto.decode_request(await request.read(), proto.ChatCompletionRequest)
        return await self._execute(request, await self.plan(req))

    async def resume(self, request: web.Request) -> web.StreamResponse:
        """A dropped stream continued after the client's `Last-Event-ID` (resumable.py);
        the body is not read again."""
        given = request.headers["Last-Event-ID"]
        parsed = parse_event_id(given)
        stream = self.streams.get(parsed[0]) if parsed else None
        if stream is None:
            raise OpenAIError(404, f"No stream to resume at Last-Event-ID {given[:80]!r}: it "
                              f"ended more than {self.streams.grace_s:g} s ago, or never "
                              "existed.", param="Last-Event-ID", code="stream_not_found")
        if not request.get(CLIENT_ID):
            request[REQUEST_ID] = stream.id
        with self.drain.track() as entry:
            return await self._follow(request, stream, parsed[1] + 1, entry)

    async def plan(self, req: Union[proto.CompletionRequest, proto.ChatCompletionRequest]
                   ) -> Plan:
        """The `Plan` of `req`, on the tokenizer thread when its text passes
        `OFFLOAD_CHARS` (OpenAIError as `PlanBuilder`'s)."""
        build = self.plans.chat if isinstance(req, proto.ChatCompletionRequest) \
            else self.plans.completion
        return await self.on_tokenizer(text_chars(req), build, req)

    def check_model(self, model: str) -> None:
        self.plans.check_model(model)

    async def on_tokenizer(self, chars: int, fn: Any, *args: Any) -> Any:
        """`fn(*args)`: on the loop for text under `OFFLOAD_CHARS` characters, else on the
        tokenizer thread."""
        if chars < OFFLOAD_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    def close(self) -> None:
        """Stop the tokenizer thread (after the last request)."""
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)


    # -- running -----------------------------------------------------------------------
    @asynccontextmanager
    async def running(self, plan: Plan, arrival: float) -> AsyncIterator[list[ChoiceRun]]:
        """Admit every choice of `plan` (a backend ValueError becomes a 400 before any
        output): each prompt's first choice first, the others once it has its first token
        (its prompt's pages are then in the cache: they share them). Yields the admitted
        runs; on exit every unfinished one is aborted."""
        per = plan.params.n
        params = plan.params.choices(lambda: secrets.randbits(63))
        runs = [ChoiceRun(self.backend, f"{plan.env.id}-{i * per + k}" if per * len(plan.prompts) > 1
                          else plan.env.id, i * per + k, p, params[k], plan.text, self.metrics,
                          arrival, plan.keep_output)
                for i, p in enumerate(plan.prompts) for k in range(per)]
        self.metrics.in_flight.inc()
        try:
            try:
                await admit_all(runs[::per])
                if per > 1:
                    await admit_all([r for r in runs if r.index % per])
            except ValueError as e:  # the backend refused it (contract: before any token)
                param = _refused_param(str(e), plan)
                raise OpenAIError(400, str(e), param=param, code="invalid_value") from None
            self.metrics.count_prompt(sum(len(p) for p in plan.prompts))
            yield runs
        finally:
            for r in runs:
                await r.close()
            self.metrics.in_flight.dec()
            self.metrics.e2e.observe(time.monotonic() - arrival)

    async def collect(self, plan: Plan, runs: list[ChoiceRun]) -> Any:
        """The whole response object (`Completion` / `ChatCompletion`) of admitted runs."""
        results = [ChoiceResult(r.index) for r in runs]
        async with aclosing(merge_runs(runs)) as events:
            async for event in events:
                results[event.index].add(event)
        for r, run in zip(results, runs):
            r.cumulative_logprob = run.cumulative_logprob
        return plan.fmt.response(plan.env, _best(results, plan.params.n, plan.n),
                                 _usage(plan, runs))

    async def chunks(self, plan: Plan, runs: list[ChoiceRun]) -> AsyncIterator[Any]:
        """The stream's chunk objects of admitted runs (opening chunks, one per event,
        the usage chunk when asked for); `[DONE]` is the transport's business."""
        done = [0] * len(runs)  # tokens each choice has streamed
        for i, chunk in enumerate(plan.fmt.opening_chunks(plan.env, len(runs))):
            yield _with_usage(plan, chunk, i, 0)
        async with aclosing(merge_runs(runs)) as events:
            async for event in events:
                done[event.index] += len(event.token_ids)
                yield _with_usage(plan, plan.fmt.chunk(plan.env, event), event.index,
                                  done[event.index])
        if plan.include_usage:
            yield plan.fmt.usage_chunk(plan.env, _usage(plan, runs))

    async def _execute(self, request: web.Request, plan: Plan) -> web.StreamResponse:
        if not request.get(CLIENT_ID):
            request[REQUEST_ID] = plan.env.id
        rid = request[REQUEST_ID]
        arrival = request.get(ARRIVAL, time.monotonic())
        with self.drain.track() as entry:
            try:
                if plan.stream:
                    return await self._follow(request, await self._open_stream(plan, arrival),
                                              0, entry)
                async with self.running(plan, arrival) as runs:
                    body = await self.collect(plan, runs)
                    return web.Response(body=msgspec.json.encode(body),
                                        content_type="application/json",
                                        headers={"X-Request-Id": rid})
            except asyncio.CancelledError:
                entry.absorb()  # cut short by the shutdown drain: a 503, not a dropped socket
                raise shutting_down_error() from None

    async def _open_stream(self, plan: Plan, arrival: float) -> StreamLog:
        """Admit the stream's choices (a refusal is still a 400: nothing is sent yet) and
        start producing its events on a task of their own."""
        stack = AsyncExitStack()
        try:
            runs = await stack.enter_async_context(self.running(plan, arrival))
        except BaseException:
            await stack.aclose()
            raise
        return self.streams.open(plan.env.id,
                                 lambda stream: self._produce(stack, plan, runs, stream))

    async def _produce(self, stack: AsyncExitStack, plan: Plan, runs: list[ChoiceRun],
                       stream: StreamLog) -> None:
        """The stream's events into its log, `[DONE]` last; the runs are released (the
        unfinished ones aborted) when it ends, is abandoned or the server shuts down."""
        try:
            async with stack:
                async with aclosing(self.chunks(plan, runs)) as chunks:
                    async for chunk in chunks:
                        stream.push(_encoder.encode(chunk))
        except asyncio.CancelledError:  # abandoned (nobody to read it) or shutting down
            stream.push(shutting_down_error().body())
        except Exception as e:  # noqa: BLE001 - reported in-stream, as the spec has it
            stream.push(error_body(plan.env.id, e))
        stream.push(b"[DONE]")

    async def _follow(self, request: web.Request, stream: StreamLog, start: int,
                      entry: InFlight) -> web.StreamResponse:
        """Write `stream`'s events from index `start` on, each with its SSE id."""
        sse = SSEStream(request, headers={"X-Request-Id": request[REQUEST_ID]})
        await sse.start()
        with self.streams.attach(stream):
            try:
                async for index, payload in stream.follow(start):
                    await sse.event(f"{stream.id}/{index}", payload)
                await sse.end()
            except ConnectionResetError:
                log.info("client_disconnected", request_id=stream.id,
                         resumable_s=self.streams.grace_s)
            except asyncio.CancelledError:
                entry.absorb()
                await _send_error(sse, stream.id, shutting_down_error())
        return sse.response


# fields a backend's ValueError may start with ("<field>: ...")
_PARAMS_OF_REFUSALS = ("logit_bias", "allowed_token_ids", "bad_words")


def _refused_param(message: str, plan: Plan) -> Optional[str]:
    """The request field a backend refusal names (None: none in particular)."""
    if message.startswith("prompt"):
        return plan.prompt_param
    if message.startswith("structured output"):
        return plan.constraint_param
    field = message.split(":", 1)[0]
    return field if field in _PARAMS_OF_REFUSALS else None


def _best(results: list[ChoiceResult], per: int, n: int) -> list[ChoiceResult]:
    """Of each prompt's `per` choices, the `n` with the highest cumulative logprob
    (all of them, in order, when `per == n`), re-indexed prompt by prompt."""
    if per == n:
        return results
    best = []
    for start in range(0, len(results), per):
        group = sorted(results[start:start + per], key=lambda r: -r.cumulative_logprob)[:n]
        for r in sorted(group, key=lambda r: r.index):
            r.index = len(best)
            best.append(r)
    return best


def _with_usage(plan: Plan, chunk: Any, index: int, tokens: int) -> Any:
    """`chunk` with choice `index`'s usage so far, when the request asked for it on every
    chunk (vLLM's `continuous_usage_stats`)."""
    if plan.continuous_usage:
        prompt = len(plan.prompts[index // plan.params.n])
        chunk.usage = Usage(prompt, tokens, prompt + tokens)
    return chunk


def _usage(plan: Plan, runs: list[ChoiceRun]):
    return make_usage(sum(len(p) for p in plan.prompts), sum(r.num_tokens for r in runs),
                      sum(r.num_cached_tokens for r in runs))


def error_body(request_id: str, e: Exception) -> bytes:
    """An in-stream `{"error": ...}` payload (the openai client raises on it)."""
    if isinstance(e, OpenAIError):
        return e.body()
    log.error("stream_failed", request_id=request_id, error=repr(e))
    return OpenAIError(500, f"Internal error while generating: {type(e).__name__}",
                       type=SERVER_ERROR).body()


async def _send_error(sse: SSEStream, request_id: str, e: Exception) -> None:
    """An `{"error": ...}` event then `[DONE]`, outside the stream's log."""
    try:
        await sse.response.write(b"data: " + error_body(request_id, e) + b"\n\n")
        await sse.done()
    except ConnectionResetError:
        pass
