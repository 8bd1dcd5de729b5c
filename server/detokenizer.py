"""Token ids to text, incrementally, with OpenAI `stop` strings.

`IncrementalDetokenizer` turns a growing list of token ids into text deltas whose
concatenation equals `tokenizer.decode(all_ids, skip_special_tokens=True)` for
byte-level tokenizers: it decodes a sliding window (the previous delta's tokens plus
the new ones) and holds text back while it ends in an incomplete UTF-8 sequence.

`TextAssembler` adds stop strings on top: text is emitted only once no stop string can
still start inside it, and output ends (excluding the stop string) at the first match.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["IncrementalDetokenizer", "TextAssembler"]

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas of one output stream (the vLLM prefix/read-offset scheme)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start: the tokens of the previous delta
        self._read = 0  # tokens up to here are already emitted as text

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

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
    """Emitted text of one choice: detokenized deltas cut at the first stop string."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        """`stop`: non-empty strings (the caller validates); the output ends before
        the first occurrence of any of them."""
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._text = ""  # everything decoded so far (up to a stop match)
        self._emitted = 0  # chars of _text already returned
        self.stopped = False

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text[:self._emitted]

    def feed(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Add tokens; return the newly emittable text. After a stop string matched,
        `self.stopped` is True and later calls return ""."""
        if self.stopped:
            return ""
        new = self._detok.push(token_ids, final)
        if not new and not final:
            return ""
        search_from = max(0, len(self._text) - self._hold)
        self._text += new
        cut = self._find_stop(search_from)
        if cut is not None:
            self._text = self._text[:cut]
            self.stopped = True
            end = len(self._text)
        else:
            end = len(self._text) if final else max(self._emitted, len(self._text) - self._hold)
        out = self._text[self._emitted:end]
        self._emitted = end
        return out

    def _find_stop(self, start: int) -> int | None:
        hits = [i for s in self._stop if (i := self._text.find(s, start)) >= 0]
        return min(hits) if hits else None
