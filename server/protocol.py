"""Request bodies of `/v1/completions` and `/v1/chat/completions` (request_bodies.py):
decoded, checked, and read into what the engine and the server run with.

Decoding is strict: JSON types must match (a string where an int is expected, a bool
where a number is expected, ... are 400 with `param` naming the field; see errors.py
for why 400 and not 422) and unknown top-level fields are refused (400, "Unrecognized
request argument"), as the OpenAI API does. Fields of the spec that phalanx does not
implement are accepted only at their neutral value (`suffix`, `tools`, ...); anything
else is 400 naming the field.

Sampling fields of the spec: `n` (choices per prompt, choice i seeded with seed + i),
`best_of` (completions: that many choices, the `n` with the highest cumulative logprob
returned; not with `stream`), `presence_penalty`, `frequency_penalty`, `logit_bias`
(token id -> bias in [-100, 100]), `logprobs` (completions: an int in [0, 20]; chat: a
bool, with `top_logprobs` in [0, 20]), `echo` (completions; with `logprobs`, the prompt's
tokens are scored too, and `max_tokens: 0` returns only the prompt: lm-evaluation-harness'
loglikelihood request), `response_format` (`json_object`, `json_schema`: constrained
decoding with llguidance, on both routes).

Extensions (vLLM spellings): `top_k` (int, 0 or -1 = off), `min_p` (float in [0, 1]),
`structured_outputs` / `guided_json|regex|choice|grammar` (an output constraint),
`repetition_penalty` (float in (0, 2]), `min_tokens` (EOS and stop tokens barred until
that many tokens are out), `stop_token_ids` (ids that end the choice, finish reason
"stop"; their text is not output), `ignore_eos` (bool), `return_token_ids` (bool: each
choice, and each stream chunk's choice, carries the ids of the tokens it adds as
`token_ids`), `include_stop_str_in_output` (the matched stop string, or the stop token's
text, is kept), `skip_special_tokens` (default true), `allowed_token_ids` (only these
may be sampled), `bad_words` (words never generated: engine/bad_words.py),
`truncate_prompt_tokens` (keep the prompt's last k tokens, or its first k with
`truncation_side: "right"`; -1: the context length),
`echo` on chat (the last message's text leads each choice's content when it is the
assistant's, e.g. with `continue_final_message`; a stream sends it in the opening delta),
`add_special_tokens` (the tokenizer's BOS and the like; default true for completions,
false for chat, whose template writes them), `return_tokens_as_token_ids` (logprobs name
tokens `token_id:<id>`), `priority` (0 only: requests are served first come, first
served, as vLLM's default policy, which refuses other values too), `use_beam_search`,
`length_penalty` and `spaces_between_special_tokens` at their defaults only (false, 1,
true: no beam search; the text is the fast tokenizer's), `prompt_logprobs`
(each prompt position's logprobs, vLLM's shape; not streamed) and `cache_salt` (the
request's KV pages are shared through the prefix cache only with requests of the same
salt: engine/block_pool.salt_root).
`stop` is implemented by matching the detokenized text (up to 4 non-empty strings); a
match ending within the first `min_tokens` tokens' text does not count.
Response bodies live in `phalanx.openai_types` (shared with the SDK).
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence, Type, TypeVar, Union

import msgspec

from ..engine.sampling_params import MAX_CHOICES, MAX_LOGPROBS, SamplingParams
from ..engine.structured_output import StructuredOutput
from .errors import OpenAIError
from .chat_messages import chat_messages
from .detokenizer import TextRules
from .output_constraint import constraint_of
from .request_bodies import (ChatCompletionRequest, ChatMessageIn, CompletionRequest,  # noqa: F401
                             ContentPart, SamplingFields, StreamOptions)
from .tool_choice import tool_plan

__all__ = ["StreamOptions", "SamplingFields", "CompletionRequest", "ContentPart",
           "ChatMessageIn", "ChatCompletionRequest", "decode_request", "completion_prompts",
           "chat_messages", "stop_strings", "sampling_params", "MAX_PROMPTS", "decode_struct",
           "logit_bias", "structured_output", "text_rules"]

MAX_PROMPTS = 256  # prompts per /v1/completions request
MAX_BEST_OF = 20
MAX_STOP = 4
MAX_SALT = 1024  # characters of cache_salt (vLLM's limit)
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
T = TypeVar("T")


_AT = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_FIELD = re.compile(r"field `(?P<name>[^`]+)`")


def decode_request(body: bytes, cls: Type[T]) -> T:
    """Decode and type-check a generation request body; OpenAIError(400) on any mismatch."""
    req = decode_struct(body, cls)
    _check_common(req)
    return req


def decode_struct(body: bytes, cls: Type[T]) -> T:
    """Decode and type-check a request body of any route; OpenAIError(400) naming the
    field on a mismatch, an unknown field or a missing one."""
    try:
        return msgspec.json.decode(body, type=cls)
    except msgspec.ValidationError as e:
        raise _validation_error(str(e)) from None
    except msgspec.DecodeError as e:
        raise OpenAIError(400, f"We could not parse the JSON body of your request ({e}). "
                          "The body must be a JSON object.", code="invalid_json") from None


def _validation_error(text: str) -> OpenAIError:
    at = _AT.search(text)
    path = at.group("path") if at else ""
    message = text[:at.start()] if at else text
    field = _FIELD.search(message)
    if message.startswith("Object contains unknown field") and field:
        name = ".".join(p for p in (path, field.group("name")) if p)
        return OpenAIError(400, f"Unrecognized request argument supplied: {name}", param=name,
                           code="unknown_parameter")
    if message.startswith("Object missing required field") and field:
        name = ".".join(p for p in (path, field.group("name")) if p)
        return OpenAIError(400, f"Missing required parameter: '{name}'.", param=name,
                           code="missing_required_parameter")
    where = f" at '{path}'" if path else ""
    return OpenAIError(400, f"Invalid type{where}: {message}", param=path or None,
                       code="invalid_type")


def _bad(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def _check_common(req: SamplingFields) -> None:
    """Ranges and unsupported values shared by both routes."""
    scoring = isinstance(req, CompletionRequest) and req.echo and req.max_tokens == 0
    if req.max_tokens is not None and req.max_tokens <= 0 and not scoring:
        raise _bad("max_tokens", f"max_tokens must be at least 1 (0 only with echo), got "
                   f"{req.max_tokens}.")
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise _bad("temperature", f"temperature must be in [0, 2], got {req.temperature}.")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise _bad("top_p", f"top_p must be in (0, 1], got {req.top_p}.")
    if req.top_k is not None and req.top_k < -1:
        raise _bad("top_k", f"top_k must be -1, 0 (off) or positive, got {req.top_k}.")
    if req.min_p is not None and not 0.0 <= req.min_p <= 1.0:
        raise _bad("min_p", f"min_p must be in [0, 1], got {req.min_p}.")
    if req.stop_token_ids is not None and any(t < 0 for t in req.stop_token_ids):
        raise _bad("stop_token_ids", "stop_token_ids must be token ids (>= 0).")
    if req.seed is not None and not INT64_MIN <= req.seed <= INT64_MAX:
        raise _bad("seed", "seed must fit in a signed 64-bit integer.")
    if req.model == "":
        raise _bad("model", "model must not be empty.")
    if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
        raise _bad("n", f"n must be in [1, {MAX_CHOICES}], got {req.n}.")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None and not -2.0 <= value <= 2.0:
            raise _bad(name, f"{name} must be in [-2, 2], got {value}.")
    if req.repetition_penalty is not None and not 0.0 < req.repetition_penalty <= 2.0:
        raise _bad("repetition_penalty", "repetition_penalty must be in (0, 2], got "
                   f"{req.repetition_penalty}.")
    if req.min_tokens is not None and req.min_tokens < 0:
        raise _bad("min_tokens", f"min_tokens must be >= 0, got {req.min_tokens}.")
    _check_vllm_fields(req)
    logit_bias(req)
    structured_output(req)
    stop_strings(req)
    if isinstance(req, CompletionRequest):
        _check_completion(req)
    elif isinstance(req, ChatCompletionRequest):
        _check_chat(req)


def _check_vllm_fields(req: SamplingFields) -> None:
    _only_neutral(req, use_beam_search=(None, False), length_penalty=(None, 1.0),
                  spaces_between_special_tokens=(None, True))
    if req.allowed_token_ids is not None and (not req.allowed_token_ids
                                              or any(t < 0 for t in req.allowed_token_ids)):
        raise _bad("allowed_token_ids", "allowed_token_ids must be a non-empty list of token "
                   "ids (>= 0).")
    if req.bad_words is not None and any(not w.strip() for w in req.bad_words):
        raise _bad("bad_words", "bad_words must be words with text.")
    t = req.truncate_prompt_tokens
    if t is not None and t != -1 and t < 1:
        raise _bad("truncate_prompt_tokens", "truncate_prompt_tokens must be -1 (the context "
                   f"length) or at least 1, got {t}.")
    if req.cache_salt is not None and not 1 <= len(req.cache_salt) <= MAX_SALT:
        raise _bad("cache_salt", f"cache_salt must be a string of 1 to {MAX_SALT} characters.")
    if req.truncation_side not in (None, "left", "right"):
        raise _bad("truncation_side", "truncation_side must be \"left\" or \"right\", got "
                   f"{req.truncation_side!r}.")
    if req.prompt_logprobs is not None:
        if not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
            raise _bad("prompt_logprobs", f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], "
                       f"got {req.prompt_logprobs}.")
        if req.stream:
            raise _bad("prompt_logprobs", "prompt_logprobs cannot be streamed (they come "
                       "whole, with the response).")
    if req.priority not in (None, 0):
        raise _bad("priority", f"priority={req.priority} asks for priority scheduling, which "
                   "this server does not run: it serves requests first come, first served "
                   "(priority 0).", "unsupported_value")


def text_rules(req: SamplingFields, eos_token_ids: Sequence[int]) -> TextRules:
    """How the request's choices turn tokens into text."""
    ends = set(req.stop_token_ids or ()) | (set() if req.ignore_eos else set(eos_token_ids))
    return TextRules(tuple(stop_strings(req)), bool(req.include_stop_str_in_output),
                     req.skip_special_tokens is not False, frozenset(ends), req.min_tokens or 0)


