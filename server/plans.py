"""Plans: a decoded generation request made ready to run, HTTP-free.

`PlanBuilder` checks the model, tokenizes (completions: each prompt, with the tokenizer's
special tokens unless `add_special_tokens` is false; chat: the model folder's chat
template), truncates prompts to `truncate_prompt_tokens`, fits `max_tokens` to the
context and builds the `SamplingParams` and `TextRules` every choice runs with. The
server's routes and the in-process SDK client both run plans (handlers.py).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

from ..engine.bad_words import bad_words_token_ids
from ..engine.sampling_params import SamplingParams
from . import protocol as proto
from .backend import ServingBackend
from .detokenizer import TextRules
from .errors import OpenAIError
from .formats import ChatFormat, CompletionFormat, EchoPrompt, Envelope
from .logprob_format import TokenIdTexts, TokenNames, TokenTexts
from .tool_choice import tool_plan

__all__ = ["Plan", "PlanBuilder", "render_chat", "text_chars", "MAX_CHOICES"]

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI default of /v1/completions
MAX_CHOICES = 256  # choices (prompts x n, or best_of) per request
_Format = Union[CompletionFormat, ChatFormat]


@dataclass(slots=True)
class Plan:
    """A validated request, ready to run: `params.n` choices run per prompt, `n` of them
    are returned (fewer with `best_of`: the best by cumulative logprob)."""

    env: Envelope
    prompts: list[list[int]]
    params: SamplingParams
    text: TextRules
    stream: bool
    include_usage: bool
    fmt: _Format
    prompt_param: str  # "prompt" or "messages": where a refused prompt came from
    n: int = 1
    keep_output: bool = True  # False: echo with max_tokens 0 (the prompt only)
    constraint_param: Optional[str] = None  # the field of the output constraint, if any
    continuous_usage: bool = False  # every stream chunk carries its choice's usage so far


# Prompt text (characters) past which a request is tokenized on the tokenizer thread, not
# on the event loop: a long prompt or chat template takes milliseconds that every stream
# in flight would otherwise wait for.
OFFLOAD_CHARS = 4096


def text_chars(req: Union[proto.CompletionRequest, proto.ChatCompletionRequest]) -> int:
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


class PlanBuilder:
    """Plans of one backend's requests (tokenizing on whatever thread calls it; the
    tokenizer is used from one thread at a time)."""

    def __init__(self, backend: ServingBackend, model_name: str) -> None:
        self.backend, self.model_name = backend, model_name
        self.token_texts = TokenTexts(backend.tokenizer)  # logprobs' token strings

    def completion(self, req: proto.CompletionRequest) -> Plan:
        """A validated completion request, ready to run (OpenAIError if it is not)."""
        self.check_model(req.model)
        given = proto.completion_prompts(req)
        special = req.add_special_tokens is not False
        prompts = [self._truncate(self._tokenize(p, special), req) for p in given]
        scoring = req.max_tokens == 0  # echo only (checked): the prompt's logprobs
        max_tokens = self._fit(prompts, 1 if scoring else req.max_tokens,
                               DEFAULT_COMPLETION_MAX_TOKENS, "max_tokens", "prompt")
        echo = None
        if req.echo:
            echo = [EchoPrompt(p if isinstance(p, str) and not req.truncate_prompt_tokens
                               else self.backend.tokenizer.decode(ids), ids)
                    for p, ids in zip(given, prompts)]
        fmt = CompletionFormat(self._texts(req) if req.logprobs is not None else None, echo,
                               req.n or 1, prompts, self._prompt_names(req))
        plan = self._plan(req, "cmpl", prompts, max_tokens, fmt, "prompt")
        plan.keep_output = not scoring
        return plan

    def chat(self, req: proto.ChatCompletionRequest) -> Plan:
        """A validated chat request, ready to run (OpenAIError if it is not)."""
        self.check_model(req.model)
        tools = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
        messages = proto.chat_messages(req)
        prompt = render_chat(self.backend.tokenizer, messages, tools=tools.render,
                             add_generation_prompt=req.add_generation_prompt,
                             continue_final_message=req.continue_final_message,
                             template_kwargs=req.chat_template_kwargs,
                             add_special_tokens=bool(req.add_special_tokens))
        prompt = self._truncate(prompt, req)
        requested, param = (req.max_completion_tokens, "max_completion_tokens") \
            if req.max_completion_tokens is not None else (req.max_tokens, "max_tokens")
        max_tokens = self._fit([prompt], requested, None, param, "messages")
        # vLLM's `echo`: the last message's text leads each choice's when it is the
        # assistant's (the role the answer takes), e.g. with continue_final_message
        last = messages[-1]
        echo = (last["content"] or "") if req.echo and last["role"] == "assistant" else ""
        fmt = ChatFormat(self._texts(req) if req.logprobs else None, tools.parse, prompt,
                         self._prompt_names(req), echo)
        return self._plan(req, "chatcmpl", [prompt], max_tokens, fmt, "messages")

    # -- validation --------------------------------------------------------------------
    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist. This server serves "
                              f"`{self.model_name}`.", param="model", code="model_not_found")

    def _texts(self, req: proto.SamplingFields) -> TokenNames:
        """How logprobs name tokens: their text, or `token_id:<id>` when asked."""
        return TokenIdTexts() if req.return_tokens_as_token_ids else self.token_texts

    def _prompt_names(self, req: proto.SamplingFields) -> Optional[TokenNames]:
        """Token names for vLLM's `prompt_logprobs` (None: not asked for)."""
        return None if req.prompt_logprobs is None else self._texts(req)

    def _truncate(self, prompt: list[int], req: proto.SamplingFields) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` tokens (-1: the context length), or
        its first ones with `truncation_side: "right"`."""
        keep, limit = req.truncate_prompt_tokens, self.backend.max_model_len
        if keep is None:
            return prompt
        if keep > limit:
            raise OpenAIError(400, f"truncate_prompt_tokens ({keep}) is greater than the "
                              f"model's context length ({limit}).",
                              param="truncate_prompt_tokens", code="invalid_value")
        keep = limit if keep == -1 else keep
        return prompt[:keep] if req.truncation_side == "right" else prompt[-keep:]

    def _tokenize(self, prompt: Union[str, list[int]], add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        ids = self.backend.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
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
              max_tokens: int, fmt: _Format, prompt_param: str) -> Plan:
        env = Envelope(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), self.model_name,
                       bool(req.return_token_ids))
        opts = req.stream_options
        try:
            bad_words = bad_words_token_ids(self.backend.tokenizer, req.bad_words or ())
        except ValueError as e:
            raise OpenAIError(400, str(e), param="bad_words", code="invalid_value") from None
        params = proto.sampling_params(req, max_tokens, bad_words)
        if params.n * len(prompts) > MAX_CHOICES:
            raise OpenAIError(400, f"A request runs at most {MAX_CHOICES} choices; this one "
                              f"asks {params.n} for each of {len(prompts)} prompts.",
                              param="n", code="invalid_value")
        usage = bool(req.stream and opts and opts.include_usage)
        return Plan(env, prompts, params, proto.text_rules(req, self.backend.eos_token_ids),
                    bool(req.stream), usage, fmt, prompt_param, req.n or 1,
                    constraint_param=proto.structured_output(req)[1],
                    continuous_usage=usage and bool(opts.continuous_usage_stats))
