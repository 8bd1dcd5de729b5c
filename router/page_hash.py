"""The per-token loops of page hashing: packing tokens, and chaining page hashes.

`pack(tokens)` is the tokens as little-endian int64 bytes. `chain(data, first, stop,
page_bytes, parent, stop_at)` is the chain hashes of pages `first .. stop - 1` of packed
`data` (page p is bytes `[p * page_bytes, (p + 1) * page_bytes)`), the first chained to
`parent` (None for a sequence's first page), ending early after the first hash that is a
key of the dict `stop_at` (that hash included). A page's chain hash is blake2b-64 of its
parent's hash as 8 little-endian bytes and the page's bytes (`page_hasher.page_hashes`).

Both come from the C module `_page_hash` (`router/_page_hash.c`, built by `pip install`)
when it is there: it reads a Python int in ~1 ns where `struct` takes ~6, and hashes a
page in ~0.35 µs where a hashlib object takes ~0.6 plus the loop's own calls. Without it
(a source tree used without installing it) the Python versions below give the same bytes
and hashes; `NATIVE` says which is in use.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Optional, Sequence

_BLAKE8 = hashlib.blake2b(digest_size=8)  # copied per page: cheaper than a new object


def pack_py(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}q", *tokens)


def chain_py(data: bytes, first: int, stop: int, page_bytes: int, parent: Optional[int],
             stop_at: Optional[dict]) -> list[int]:
    if page_bytes <= 0 or first < 0 or stop < first or stop * page_bytes > len(data):
        raise ValueError("pages out of the data's range")
    new, from_bytes = _BLAKE8.copy, int.from_bytes
    prev = b"" if parent is None else parent.to_bytes(8, "little")
    out: list[int] = []
    for off in range(first * page_bytes, stop * page_bytes, page_bytes):
        b = new()
        b.update(prev)
        b.update(data[off:off + page_bytes])
        prev = b.digest()
        h = from_bytes(prev, "little")
        out.append(h)
        if stop_at is not None and h in stop_at:
            break
    return out


try:
    from ._page_hash import chain, pack
    NATIVE = True
except ImportError:  # not built: the same results, slower
    pack, chain = pack_py, chain_py
    NATIVE = False

__all__ = ["NATIVE", "chain", "chain_py", "pack", "pack_py"]
