"""`POST /v1/completions` and `POST /v1/chat/completions`.

Both routes share one flow: decode + validate the body (protocol.py), check the model,
tokenize (chat: the model folder's chat template), fit `max_tokens` to the context
(`completion_plan` / `chat_plan`), admit every choice with the backend (`running`: a
backend ValueError becomes a 400 before any byte is sent), then answer in one JSON body
(`collect`) or as SSE (`chunks`). The plan / running / collect / chunks steps know
nothing of HTTP: `phalanx.server.LocalClient` drives them in-process. Whatever way a request ends — done,
client gone, handler cancelled, error — its unfinished backend requests are aborted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
import time
import uuid
from contextlib import AsyncExitStack, aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Union

import msgspec
from aiohttp import web

from ..engine.sampling_params import SamplingParams
from ..log import get_logger
from . import protocol as proto
from .backend import ServingBackend
from .drain import InFlight, ShutdownDrain, shutting_down_error
from .errors import SERVER_ERROR, OpenAIError
from .formats import ChatFormat, ChoiceResult, CompletionFormat, EchoPrompt, Envelope, make_usage
from .generation import ChoiceRun, admit_all, merge_runs
from .logprob_format import TokenTexts
from .metrics import ServerMetrics
from .resumable import ResumableStreams, StreamLog, parse_event_id
from .request_keys import ARRIVAL, CLIENT_ID, REQUEST_ID
from .sse import SSEStream
from .tool_choice import tool_plan

log = get_logger(__name__)
_encoder = msgspec.json.Encoder()

__all__ = ["GenerationHandlers", "render_chat"]

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI default of /v1/completions
MAX_CHOICES = 256  # choices (prompts x n, or best_of) per request
_Format = Union[CompletionFormat, ChatFormat]


@dataclass(slots=True)
class _Plan:
    """A validated request, ready to run: `params.n` choices run per prompt, `n` of them
    are returned (fewer with `best_of`: the best by cumulative logprob)."""

    env: Envelope
    prompts: list[list[int]]
    params: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    fmt: _Format
    prompt_param: str  # "prompt" or "messages": where a refused prompt came from
    n: int = 1
    keep_output: bool = True  # False: echo with max_tokens 0 (the prompt only)
    constraint_param: Optional[str] = None  # the field of the output constraint, if any


# Prompt text (characters) past which a request is tokenized on the tokenizer thread, not
# on the event loop: a long prompt or chat template takes milliseconds that every stream
# in flight would otherwise wait for.
OFFLOAD_CHARS = 4096


def _text_chars(req: Union[proto.CompletionRequest, proto.ChatCompletionRequest]) -> int:
    """Characters of text the request's plan tokenizes (token-id prompts count 0)."""
    if isinstance(req, proto.ChatCompletionRequest):
        return sum(len(m.content) if isinstance(m.content, str)
                   else sum(len(getattr(part, "text", "") or "") for part in (m.content or ()))
                   for m in req.messages or ())
    p = req.prompt
    if isinstance(p, str):
        return len(p)
    return sum(len(x) for x in p if isinstance(x, str)) if isinstance(p, list) else 0


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], *,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                add_special_tokens: bool = False, tools: Optional[list] = None,
                template_kwargs: Optional[dict[str, Any]] = None) -> list[int]:
    """The token ids of `messages` (and `tools`) under the model folder's chat template,
    `template_kwargs` as its variables (400 when the template refuses them)."""
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools, **(template_kwargs or {}))
    except Exception as e:  # noqa: BLE001 - templates raise on messages they refuse
        raise OpenAIError(400, f"The chat template rejected the messages: {e}",
                          param="messages", code="invalid_value") from None
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


