"""The per-token loops of page hashing: packing tokens, chaining page hashes, and the
walk of `PageHasher` through remembered runs.

`pack(tokens)` is the tokens as little-endian int64 bytes. `chain(data, first, stop,
page_bytes, parent, stop_at)` is the chain hashes of pages `first .. stop - 1` of packed
`data` (page p is bytes `[p * page_bytes, (p + 1) * page_bytes)`), the first chained to
`parent` (None for a sequence's first page), ending early after the first hash that is a
key of the dict `stop_at` (that hash included). A page's chain hash is blake2b-64 of its
parent's hash as 8 little-endian bytes and the page's bytes (`page_hasher.page_hashes`).

`walk(data, n, page_bytes, parent, first_page, at, out)` is `PageHasher`'s walk: the
hashes of the n pages of `data`, written into the array('Q') `out`, through the runs it
remembers (the contract: `walk_py`). Hashes travel as array('Q'), not lists of ints: a
hash taken from a run is 8 bytes copied, not an int object referenced.

`PageIndex()` is the map from a page's chain hash to the run holding it that `walk`
reads (`get`, `set_range`, `unindex`, `clear`, `len`): a table of uint64 keys, no int
object or dict entry per page.

All four come from the C module `_page_hash` (`router/_page_hash.c`, built by `pip
install`) when it is there: it reads a Python int in ~1 ns where `struct` takes ~6, and
hashes a page in ~0.30 µs where a hashlib object takes ~0.6 plus the loop's own calls.
Without it (a source tree used without installing it) the Python versions below give the
same bytes and hashes; `NATIVE` says which is in use.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from itertools import repeat
from typing import Any, Optional, Sequence

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


Range = tuple[int, int]


def walk_py(data: bytes, n: int, page_bytes: int, parent: Optional[int], first_page: int,
            at: Any, out: array) -> tuple[list[Range], list[tuple[Any, int]], int]:
    """Writes the chain hashes of the `n` pages of `data` (its page 0 is page `first_page`
    of a sequence whose previous page has hash `parent`) into `out` (an array('Q') of at
    least n items), taking hashes from remembered runs.

    `at` (a `PageIndex`) maps a chain hash to a run that holds that page: an object with
    `start` (the sequence position of its first page), `hashes` (its pages' hashes, an
    array('Q')) and `data` (their tokens packed, a bytearray). Pages are hashed until one
    is a page of the run `at` names for it, at the same position; the run's following
    hashes are then taken for as long as its tokens equal ours (the same parent and the
    same tokens give the same hash, so this is exact), and hashing resumes after them. Runs are looked up
    only until the first hashed page that no run holds: every later page chains to a hash
    never seen (a run holding one would hold its parent too), so the rest is hashed
    without lookups. A run whose parent run was dropped is then not found: more hashing,
    never a wrong hash.

    Returns (fresh, touched, reused): `fresh` the ranges [a, b) of pages hashed that no
    run holds; `touched` a (run, cut) per run used, in order, with cut = the run's page
    where our tokens differ from its (it should be cut there) or -1; `reused` the number
    of hashes taken from runs. The runs are only read."""
    fresh: list[Range] = []
    touched: list[tuple[Any, int]] = []
    prev, k, reused, lookup = parent, 0, 0, True
    while k < n:
        a, run = k, None  # hash pages until one is a remembered run's page
        while k < n and lookup:
            prev = out[k] = chain_py(data, k, k + 1, page_bytes, prev, None)[0]
            k += 1
            run = at.get(prev)
            i = first_page + k - 1 - run.start if run is not None else -1
            if run is not None and 0 <= i < len(run.hashes) and run.hashes[i] == prev:
                break
            run, lookup = None, False
        if run is None:
            if k < n:
                out[k:n] = array("Q", chain_py(data, k, n, page_bytes, prev, None))
            fresh.append((a, n))
            break
        if a < k - 1:
            fresh.append((a, k - 1))
        hs = run.hashes
        limit = min(n - k, len(hs) - i - 1)
        m = _equal_pages(data, k, run.data, i + 1, page_bytes, limit) if limit > 0 else 0
        touched.append((run, i + 1 + m if m < limit else -1))
        if m:
            out[k:k + m] = hs[i + 1:i + 1 + m]
            k += m
            reused += m
            prev = out[k - 1]
    return fresh, touched, reused


def _equal_pages(data: bytes, k: int, rdata: bytearray, j: int, pb: int, limit: int) -> int:
    """How many pages (at most `limit`) from page k of `data` equal those from page j of
    `rdata`: one `memcmp` when all do, else a binary search. The view of `rdata` is
    released before returning (the run may be cut or grown next)."""
    with memoryview(rdata) as view:
        if data.startswith(view[j * pb:(j + limit) * pb], k * pb):
            return limit
        lo, hi = 0, limit - 1  # lo pages are known equal, more than hi are known not to be
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if data.startswith(view[j * pb:(j + mid) * pb], k * pb):
                lo = mid
            else:
                hi = mid - 1
        return lo


class PageIndexPy:
    """Chain hash -> run over a dict: `PageIndex` (router/page_index.c) in Python."""

    __slots__ = ("_runs",)

    def __init__(self) -> None:
        self._runs: dict[int, Any] = {}

    def get(self, h: int, default: Any = None) -> Any:
        return self._runs.get(h, default)

    def set_range(self, hashes: array, start: int, stop: int, run: Any) -> None:
        """Maps each of `hashes[start:stop]` to `run`."""
        _check_range(hashes, start, stop)
        self._runs.update(zip(hashes[start:stop], repeat(run)))

    def unindex(self, hashes: array, start: int, stop: int, run: Any) -> int:
        """Unmaps each of `hashes[start:stop]` that maps to `run` (by identity); returns
        how many it unmapped."""
        _check_range(hashes, start, stop)
        runs = self._runs
        gone = [h for h in hashes[start:stop] if runs.get(h) is run]
        for h in gone:
            del runs[h]
        return len(gone)

    def clear(self) -> None:
        self._runs.clear()

    def __len__(self) -> int:
        return len(self._runs)


def _check_range(hashes: array, start: int, stop: int) -> None:
    if not (isinstance(hashes, array) and hashes.typecode == "Q"):
        raise TypeError("hashes must be an array('Q')")
    if start < 0 or stop < start or stop > len(hashes):
        raise ValueError("entries out of the hashes' range")


try:
    from ._page_hash import PageIndex, chain, pack, walk
    NATIVE = True
except ImportError:  # not built: the same results, slower
    pack, chain, walk, PageIndex = pack_py, chain_py, walk_py, PageIndexPy  # type: ignore[misc]
    NATIVE = False

__all__ = ["NATIVE", "PageIndex", "PageIndexPy", "chain", "chain_py", "pack", "pack_py",
           "walk", "walk_py"]
