"""Token ids as prompt text, for the HTTP routing bench (`bench/router_http.py`).

An HTTP gateway such as SMG matches prompts by characters, the phalanx proxy and the
simulated workers by token pages; so a token is written as a fixed-width word
(`WIDTH` digits and a space). Invariant: a character prefix of an encoded prompt that
ends on a word boundary is exactly the encoding of a token prefix, so a gateway's
character match and a worker's token match measure the same shared prefix.
"""

from __future__ import annotations

from typing import Sequence

WIDTH = 5  # digits per token: ids below 10**WIDTH
CHARS_PER_TOKEN = WIDTH + 1


def encode(tokens: Sequence[int]) -> str:
    """`tokens` as text: each id zero-padded to `WIDTH` digits, followed by a space."""
    return "".join(f"{t:0{WIDTH}d} " for t in tokens)


def decode(text: str) -> list[int]:
    """The token ids of `encode`'s text (ValueError on anything else)."""
    if len(text) % CHARS_PER_TOKEN:
        raise ValueError(f"prompt text of {len(text)} chars is not whole tokens of "
                         f"{CHARS_PER_TOKEN} chars")
    return [int(text[i:i + WIDTH]) for i in range(0, len(text), CHARS_PER_TOKEN)]


__all__ = ["CHARS_PER_TOKEN", "WIDTH", "decode", "encode"]