def _check_completion(req: "CompletionRequest") -> None:
    _only_neutral(req, suffix=(None, ""))
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise _bad("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}.")
    n = req.n or 1
    if req.best_of is not None:
        if not n <= req.best_of <= MAX_BEST_OF:
            raise _bad("best_of", f"best_of must be in [n, {MAX_BEST_OF}] (n = {n}), got "
                       f"{req.best_of}.")
        if req.stream and req.best_of > n:
            raise _bad("best_of", "best_of > n cannot be streamed: the best choices are "
                       "known only at the end.")


def _check_chat(req: "ChatCompletionRequest") -> None:
    if req.max_completion_tokens is not None and req.max_completion_tokens <= 0:
        raise _bad("max_completion_tokens", "max_completion_tokens must be at least 1, "
                   f"got {req.max_completion_tokens}.")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise _bad("top_logprobs", "top_logprobs requires logprobs: true.")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise _bad("top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                       f"{req.top_logprobs}.")
    tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
    check_template_args(req.add_generation_prompt, req.continue_final_message,
                        req.chat_template_kwargs)


# apply_chat_template's own arguments and the variables it sets itself
_TEMPLATE_RESERVED = frozenset({"messages", "conversation", "tools", "documents", "chat_template",
                                "add_generation_prompt", "continue_final_message", "tokenize",
                                "return_dict", "tokenizer_kwargs"})


def check_template_args(add_generation_prompt: bool, continue_final_message: bool,
                        template_kwargs: Optional[dict[str, Any]]) -> None:
    """400 for a chat rendering vLLM refuses too: both flags set, or `chat_template_kwargs`
    naming one of apply_chat_template's own arguments (they have fields of their own)."""
    if add_generation_prompt and continue_final_message:
        raise _bad("continue_final_message", "add_generation_prompt and continue_final_message "
                   "cannot both be true.")
    taken = sorted(_TEMPLATE_RESERVED.intersection(template_kwargs or {}))
    if taken:
        raise _bad("chat_template_kwargs", f"chat_template_kwargs cannot set {', '.join(taken)}: "
                   "those are the renderer's own (give them as request fields where they are).")


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def structured_output(req: SamplingFields) -> tuple[Optional[StructuredOutput], Optional[str]]:
    """(the request's output constraint, the field it came from): `response_format`
    (`json_object`, `json_schema`), vLLM's `structured_outputs` (`json`, `regex`, `choice`,
    `grammar` in Lark or GBNF, `json_object`) or its older `guided_*` fields; at most one.
    400 naming the field for a malformed one."""
    given = [name for name in ("response_format", "structured_outputs", *_GUIDED)
             if getattr(req, name) is not None and getattr(req, name) != {"type": "text"}]
    if isinstance(req, ChatCompletionRequest):
        forced = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls).constraint
        if forced is not None:
            if given:
                raise _bad(given[0], f"{given[0]} cannot be combined with a tool_choice that "
                           "forces a call.")
            return forced, "tool_choice"
    if not given:
        return None, None
    if len(given) > 1:
        raise _bad(given[1], f"Give one output constraint, not {' and '.join(given)}.")
    name = given[0]
    value = getattr(req, name)
    try:
        return constraint_of(name, value), name
    except (ValueError, TypeError) as e:
        raise _bad(name, f"{name}: {e}") from None


