"""Bad words as the token sequences the sampler bans (vLLM's `bad_words` semantics).

A word is banned where it starts the text and where it follows a space: each word is
tokenized without its leading spaces, and once more with a single leading space when
that spelling is a different word token of the same length (a tokenizer that marks
word starts, as byte-level BPE does, spells " word" with other ids than "word"). The
sampler removes a sequence's last token wherever the output ends with the rest of it.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["bad_words_token_ids", "MAX_BAD_WORDS"]

MAX_BAD_WORDS = 64  # words per request


def bad_words_token_ids(tokenizer: Any, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The sequences to ban for `words` (ValueError for more than `MAX_BAD_WORDS`, or a
    word that is empty or only spaces)."""
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words: at most {MAX_BAD_WORDS} words, got {len(words)}")
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = word.lstrip()
        if not bare:
            raise ValueError(f"bad_words: a word must have text, got {word!r}")
        plain = tuple(tokenizer.encode(bare, add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + bare, add_special_tokens=False))
        out.append(plain)
        if len(spaced) == len(plain) and spaced[0] != plain[0]:
            out.append(spaced)
    return tuple(out)
