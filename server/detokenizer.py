"""Token ids to text, incrementally, with OpenAI `stop` strings and vLLM's text fields.

`IncrementalDetokenizer` turns a growing list of token ids into text deltas whose
concatenation equals `tokenizer.decode(all_ids, skip_special_tokens=...)` for
byte-level tokenizers: it decodes a sliding window (the previous delta's tokens plus
the new ones) and holds text back while it ends in an incomplete UTF-8 sequence.

`TextAssembler` applies a choice's `TextRules` on top: the token that ended the output
(EOS or a `stop_token_ids` one) has no text; text is emitted only once no stop string
can still start inside it; output ends at the first stop string whose match ends past
the first `min_tokens` tokens' text, before it (or after it, with `include_stop`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["IncrementalDetokenizer", "TextAssembler", "TextRules"]


@dataclass(frozen=True, slots=True)
class TextRules:
    """How one choice's tokens become its text. `stop`: non-empty strings (the caller
    validates); `end_tokens`: the ids that end the output when sampled (the request's
    `stop_token_ids`, and EOS unless it ignores it): always its last token, never text
    unless `include_stop` (vLLM's `include_stop_str_in_output`, which also keeps a
    matched stop string)."""

    stop: tuple[str, ...] = ()
    include_stop: bool = False
    skip_special_tokens: bool = True
    end_tokens: frozenset[int] = frozenset()
    min_tokens: int = 0

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas of one output stream (the vLLM prefix/read-offset scheme)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: the tokens of the previous delta
        self._read = 0  # tokens up to here are already emitted as text

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Append tokens; return the text they complete ("" while a character is
        incomplete). With `final`, flush whatever remains, replacement chars included."""
        self._ids.extend(token_ids)
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) <= len(prefix_text) and not final:
            return ""
        if new_text.endswith(_REPLACEMENT) and not final:
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return new_text[len(prefix_text):]


class TextAssembler:
    """Emitted text of one choice: detokenized deltas under its `TextRules`."""

    def __init__(self, tokenizer: Any, rules: TextRules = TextRules()) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, rules.skip_special_tokens)
        self._rules = rules
        longest = max((len(s) for s in rules.stop), default=1)
        self._hold = 0 if rules.include_stop else longest - 1
        self._text = ""  # everything decoded so far (up to a stop match)
        self._emitted = 0  # chars of _text already returned
        self._tokens = 0  # tokens decoded so far
        self._floor = 0  # a stop match must end past this (the first min_tokens' text)
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that matched

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text[:self._emitted]

    def feed(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Add tokens; return the newly emittable text. After a stop string matched,
        `self.stopped` is True and later calls return ""."""
        if self.stopped:
            return ""
        ids = list(token_ids)
        if ids and ids[-1] in self._rules.end_tokens and not self._rules.include_stop:
            ids.pop()
        before = len(self._text)
        quiet = max(0, self._rules.min_tokens - self._tokens)
        if quiet and ids:
            self._text += self._detok.push(ids[:quiet])
            self._tokens += len(ids[:quiet])
            self._floor = len(self._text)
            ids = ids[quiet:]
        self._text += self._detok.push(ids, final)
        self._tokens += len(ids)
        if len(self._text) == before and not final:
            return ""
        cut = self._find_stop(before)
        if cut is not None:
            self._text = self._text[:cut]
            self.stopped = True
            end = len(self._text)
        else:
            end = len(self._text) if final else max(self._emitted, len(self._text) - self._hold)
        out = self._text[self._emitted:end]
        self._emitted = end
        return out

    def _find_stop(self, before: int) -> int | None:
        """Where the text ends at the earliest stop match that ends past both `before`
        (earlier text was searched already) and the min-tokens floor."""
        best = None
        for s in self._rules.stop:
            i = self._text.find(s, max(0, max(before, self._floor) - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, i + len(s) if self._rules.include_stop else i, s)
        if best is None:
            return None
        self.stop_string = best[2]
        return best[1]
