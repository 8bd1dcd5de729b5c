"""Per-request sampling parameters (the vLLM shape users know)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Optional, Union

from .block_pool import salt_root
from .structured_output import StructuredOutput

MAX_LOGPROBS = 20  # top alternatives per position (OpenAI's top_logprobs limit)
MAX_CHOICES = 128  # n (OpenAI's limit)

LogitBias = Union[Mapping[int, float], tuple[tuple[int, float], ...], None]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token of one request.

    The logits of a row are processed in this order: every token outside
    `allowed_token_ids` removed, `bad_words_token_ids` removed (a sequence's last token,
    where the output so far ends with the rest of it; a one-token sequence always),
    `logit_bias` added, `min_tokens`
    (EOS and `stop_token_ids` barred until that many tokens are out), repetition penalty
    (prompt and output tokens: positive logits divided, negative ones multiplied),
    frequency and presence penalties (output tokens: `count * frequency + presence`
    subtracted), temperature, then the filters top-k, top-p, min-p.
    `temperature == 0` is greedy: the arg-max of the processed logits. A row that the
    steps after the allow-list left without a token (`min_tokens` barring every allowed
    one) keeps the allowed tokens alone: the allow-list is never broken.

    `logprobs`: report the sampled token's log-probability and the `logprobs` most likely
    alternatives (0: the sampled token only), from the distribution actually sampled from
    (after every step above; a greedy row's at temperature 1; filtered tokens -inf);
    `prompt_logprobs`: the same for every prompt token after the first (such a request does
    not reuse cached prefix pages: every position is computed).
    `structured`: the output must match it (a JSON schema, a regex, ...): tokens it does
    not allow are removed after the processors; its end allows only EOS.

    `n`: choices per prompt, expanded by `LLM` and the server into `n` requests, choice i
    seeded with `seed + i` (an unseeded request draws one seed for all); the engine runs
    one choice per request.

    `seed` fixes the random draw of every position: a seeded request yields the same
    tokens whatever else shares its batch, and after recovery. Requests without a seed
    get one drawn when the engine admits them. `output_base` is set by recovery only: the
    last `output_base` prompt tokens are this request's earlier output (penalties and
    `min_tokens` count them as output).
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()  # any sequence is accepted
    ignore_eos: bool = False
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: LogitBias = ()  # {token id: bias}; stored as sorted (id, bias) pairs
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    structured: Optional[StructuredOutput] = None
    allowed_token_ids: Optional[tuple[int, ...]] = None  # None: every token
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # see engine/bad_words.py
    cache_salt: Optional[str] = None  # prefix cache shared only with the same salt
    output_base: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(self, "bad_words_token_ids",
                           tuple(tuple(w) for w in self.bad_words_token_ids or ()))
        self._validate()

    def _validate(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_int("n", self.n, 1, MAX_CHOICES)
        _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens + self.output_base:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 0, MAX_LOGPROBS)
        _check_int("output_base", self.output_base, 0)
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or not all(_is_token(t) for t in self.allowed_token_ids)):
            raise ValueError("allowed_token_ids must be a non-empty list of token ids (>= 0), "
                             f"got {list(self.allowed_token_ids)[:8]}")
        if any(not w or not all(_is_token(t) for t in w) for w in self.bad_words_token_ids):
            raise ValueError("bad_words_token_ids must be non-empty sequences of token ids "
                             f"(>= 0), got {self.bad_words_token_ids[:4]}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str)
                                            or not self.cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {self.cache_salt!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got {self.structured!r}")

    @property
    def prefix_root(self) -> Optional[int]:
        """The chain-hash parent of this request's first page (`block_pool.salt_root`)."""
        return salt_root(self.cache_salt)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def shapes_logits(self) -> bool:
        """Whether anything besides temperature and the filters changes the logits."""
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty
                    or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.allowed_token_ids is not None or self.bad_words_token_ids)

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the raw logits with nothing to report: the arg-max is the whole job."""
        return (self.greedy and not self.shapes_logits and self.logprobs is None
                and self.structured is None)

    def with_seed(self, seed: int) -> "SamplingParams":
        return dataclasses.replace(self, seed=seed)

    def choices(self, draw_seed) -> list["SamplingParams"]:
        """The `n` single-choice params of this request: choice i seeded `seed + i`
        (`draw_seed()` gives the base when the request has none and samples)."""
        if self.n == 1:
            return [self]
        base = self.seed if self.seed is not None or self.greedy else draw_seed()
        return [dataclasses.replace(self, n=1, seed=None if base is None else base + i)
                for i in range(self.n)]


def _is_token(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def _check_int(name: str, value: object, low: int, high: Optional[int] = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low \
            or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")


def _bias_pairs(bias: LogitBias) -> tuple[tuple[int, float], ...]:
    """`{token: bias}` or (token, bias) pairs as sorted pairs; each bias in [-100, 100]."""
    items = bias.items() if isinstance(bias, Mapping) else (bias or ())
    pairs = []
    for token, value in items:
        token = int(token) if isinstance(token, str) and token.lstrip("-").isdigit() else token
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (>= 0), got {token!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not -100.0 <= value <= 100.0:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r}")
        pairs.append((token, float(value)))
    return tuple(sorted(pairs))
