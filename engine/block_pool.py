"""Page pool of one rank's paged KV cache, with prefix caching.

A page holds `page_size` consecutive tokens of one sequence (K and V, every layer).
A full page is identified by a chain hash: hash(parent page's hash, its token ids), so
equal hashes mean equal token prefixes and therefore equal KV.

Invariants (checked by `check_integrity`):
- every page is either referenced (ref_count > 0) or in the free list, never both;
- the free list is in eviction order: unhashed pages first, then cached pages from least
  to most recently released;
- `cached[h] == p` exactly when `page_hash[p] == h`; a hash names at most one page.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from typing import Iterable, Optional, Sequence

import numpy as np


class PoolExhausted(RuntimeError):
    """Not enough free pages for an allocation."""


def salt_root(salt: Optional[str]) -> Optional[int]:
    """The parent of a salted sequence's first page (None: unsalted). Pages of requests
    with different salts never share a chain hash, so they never share cached KV (vLLM's
    `cache_salt`: a tenant cannot probe another's prompts by their prefix-cache hits)."""
    if salt is None:
        return None
    h = hashlib.blake2b(b"phalanx-cache-salt\0" + salt.encode("utf-8"), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def hash_pages(tokens: Sequence[int], page_size: int, parent: Optional[int]) -> list[int]:
    """Chain hashes of the full pages of `tokens`, continuing from `parent` (a sequence
    starts from its `salt_root`).

    Stable across processes (unlike `hash()`), so ranks and the router agree.
    """
    out: list[int] = []
    arr = np.asarray(tokens, dtype=np.int64)
    for start in range(0, len(arr) - page_size + 1, page_size):
        h = hashlib.blake2b(digest_size=8)
        h.update(b"" if parent is None else parent.to_bytes(8, "little"))
        h.update(arr[start:start + page_size].tobytes())
        parent = int.from_bytes(h.digest(), "little")
        out.append(parent)
    return out


EVICTION_LOG = 1 << 16  # evicted hashes remembered for incremental reports to a router


class BlockPool:
    """Reference-counted pages, a hash -> page index, and an LRU free list. Evictions of
    cached pages are numbered (`evictions`) and the last `EVICTION_LOG` of them kept, so
    a router can ask what left the cache since its last look (`evicted_since`)."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self.page_hash: list[Optional[int]] = [None] * num_pages
        self.cached: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages))
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0  # cached pages evicted so far; the log's sequence number
        # (eviction number, hash) of the latest evictions, oldest first
        self._evicted: deque[tuple[int, int]] = deque(maxlen=EVICTION_LOG)

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_pages

    def match_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Pages of the longest cached chain that starts `hashes`; takes no reference."""
        pages: list[int] = []
        if self.enable_prefix_caching:
            for h in hashes:
                p = self.cached.get(h)
                if p is None:
                    break
                pages.append(p)
        return pages

    def num_free_after_acquire(self, pages: Iterable[int]) -> int:
        return len(self._free) - sum(1 for p in pages if self.ref_counts[p] == 0)

    def acquire(self, pages: Iterable[int]) -> None:
        """Take a reference on (cached) pages, pulling idle ones out of the free list."""
        for p in pages:
            if self.ref_counts[p] == 0:
                del self._free[p]
            self.ref_counts[p] += 1

    def allocate(self, n: int) -> list[int]:
        """`n` fresh pages, evicting the least recently used cached pages if needed, in
        ascending order: pages freed together come back as runs of consecutive pages
        (cached pages are freed tail first), which the KV transport moves in place."""
        if n > len(self._free):
            raise PoolExhausted(f"need {n} pages, {len(self._free)} free of {self.num_pages}")
        pages = []
        for _ in range(n):
            p, _ = self._free.popitem(last=False)
            h = self.page_hash[p]
            if h is not None:
                del self.cached[h]
                self.page_hash[p] = None
                self.evictions += 1
                self._evicted.append((self.evictions, h))
            self.ref_counts[p] = 1
            pages.append(p)
        pages.sort()
        return pages

    def register(self, page: int, h: int) -> None:
        """Publish a full, written page under its chain hash (first writer wins)."""
        if not self.enable_prefix_caching or self.page_hash[page] is not None or h in self.cached:
            return
        self.cached[h] = page
        self.page_hash[page] = h

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference per page. Tail pages go first so they are evicted first."""
        for p in reversed(pages):
            if self.ref_counts[p] <= 0:
                raise RuntimeError(f"page {p} released more often than acquired")
            self.ref_counts[p] -= 1
            if self.ref_counts[p] == 0:
                self._free[p] = None
                if self.page_hash[p] is None:
                    self._free.move_to_end(p, last=False)

    def forget_cached(self) -> None:
        """With no page in use: drop every cached page and the counters (the warm-up's
        requests leave nothing a router or an operator would see)."""
        if any(self.ref_counts):
            raise RuntimeError("forget_cached with pages in use")
        self.page_hash = [None] * self.num_pages
        self.cached.clear()
        self._free = OrderedDict((p, None) for p in range(self.num_pages))
        self.query_tokens = self.hit_tokens = self.evictions = 0
        self._evicted.clear()

    def record_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    def held_hashes(self) -> list[int]:
        """Chain hashes of every page the pool holds (in use or cached, not yet evicted):
        what the router's prefix tree is reconciled with. Safe to call from a thread other
        than the owner's (a copy taken while the owner mutates the index is retried)."""
        for _ in range(8):
            try:
                return list(self.cached)
            except RuntimeError:  # "dictionary changed size during iteration"
                continue
        return []

    def evicted_since(self, since: int) -> tuple[int, Optional[list[int]]]:
        """(n, hashes of evictions since+1..n that are not cached again): what left the
        cache after a reader's last look at eviction `since`; (n, None) when the log no
        longer reaches back to `since` (or `since` is from another pool). Safe from another
        thread, like `held_hashes`."""
        for _ in range(8):
            try:
                log = list(self._evicted)
                break
            except RuntimeError:  # "deque mutated during iteration"
                continue
        else:
            return self.evictions, None
        if not log:
            return (since, []) if 0 <= since <= self.evictions else (self.evictions, None)
        first, last = log[0][0], log[-1][0]
        if since < first - 1 or since > last:
            return last, None
        cached = self.cached
        return last, [h for n, h in log[since - first + 1:] if h not in cached]

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant in the module docstring is broken."""
        for p, rc in enumerate(self.ref_counts):
            assert rc >= 0, f"page {p}: negative ref count {rc}"
            assert (rc == 0) == (p in self._free), f"page {p}: ref {rc} vs free-list membership"
        assert len(self._free) == sum(rc == 0 for rc in self.ref_counts)
        for h, p in self.cached.items():
            assert self.page_hash[p] == h, f"cached hash {h:#x} -> page {p} whose hash differs"
        assert sum(h is not None for h in self.page_hash) == len(self.cached), "stale page hash"
        seen_cached = False
        for p in self._free:
            if self.page_hash[p] is not None:
                seen_cached = True
            else:
                assert not seen_cached, f"unhashed free page {p} behind cached pages"
