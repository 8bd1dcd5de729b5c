"""`POST /v1/responses`: OpenAI's Responses API over the chat route's plan and runs.

A request becomes a chat completion (responses_request.py) and runs as one choice; the
answer is a `response` object with one assistant message of `output_text` (status
"incomplete" with reason "max_output_tokens" when it hit its limit). Streamed, the
events are OpenAI's: `response.created`, `response.in_progress`,
`response.output_item.added`, `response.content_part.added`, one
`response.output_text.delta` per text delta, then the `.done` events of the text, the
part and the item, and `response.completed` (or `response.incomplete`) with the usage.
A failure mid-stream is an `{"error": ...}` event. Streams are not resumable.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator

import msgspec
from aiohttp import web

from ..log import get_logger
from .drain import shutting_down_error
from .errors import OpenAIError
from .generation import ChoiceRun, merge_runs
from .handlers import GenerationHandlers, error_body
from .plans import Plan
from .protocol import decode_struct
from .request_keys import ARRIVAL, CLIENT_ID, REQUEST_ID
from .responses_bodies import (InputTokensDetails, OutputMessage, OutputText, Response,
                               ResponseEvent, ResponsesRequest, ResponseUsage, IncompleteDetails)
from .responses_request import chat_request, renamed
from .sse import SSEStream

log = get_logger(__name__)
_encoder = msgspec.json.Encoder()

__all__ = ["ResponsesRoute"]


class ResponsesRoute:
    """The route over the generation handlers (their plans, runs and shutdown drain)."""

    def __init__(self, gen: GenerationHandlers) -> None:
        self.gen = gen

    async def create(self, request: web.Request) -> web.StreamResponse:
        req = decode_struct(await request.read(), ResponsesRequest)
        try:
            plan = await self.gen.plan(chat_request(req))
        except OpenAIError as e:
            raise renamed(e) from None
        shell = _shell(req, plan)
        if not request.get(CLIENT_ID):
            request[REQUEST_ID] = shell.id
        arrival = request.get(ARRIVAL, time.monotonic())
        with self.gen.drain.track() as entry:
            try:
                async with self.gen.running(plan, arrival) as runs:
                    if req.stream:
                        return await self._stream(request, shell, runs, entry)
                    text = ""
                    async with aclosing(merge_runs(runs)) as events:
                        async for event in events:
                            text += event.text
                    return web.Response(body=_encoder.encode(_finished(shell, text, runs[0])),
                                        content_type="application/json",
                                        headers={"X-Request-Id": request[REQUEST_ID]})
            except asyncio.CancelledError:
                entry.absorb()
                raise shutting_down_error() from None

    async def _stream(self, request: web.Request, shell: Response, runs: list[ChoiceRun],
                      entry: Any) -> web.StreamResponse:
        sse = SSEStream(request, headers={"X-Request-Id": request[REQUEST_ID]})
        await sse.start()
        try:
            async for event in _events(shell, runs):
                await sse.response.write(b"event: " + event.type.encode() + b"\ndata: "
                                         + _encoder.encode(event) + b"\n\n")
            await sse.end()
        except ConnectionResetError:
            log.info("client_disconnected", request_id=shell.id)
        except asyncio.CancelledError:
            entry.absorb()
            await _write_error(sse, shutting_down_error().body())
        except Exception as e:  # noqa: BLE001 - reported in-stream, as the spec has it
            await _write_error(sse, error_body(shell.id, e))
        return sse.response


def _shell(req: ResponsesRequest, plan: Plan) -> Response:
    """The response object before any output (its settings as the request gave them)."""
    text = {"format": msgspec.to_builtins(req.text.format)} if req.text and req.text.format \
        else {"format": {"type": "text"}}
    return Response(f"resp_{uuid.uuid4().hex}", int(time.time()), plan.env.model, "in_progress",
                    [], instructions=req.instructions, max_output_tokens=req.max_output_tokens,
                    temperature=req.temperature, top_p=req.top_p,
                    metadata=dict(req.metadata or {}), store=False, text=text,
                    user=req.user if req.user is not None else msgspec.UNSET)


def _message(shell: Response, text: str, status: str) -> OutputMessage:
    parts = [] if status == "in_progress" else [OutputText(text)]
    return OutputMessage(f"msg_{shell.id[len('resp_'):]}", status, parts)


def _finished(shell: Response, text: str, run: ChoiceRun) -> Response:
    """`shell` completed with the run's text and usage."""
    prompt = len(run.prompt_token_ids)
    done = run.text.stopped or run.finish_reason != "length"
    status = "completed" if done else "incomplete"
    return msgspec.structs.replace(
        shell, status=status, output=[_message(shell, text, status)],
        incomplete_details=None if done else IncompleteDetails("max_output_tokens"),
        usage=ResponseUsage(prompt, run.num_tokens, prompt + run.num_tokens,
                            InputTokensDetails(run.num_cached_tokens)))


async def _events(shell: Response, runs: list[ChoiceRun]) -> AsyncIterator[ResponseEvent]:
    """The stream's events, numbered in order."""
    seq = itertools.count()
    item = _message(shell, "", "in_progress")
    part = OutputText("")
    yield ResponseEvent("response.created", next(seq), response=shell)
    yield ResponseEvent("response.in_progress", next(seq), response=shell)
    yield ResponseEvent("response.output_item.added", next(seq), output_index=0, item=item)
    yield ResponseEvent("response.content_part.added", next(seq), output_index=0,
                        content_index=0, item_id=item.id, part=part)
    text = ""
    async with aclosing(merge_runs(runs)) as events:
        async for event in events:
            if event.text:
                text += event.text
                yield ResponseEvent("response.output_text.delta", next(seq), output_index=0,
                                    content_index=0, item_id=item.id, delta=event.text,
                                    logprobs=[])
    final = _finished(shell, text, runs[0])
    yield ResponseEvent("response.output_text.done", next(seq), output_index=0, content_index=0,
                        item_id=item.id, text=text, logprobs=[])
    yield ResponseEvent("response.content_part.done", next(seq), output_index=0,
                        content_index=0, item_id=item.id, part=OutputText(text))
    yield ResponseEvent("response.output_item.done", next(seq), output_index=0,
                        item=final.output[0])
    kind = "response.completed" if final.status == "completed" else "response.incomplete"
    yield ResponseEvent(kind, next(seq), response=final)


async def _write_error(sse: SSEStream, body: bytes) -> None:
    try:
        await sse.response.write(b"event: error\ndata: " + body + b"\n\n")
        await sse.end()
    except ConnectionResetError:
        pass
