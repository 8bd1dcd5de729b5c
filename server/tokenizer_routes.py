"""`POST /tokenize` and `POST /detokenize`, in vLLM's shapes (its extensions of the
OpenAI API, which clients such as lm-evaluation-harness and AIPerf use to count tokens).

`/tokenize` takes either a completion prompt (`{"prompt": str, "add_special_tokens":
true}`) or chat messages (`{"messages": [...], "add_generation_prompt": true,
"continue_final_message": false, "chat_template_kwargs": {...}, "add_special_tokens":
false}`: the ids a chat request with these fields would run on), with `return_token_strs`
for each id's token string;
it answers `{"count", "max_model_len", "tokens", "token_strs"}`. `/detokenize` takes
`{"tokens": [int]}` and answers `{"prompt": str}`. `model` is optional; when given it
must be the served one (404 otherwise). Ids outside the vocabulary are 400.
"""

from __future__ import annotations

from typing import Any, Optional

import msgspec
from aiohttp import web

from ..openai_types import DetokenizeResponse, TokenizeResponse
from . import protocol as proto
from .errors import OpenAIError
from .handlers import GenerationHandlers, render_chat

__all__ = ["TokenizerRoutes", "TokenizePrompt", "TokenizeChat", "Detokenize"]


class TokenizePrompt(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    prompt: str
    model: Optional[str] = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    messages: list[proto.ChatMessageIn]
    model: Optional[str] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


class Detokenize(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tokens: list[int]
    model: Optional[str] = None


class TokenizerRoutes:
    """The two routes over the generation handlers' tokenizer, model check and
    tokenizer thread."""

    def __init__(self, gen: GenerationHandlers) -> None:
        self.gen = gen

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.read()
        chat = _has_messages(body)
        req = proto.decode_struct(body, TokenizeChat if chat else TokenizePrompt)
        if req.model is not None:
            self.gen.check_model(req.model)
        if isinstance(req, TokenizeChat):
            proto.check_template_args(req.add_generation_prompt, req.continue_final_message,
                                      req.chat_template_kwargs)
            messages = proto.chat_messages(req)
            chars = sum(len(m["content"]) for m in messages)
            ids = await self.gen.on_tokenizer(chars, self._chat_ids, messages, req)
        else:
            ids = await self.gen.on_tokenizer(len(req.prompt), self._prompt_ids, req)
        strs = self.gen.backend.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs \
            else None
        return _json(TokenizeResponse(len(ids), self.gen.backend.max_model_len, ids, strs))

    async def detokenize(self, request: web.Request) -> web.Response:
        req = proto.decode_struct(await request.read(), Detokenize)
        if req.model is not None:
            self.gen.check_model(req.model)
        tok = self.gen.backend.tokenizer
        vocab = len(tok)
        bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise OpenAIError(400, f"tokens[{bad}] = {req.tokens[bad]} is not a token id of "
                              f"this model (0 .. {vocab - 1}).", param=f"tokens[{bad}]",
                              code="invalid_value")
        text = await self.gen.on_tokenizer(len(req.tokens), tok.decode, req.tokens)
        return _json(DetokenizeResponse(text))

    def _prompt_ids(self, req: TokenizePrompt) -> list[int]:
        return list(self.gen.backend.tokenizer.encode(
            req.prompt, add_special_tokens=req.add_special_tokens))

    def _chat_ids(self, messages: list[dict[str, str]], req: TokenizeChat) -> list[int]:
        return render_chat(self.gen.backend.tokenizer, messages,
                           add_generation_prompt=req.add_generation_prompt,
                           continue_final_message=req.continue_final_message,
                           add_special_tokens=req.add_special_tokens,
                           template_kwargs=req.chat_template_kwargs)


def _has_messages(body: bytes) -> bool:
    """Whether the body is a JSON object with a `messages` key (a chat request)."""
    try:
        obj: Any = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return False  # decode_struct answers the parse error
    return isinstance(obj, dict) and "messages" in obj


def _json(obj: object) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), content_type="application/json")