class GenerationHandlers:
    """The two generation routes over one backend. Plans of long prompts are built on one
    tokenizer thread (tokenizers are used from one thread at a time there; short prompts
    stay on the loop, where the hop would cost more than the work)."""

    def __init__(self, backend: ServingBackend, metrics: ServerMetrics, model_name: str, *,
                 resume_grace_s: float = 10.0) -> None:
        self.backend, self.metrics, self.model_name = backend, metrics, model_name
        self._tokenizer_thread = concurrent.futures.ThreadPoolExecutor(1, "phalanx-tokenize")
        self.drain = ShutdownDrain()  # the app drains it at shutdown
        self.token_texts = TokenTexts(backend.tokenizer)  # logprobs' token strings
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
                   ) -> "_Plan":
        """`completion_plan` / `chat_plan` of `req`, on the tokenizer thread when its text
        passes `OFFLOAD_CHARS` (OpenAIError as theirs)."""
        build = self.chat_plan if isinstance(req, proto.ChatCompletionRequest) else self.completion_plan
        return await self.on_tokenizer(_text_chars(req), build, req)

    async def on_tokenizer(self, chars: int, fn: Any, *args: Any) -> Any:
        """`fn(*args)`: on the loop for text under `OFFLOAD_CHARS` characters, else on the
        tokenizer thread."""
        if chars < OFFLOAD_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    def close(self) -> None:
        """Stop the tokenizer thread (after the last request)."""
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    # -- plans (HTTP-free: the in-process SDK client uses them too) --------------------
    def completion_plan(self, req: proto.CompletionRequest) -> _Plan:
        """A validated completion request, ready to run (OpenAIError if it is not)."""
        self.check_model(req.model)
        given = proto.completion_prompts(req)
        prompts = [self._tokenize(p) for p in given]
        scoring = req.max_tokens == 0  # echo only (checked): the prompt's logprobs
        max_tokens = self._fit(prompts, 1 if scoring else req.max_tokens,
                               DEFAULT_COMPLETION_MAX_TOKENS, "max_tokens", "prompt")
        echo = None
        if req.echo:
            echo = [EchoPrompt(p if isinstance(p, str) else self.backend.tokenizer.decode(ids),
                               ids) for p, ids in zip(given, prompts)]
        fmt = CompletionFormat(self.token_texts if req.logprobs is not None else None, echo,
                               req.n or 1)
        plan = self._plan(req, "cmpl", prompts, max_tokens, fmt, "prompt")
        plan.keep_output = not scoring
        return plan

    def chat_plan(self, req: proto.ChatCompletionRequest) -> _Plan:
        """A validated chat request, ready to run (OpenAIError if it is not)."""
        self.check_model(req.model)
        tools = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
        prompt = render_chat(self.backend.tokenizer, proto.chat_messages(req), tools=tools.render,
                             add_generation_prompt=req.add_generation_prompt,
                             continue_final_message=req.continue_final_message,
                             template_kwargs=req.chat_template_kwargs)
        requested, param = (req.max_completion_tokens, "max_completion_tokens") \
            if req.max_completion_tokens is not None else (req.max_tokens, "max_tokens")
        max_tokens = self._fit([prompt], requested, None, param, "messages")
        fmt = ChatFormat(self.token_texts if req.logprobs else None, tools.parse)
        return self._plan(req, "chatcmpl", [prompt], max_tokens, fmt, "messages")

    # -- validation --------------------------------------------------------------------
    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist. This server serves "
                              f"`{self.model_name}`.", param="model", code="model_not_found")

    def _tokenize(self, prompt: Union[str, list[int]]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        ids = self.backend.tokenizer.encode(prompt, add_special_tokens=False)
        if not ids:
            raise OpenAIError(400, "prompt must not be empty.", param="prompt",
                              code="invalid_value")
        return list(ids)

    def _fit(self, prompts: list[list[int]], requested: Optional[int], default: Optional[int],
             param: str, prompt_param: str) -> int:
        """max_tokens for these prompts: a prompt that fills the context is 400; an
        explicit max_tokens beyond the room left is 400; a default is clipped to it."""
        limit = self.backend.max_model_len
        longest = max(len(p) for p in prompts)
        room = limit - longest
        if room <= 0:
            raise OpenAIError(400, f"This model's maximum context length is {limit} tokens, "
                              f"but the prompt has {longest} tokens.", param=prompt_param,
                              code="context_length_exceeded")
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise OpenAIError(400, f"This model's maximum context length is {limit} tokens. "
                              f"However, you requested {longest + requested} tokens ({longest} "
                              f"in the {prompt_param}, {requested} for the completion).",
                              param=param, code="context_length_exceeded")
        return requested

    def _plan(self, req: proto.SamplingFields, prefix: str, prompts: list[list[int]],
              max_tokens: int, fmt: _Format, prompt_param: str) -> _Plan:
        env = Envelope(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), self.model_name,
                       bool(req.return_token_ids))
        opts = req.stream_options
        params = proto.sampling_params(req, max_tokens)
        if params.n * len(prompts) > MAX_CHOICES:
            raise OpenAIError(400, f"A request runs at most {MAX_CHOICES} choices; this one "
                              f"asks {params.n} for each of {len(prompts)} prompts.",
                              param="n", code="invalid_value")
        return _Plan(env, prompts, params, proto.stop_strings(req),
                     bool(req.stream), bool(req.stream and opts and opts.include_usage), fmt,
                     prompt_param, req.n or 1,
                     constraint_param=proto.structured_output(req)[1])

    # -- running -----------------------------------------------------------------------
    @asynccontextmanager
    async def running(self, plan: _Plan, arrival: float) -> AsyncIterator[list[ChoiceRun]]:
        """Admit every choice of `plan` (a backend ValueError becomes a 400 before any
        output): each prompt's first choice first, the others once it has its first token
        (its prompt's pages are then in the cache: they share them). Yields the admitted
        runs; on exit every unfinished one is aborted."""
        per = plan.params.n
        params = plan.params.choices(lambda: secrets.randbits(63))
        runs = [ChoiceRun(self.backend, f"{plan.env.id}-{i * per + k}" if per * len(plan.prompts) > 1
                          else plan.env.id, i * per + k, p, params[k], plan.stop, self.metrics,
                          arrival, plan.keep_output)
                for i, p in enumerate(plan.prompts) for k in range(per)]
        self.metrics.in_flight.inc()
        try:
            try:
                await admit_all(runs[::per])
                if per > 1:
                    await admit_all([r for r in runs if r.index % per])
            except ValueError as e:  # the backend refused it (contract: before any token)
                param = plan.prompt_param if str(e).startswith("prompt") else None
                if str(e).startswith("structured output"):
                    param = plan.constraint_param
                raise OpenAIError(400, str(e), param=param, code="invalid_value") from None
            self.metrics.count_prompt(sum(len(p) for p in plan.prompts))
            yield runs
        finally:
            for r in runs:
                await r.close()
            self.metrics.in_flight.dec()
            self.metrics.e2e.observe(time.monotonic() - arrival)

    async def collect(self, plan: _Plan, runs: list[ChoiceRun]) -> Any:
        """The whole response object (`Completion` / `ChatCompletion`) of admitted runs."""
        results = [ChoiceResult(r.index) for r in runs]
        async with aclosing(merge_runs(runs)) as events:
            async for event in events:
                results[event.index].add(event)
        for r, run in zip(results, runs):
            r.cumulative_logprob = run.cumulative_logprob
        return plan.fmt.response(plan.env, _best(results, plan.params.n, plan.n),
                                 _usage(plan, runs))

    async def chunks(self, plan: _Plan, runs: list[ChoiceRun]) -> AsyncIterator[Any]:
        """The stream's chunk objects of admitted runs (opening chunks, one per event,
        the usage chunk when asked for); `[DONE]` is the transport's business."""
        for chunk in plan.fmt.opening_chunks(plan.env, len(runs)):
            yield chunk
        async with aclosing(merge_runs(runs)) as events:
            async for event in events:
                yield plan.fmt.chunk(plan.env, event)
        if plan.include_usage:
            yield plan.fmt.usage_chunk(plan.env, _usage(plan, runs))

    async def _execute(self, request: web.Request, plan: _Plan) -> web.StreamResponse:
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

    async def _open_stream(self, plan: _Plan, arrival: float) -> StreamLog:
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

    async def _produce(self, stack: AsyncExitStack, plan: _Plan, runs: list[ChoiceRun],
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
            stream.push(_error_body(plan.env.id, e))
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


def _usage(plan: _Plan, runs: list[ChoiceRun]):
    return make_usage(sum(len(p) for p in plan.prompts), sum(r.num_tokens for r in runs),
                      sum(r.num_cached_tokens for r in runs))


def _error_body(request_id: str, e: Exception) -> bytes:
    """An in-stream `{"error": ...}` payload (the openai client raises on it)."""
    if isinstance(e, OpenAIError):
        return e.body()
    log.error("stream_failed", request_id=request_id, error=repr(e))
    return OpenAIError(500, f"Internal error while generating: {type(e).__name__}",
                       type=SERVER_ERROR).body()


async def _send_error(sse: SSEStream, request_id: str, e: Exception) -> None:
    """An `{"error": ...}` event then `[DONE]`, outside the stream's log."""
    try:
        await sse.response.write(b"data: " + _error_body(request_id, e) + b"\n\n")
        await sse.done()
    except ConnectionResetError:
        pass
