"""Chain hashes of a token sequence's full pages, bit-identical to the ranks' block pools,
computed without re-hashing pages the router has hashed before.

A page's chain hash is blake2b-64 of (its parent page's hash as 8 little-endian bytes,
or nothing for a first page) + (its tokens as little-endian int64): `page_hashes`, the
reference, equal to `phalanx.engine.block_pool.hash_pages`. One blake2b call costs about
0.5 µs in CPython, so hashing every page of a few-thousand-token prompt would dominate a
routing decision; most of a prompt, though, repeats pages seen before (a chat turn is the
previous turn plus a new message).

`PageHasher` remembers *runs*: consecutive pages of sequences it hashed, as their packed
tokens and chain hashes. To hash a prompt it packs the tokens once (`page_hash.pack`),
hashes the first page, and when that hash starts a remembered run it takes the following
hashes from the run for as many pages as the tokens are byte-equal (one `memcmp`), then
hashes the next page and looks again. Taking a hash from a run is exact, not a guess:
the chain hash of a page is a function of its parent's hash and its tokens, and both are
verified equal (the parent by hash, the tokens by bytes). So a prompt costs one blake2b
per page the hasher has not seen plus one per *jump* between runs, and a `memcmp`.

Runs follow the shape of the traffic: pages hashed right after a run's last page extend
that run (a chat's next turn grows its conversation's run, so the turn after jumps to it
once, not once per earlier turn), and a sequence that leaves a run in its middle cuts the
run there and seals the head against growing (a shared system prompt stays a run of its
own that every conversation reads to its end, without searching for where they part).
A chat turn thus costs about two jumps plus its new pages.

Layout: `_at` (a `page_hash.PageIndex`: a table of uint64 keys, no int object per page)
maps a chain hash to a run that holds that page; the run's index of the page is the
page's position in its sequence minus `run.start` (a chain hash fixes the position).
Hashes travel as `array('Q')` (a run's, and what `hashes` returns): a hash taken from a
run is 8 bytes copied, not an int object referenced. The walk looks runs up only until
the first page no run holds (every later chain hash is new).
Memory is bounded: runs are kept in least-recently-used order and the oldest dropped while
more than `budget` pages are remembered (the owner sets the budget, e.g. from its tree's
size); a dropped run's pages are simply hashed again next time. Dropping is O(1) for the
call that drops (the run is emptied at once, so it is found no more); its entries in `_at`
are deleted a bounded number at a time by the calls after it (`_reap`: as many as each
call remembers, plus `REAP_SPARE`), so that no request pays for a large run at once.

Cost per call: packing the tokens, then the walk: one blake2b per page hashed and a
`memcmp` per jump, all in C when `router/_page_hash.c` is built (`page_hash.pack` and
`walk`: ~0.8 ns a token and ~0.30 µs a page; in Python ~6.5 ns and ~0.6 µs plus the
loop's own calls); then remembering the fresh pages (runs keep their tokens in a
`bytearray` and their hashes in an array, so a run grows in place, not by copying it).
The walk only reads the runs; `_walk` applies what it reports (the runs used become the
most recent; one our tokens leave in its middle is cut there).
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections import OrderedDict, deque
from typing import Optional, Sequence

from .page_hash import PageIndex, pack, walk

REAP_SPARE = 64  # `_at` entries of dropped runs deleted per call beyond those it remembered
_ZERO = array("Q", [0])  # `_ZERO * n`: n hashes to fill

def page_hashes(tokens: Sequence[int], page_size: int,
                parent: Optional[int] = None) -> list[int]:
    """Chain hashes of the full pages of `tokens` (a partial last page is left out).

    Bit-identical to `phalanx.engine.block_pool.hash_pages` (blake2b-64 of the parent's
    8 little-endian bytes and the page's tokens as little-endian int64), without numpy.
    The reference implementation: hashes every page.
    """
    n = len(tokens) // page_size * page_size
    if n == 0:
        return []
    data = struct.pack(f"<{n}q", *tokens[:n])
    step = 8 * page_size
    blake, from_bytes = hashlib.blake2b, int.from_bytes
    prev = b"" if parent is None else parent.to_bytes(8, "little")
    out: list[int] = []
    for off in range(0, 8 * n, step):
        prev = blake(prev + data[off:off + step], digest_size=8).digest()
        out.append(from_bytes(prev, "little"))
    return out


class _Run:
    """Pages `start, start+1, ...` of one sequence: `data` their tokens packed as
    little-endian int64 (8 * page_size bytes a page, a `bytearray`: it grows and is cut
    in place, so no buffer of it may be held across calls), `hashes` their chain hashes
    (an array('Q'), likewise grown and cut in place).
    Grows at its end only (`PageHasher._extend`), until `sealed` (another sequence
    branched off at its end). A dropped run is emptied (no hashes, sealed): an `_at`
    entry still naming it finds nothing."""

    __slots__ = ("start", "data", "hashes", "sealed")

    def __init__(self, start: int, data: bytearray, hashes: array) -> None:
        self.start, self.data, self.hashes = start, data, hashes
        self.sealed = False


class PageHasher:
    """Chain hashes of full pages of `page_size` tokens, memoized over remembered runs
    (module docstring). Not thread-safe; one owner (a prefix tree) drives it."""

    def __init__(self, page_size: int, budget: int = 1 << 16) -> None:
        if not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        self.page_size = page_size
        self.budget = budget
        self._at = PageIndex()  # chain hash -> a run holding that page
        self._runs: OrderedDict[_Run, None] = OrderedDict()  # least recently used first
        self._pages = 0  # pages held by the runs in `_runs`
        # dropped runs whose `_at` entries are still to delete: [their hashes, run, done]
        self._dying: deque[list] = deque()
        self.hashed = 0  # blake2b calls so far (pages hashed, not taken from a run)
        self.reused = 0  # pages whose hash was taken from a run

    @property
    def remembered_pages(self) -> int:
        return self._pages

    def hashes(self, tokens: Sequence[int], *, parent: Optional[int] = None,
               first_page: int = 0, remember: bool = True) -> array:
        """Chain hashes of the full pages of `tokens`, an array('Q') equal item by item
        to `page_hashes(tokens, page_size, parent)`. `tokens` continue a sequence whose page
        `first_page - 1` has chain hash `parent` (defaults: a sequence's start). With
        `remember`, the pages are remembered for later calls."""
        ps = self.page_size
        n = len(tokens) // ps
        if n == 0:
            return array("Q")
        if parent is None and first_page:
            raise ValueError("first_page > 0 needs the parent page's hash")
        # the partial last page is packed too (no copy of `tokens`) and never read
        data = pack(tokens)
        out, fresh = self._walk(data, n, parent, first_page)
        if remember:
            self._remember(data, out, fresh, parent, first_page)
        return out

    def _walk(self, data: bytes, n: int, parent: Optional[int], first_page: int
              ) -> tuple[array, list[tuple[int, int]]]:
        """(hashes of the `n` pages packed in `data`, the ranges [a, b) of pages hashed
        that no run holds), through the remembered runs (`page_hash.walk`); the runs used
        become the most recent, and one our tokens leave in its middle is cut there."""
        out = _ZERO * n
        fresh, touched, reused = walk(data, n, 8 * self.page_size, parent, first_page,
                                      self._at, out)
        runs = self._runs
        for run, cut in touched:
            runs.move_to_end(run)
            if cut >= 0:
                self._split(run, cut)
        self.hashed += n - reused
        self.reused += reused
        return out, fresh

    def _remember(self, data: bytes, hashes: array, fresh: list[tuple[int, int]],
                  parent: Optional[int], first_page: int) -> None:
        """Remembers the fresh ranges of pages: each continues the run that ends at its
        parent page when there is one (a chat's next turn grows its conversation's run,
        so the turn after jumps once, not once per turn), else starts a run. Then drops
        runs past the budget and reaps as many dropped entries as pages remembered (+
        `REAP_SPARE`), so that the entries of dropped runs never pile up."""
        pb = 8 * self.page_size
        added = 0
        with memoryview(data) as view:
            for a, b in fresh:
                before = hashes[a - 1] if a else parent
                run = self._at.get(before) if before is not None else None
                if run is not None and not run.sealed and run.hashes[-1] == before \
                        and run.start + len(run.hashes) == first_page + a:
                    self._extend(run, view[a * pb:b * pb], hashes[a:b])
                else:
                    self._add(_Run(first_page + a, bytearray(view[a * pb:b * pb]),
                                   hashes[a:b]))
                added += b - a
        if self._pages > self.budget:
            self.trim(self.budget)
        if self._dying:
            self._reap(added + REAP_SPARE)

    def _split(self, run: _Run, j: int) -> None:
        """Cuts `run` before its page j (a sequence branched off there): the pages from j
        on become a run of their own, and `run`, sealed, grows no more, so that the
        sequences sharing it find the end of what they share without a search."""
        pb = 8 * self.page_size
        tail = _Run(run.start + j, run.data[j * pb:], run.hashes[j:])
        del run.data[j * pb:]
        del run.hashes[j:]
        run.sealed = True
        self._at.set_range(tail.hashes, 0, len(tail.hashes), tail)
        self._runs[tail] = None

    def _extend(self, run: _Run, data: memoryview, hashes: array) -> None:
        """Appends pages to `run` (they follow its last page in one sequence)."""
        run.data += data
        run.hashes += hashes
        self._at.set_range(hashes, 0, len(hashes), run)
        self._runs.move_to_end(run)
        self._pages += len(hashes)

    def _add(self, run: _Run) -> None:
        self._at.set_range(run.hashes, 0, len(run.hashes), run)
        self._runs[run] = None
        self._pages += len(run.hashes)

    def trim(self, budget: int) -> None:
        """Forgets the least recently used runs while more than `budget` pages are
        remembered (the most recent run is always kept). A forgotten run is emptied at
        once (found no more); its `_at` entries go later, a few per call (`_reap`)."""
        runs = self._runs
        while self._pages > budget and len(runs) > 1:
            run, _ = runs.popitem(last=False)
            self._pages -= len(run.hashes)
            self._dying.append([run.hashes, run, 0])
            run.hashes, run.data, run.sealed = array("Q"), bytearray(), True

    def _reap(self, limit: int) -> None:
        """Deletes up to `limit` `_at` entries of dropped runs, oldest run first (only
        entries that still name the dropped run: a later run may have taken a page)."""
        at, dying = self._at, self._dying
        while dying and limit > 0:
            entry = dying[0]
            hs, run, done = entry
            stop = min(len(hs), done + limit)
            at.unindex(hs, done, stop, run)
            limit -= stop - done
            if stop < len(hs):
                entry[2] = stop
            else:
                dying.popleft()

    @property
    def dropped_pages(self) -> int:
        """Pages of dropped runs whose `_at` entries are not deleted yet."""
        return sum(len(hs) - done for hs, _, done in self._dying)

    def clear(self) -> None:
        self._at.clear()
        self._runs.clear()
        self._dying.clear()
        self._pages = 0


__all__ = ["PageHasher", "page_hashes"]
