"""The choices of one prompt as the offline API collects them (`LLM.generate`)."""

from __future__ import annotations

from typing import Callable, Optional

from .outputs import CompletionOutput, RequestOutput, StepOutput

__all__ = ["ChoiceRun"]


class ChoiceRun:
    """Outputs of a prompt's `n` choices (request ids in choice order as they are
    submitted); `done` once all `n` were submitted and finished."""

    def __init__(self, prompt_token_ids: list[int], n: int = 1) -> None:
        self.prompt_token_ids, self.n = prompt_token_ids, n
        self.rids: list[str] = []
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list] = {}
        self.last: dict[int, StepOutput] = {}
        self.prompt_logprobs = None

    def take(self, choice: int, out: StepOutput) -> None:
        self.tokens.setdefault(choice, []).extend(out.new_token_ids)
        if out.logprobs is not None:
            self.logprobs.setdefault(choice, []).extend(out.logprobs)
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.last[choice] = out

    @property
    def done(self) -> bool:
        return len(self.rids) == self.n and len(self.last) == self.n

    def unfinished(self) -> list[str]:
        return [rid for k, rid in enumerate(self.rids) if k not in self.last]

    def output(self, text: Optional[str], decode: Callable[[list[int]], str]) -> RequestOutput:
        outputs = []
        for k in range(len(self.rids)):
            ids, end = self.tokens.get(k, []), self.last[k]
            lps = self.logprobs.get(k)
            shown = ids[:-1] if end.finish_reason == "stop" and ids else ids  # not the stop token
            outputs.append(CompletionOutput(
                k, decode(shown), ids, end.finish_reason, lps,
                None if lps is None else sum(lp.logprob for lp in lps)))
        first = self.last[0]
        return RequestOutput(self.rids[0], text, self.prompt_token_ids, outputs,
                             first.num_cached_tokens, prompt_logprobs=self.prompt_logprobs)
