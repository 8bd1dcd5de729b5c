"""Grammar matchers of the requests with structured output, and their token masks.

One `Grammars` per engine (the rank that samples). A sequence's matcher is built on
admission from its `StructuredOutput` and fed every output token (the tail of a resumed
request's prompt too, `SamplingParams.output_base`, and a disaggregated request's first
token), so a request continues the same way after a recovery. Masks are computed on the
host for all constrained rows at once (llguidance's thread pool); on a GPU the forward is
still running when they are computed (the engine asks for them before it reads the
logits), and they are applied on the device as one masked fill.
"""

from __future__ import annotations

import threading
from pathlib import Path
from collections.abc import Sequence
from typing import Optional

import torch

from ..log import get_logger
from .structured_output import StructuredOutput

log = get_logger(__name__)

__all__ = ["Grammars"]


class Grammars:
    """Matchers over the model's tokenizer (loaded on first use from `model_path`)."""

    def __init__(self, model_path: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.model_path, self.vocab_size = model_path, vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._tokenizer = None
        self._executor = None
        self._compiled: dict[StructuredOutput, str] = {}
        self._lock = threading.Lock()

    def warm(self) -> None:
        """Load the tokenizer on a background thread now: a rank of a group must not stall
        its peers for it when its first constrained request arrives."""
        threading.Thread(target=self._warm, name="phalanx-grammars", daemon=True).start()

    def _warm(self) -> None:
        try:
            self._ll_tokenizer()
        except Exception as e:  # said once here; a constrained request gets it as its error
            log.warning("structured_output_unavailable", error=str(e))


    def _ll_tokenizer(self):
        """llguidance's tokenizer, from the folder's `tokenizer.json` (Rust, no
        transformers import: ~0.1 s) or else through the transformers tokenizer."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                eos = list(self.eos_token_ids) or None
                path = Path(self.model_path) / "tokenizer.json"
                if path.is_file():
                    try:
                        self._tokenizer = llguidance.LLTokenizer(
                            str(path), n_vocab=self.vocab_size, eos_token=eos)
                    except ValueError as e:
                        raise ValueError(f"structured output: the model's tokenizer.json is "
                                         f"not one llguidance reads ({e})") from None
                else:
                    import llguidance.hf
                    from transformers import AutoTokenizer

                    hf = AutoTokenizer.from_pretrained(self.model_path)
                    self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size,
                                                                   eos_token=eos)
                self._executor = llguidance.LLExecutor()
            return self._tokenizer

    def matcher(self, structured: StructuredOutput, consumed: Sequence[int] = ()):
        """A matcher for `structured` that has consumed `consumed`. ValueError when the
        grammar does not compile or rejects those tokens."""
        from llguidance import LLMatcher

        tokenizer = self._ll_tokenizer()
        grammar = self._compiled.get(structured)
        if grammar is None:
            try:
                grammar = structured.grammar()
            except ValueError as e:
                raise ValueError(f"structured output: {e}") from None
            error = LLMatcher.validate_grammar(grammar, tokenizer)
            if error:
                raise ValueError(f"structured output: the {structured.kind} does not compile: "
                                 f"{error.strip().splitlines()[0]}")
            self._compiled[structured] = grammar
        m = LLMatcher(tokenizer, grammar, log_level=0)
        if consumed and not m.consume_tokens(list(consumed)):
            raise ValueError(f"structured output: the output so far does not match the "
                             f"{structured.kind}: {m.get_error()}")
        if m.is_error():
            raise ValueError(f"structured output: {m.get_error()}")
        return m

    def allowed(self, matchers: Sequence, device: torch.device) -> torch.Tensor:
        """`[len(matchers), vocab]` bool on `device`: the tokens each matcher allows next."""
        self._ll_tokenizer()
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32,
                             pin_memory=device.type == "cuda")
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                               bitmask.data_ptr(), words * 4, len(matchers))
        bits = bitmask.to(device, non_blocking=True)
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        unpacked = (bits[:, :, None] >> shifts) & 1
        return unpacked.reshape(len(matchers), -1)[:, :self.vocab_size].bool()

    @staticmethod
    def advance(matcher, token: int) -> Optional[str]:
        """Feed `token`; the matcher's error if it rejects it (None when accepted)."""
        if matcher.consume_token(int(token)):
            return None
        return matcher.get_error() or f"token {token} rejected"