def logit_bias(req: SamplingFields) -> dict[int, float]:
    """`logit_bias` with integer keys (400 for a key that is not a token id or a bias
    outside [-100, 100]); ids beyond the vocabulary are the backend's 400."""
    out = {}
    for key, value in (req.logit_bias or {}).items():
        if not key.isdigit():
            raise _bad("logit_bias", f"logit_bias keys must be token ids, got {key!r}.")
        if not -100.0 <= value <= 100.0:
            raise _bad("logit_bias", f"logit_bias values must be in [-100, 100], got {value} "
                       f"for token {key}.")
        out[int(key)] = float(value)
    return out


def _only_neutral(req: Any, **allowed: tuple) -> None:
    """400 unless each named field holds one of its allowed (neutral) values."""
    for name, values in allowed.items():
        value = getattr(req, name)
        if value not in values:
            raise _bad(name, f"{name}={value!r} is not supported by this server.",
                       "unsupported_value")


def stop_strings(req: SamplingFields) -> list[str]:
    """`stop` as a list of 0..4 non-empty strings (400 otherwise)."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP:
        raise _bad("stop", f"stop accepts at most {MAX_STOP} strings, got {len(stop)}.")
    if any(s == "" for s in stop):
        raise _bad("stop", "stop strings must not be empty.")
    return stop


def completion_prompts(req: CompletionRequest) -> list[Union[str, list[int]]]:
    """The request's prompts, each a string or a list of token ids."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise _bad("prompt", "prompt must not be an empty list.")
    if all(_is_token(t) for t in p):
        return [list(p)]
    if len(p) > MAX_PROMPTS:
        raise _bad("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(p)}.")
    if all(isinstance(x, str) for x in p):
        return list(p)
    if all(isinstance(x, list) and x and all(_is_token(t) for t in x) for x in p):
        return [list(x) for x in p]
    raise OpenAIError(400, "prompt must be a string, a list of strings, a non-empty list of "
                      "token ids, or a list of non-empty lists of token ids.", param="prompt",
                      code="invalid_type")


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def sampling_params(req: SamplingFields, max_tokens: int,
                    bad_words: tuple[tuple[int, ...], ...] = ()) -> SamplingParams:
    """SamplingParams of a decoded request (OpenAI defaults: temperature 1, top_p 1);
    `n` is the number of choices to run per prompt (`best_of` when given); `bad_words`:
    the request's `bad_words` as token sequences (engine/bad_words.py)."""
    logprobs, prompt_logprobs = None, None
    runs = req.n or 1
    if isinstance(req, CompletionRequest):
        logprobs = req.logprobs
        runs = req.best_of or runs
        if runs > (req.n or 1) and logprobs is None:
            logprobs = 0  # best_of ranks choices by their cumulative logprob
        if req.echo and req.logprobs is not None:
            prompt_logprobs = req.logprobs
    elif isinstance(req, ChatCompletionRequest) and req.logprobs:
        logprobs = req.top_logprobs or 0
    if req.prompt_logprobs is not None:  # vLLM: it sets the echoed prompt's too
        prompt_logprobs = req.prompt_logprobs
    try:
        return SamplingParams(
            n=runs,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            max_tokens=max_tokens, seed=req.seed, ignore_eos=bool(req.ignore_eos),
            min_tokens=req.min_tokens or 0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=logit_bias(req), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            structured=structured_output(req)[0], bad_words_token_ids=bad_words,
            cache_salt=req.cache_salt,
            allowed_token_ids=None if req.allowed_token_ids is None
            else tuple(req.allowed_token_ids))
    except ValueError as e:
        raise _bad(str(e).split(" ", 1)[0], str(e)) from None
