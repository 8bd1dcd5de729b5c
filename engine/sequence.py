"""One request's state inside a rank's engine.

There are no prefill or decode phases: a sequence has `num_tokens` (prompt + output) and
`num_computed_tokens` (whose KV is in the cache). Each step computes some of the rest;
a step that reaches `num_tokens` samples one more token.
"""

from __future__ import annotations

import enum
import time
from typing import Optional, Sequence as Seq

import numpy as np

from .block_pool import hash_pages
from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Tokens, pages and progress of one request.

    Invariants: `pages` covers tokens `[0, num_computed_tokens)` plus the tokens being
    computed this step; `page_hashes[i]` is the chain hash of full page i of
    `token_ids`; pages `[0, num_registered_pages)` are published in the prefix cache.
    """

    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "params", "arrival",
                 "status", "finish_reason", "num_computed_tokens", "pages", "page_hashes",
                 "num_registered_pages", "num_cached_tokens", "num_preemptions",
                 "transfer_key", "hold_kv", "prompt_logprobs", "matcher", "added_at",
                 "scheduled_at", "_prompt_array")

    def __init__(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams,
                 arrival: int) -> None:
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.arrival = arrival
        self.status = SequenceStatus.WAITING
        self.finish_reason: Optional[str] = None
        self.num_computed_tokens = 0
        self.pages: list[int] = []
        self.page_hashes: list[int] = []
        self.num_registered_pages = 0
        self.num_cached_tokens = 0  # prefix-cache hits at first admission
        self.num_preemptions = 0
        self.transfer_key = 0  # > 0: its KV streams to a decode rank (plan row key)
        self.hold_kv = False  # keep the pages after finishing until `release_held`
        self.prompt_logprobs: list = []  # TokenLogprob of prompt tokens 1.. scored so far
        self.matcher = None  # the grammar state of a request with structured output
        self.added_at = time.monotonic()
        self.scheduled_at = 0.0  # when a step first included it (0: not yet)
        self._prompt_array = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def prompt_array(self):
        """The prompt as an int64 numpy array (made once: the prompt never changes)."""
        if self._prompt_array is None:
            self._prompt_array = np.asarray(self.prompt_token_ids, dtype=np.int64)
        return self._prompt_array

    def token_id(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def token_slice(self, start: int, stop: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        return (self.prompt_token_ids + self.output_token_ids)[start:stop]

    def full_page_hashes(self, page_size: int, num_tokens: int) -> list[int]:
        """Chain hashes of the full pages within the first `num_tokens` tokens."""
        want = num_tokens // page_size
        if len(self.page_hashes) < want:
            done = len(self.page_hashes)
            tokens = self.token_slice(done * page_size, want * page_size)
            parent = self.page_hashes[-1] if self.page_hashes else self.params.prefix_root
            self.page_hashes.extend(hash_pages(tokens, page_size, parent))
        return self.page_hashes[:want]

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens}, pages={len(self.pages)})")
