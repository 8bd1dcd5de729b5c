"""Resharding planner: which slabs of a request's KV go from which prefill rank to which
decode rank, as a list of `Copy` records.

The request's KV lives on a prefill instance (layout `src`; the same page ids on every
prefill TP rank, since the leader's block table is shared) and moves to one decode DP rank
(layout `dst`, its own page ids). For every (layer, kind, global head h, token t) that a
decode TP rank needs (`dst.heads_of(rank)`), the plan writes that slot exactly once, read
from one prefill holder of h; nothing else is written. Token t sits in
`src_pages[t // src.page_size]` at offset `t % src.page_size` on the prefill side and in
`dst_pages[t // dst.page_size]` at offset `t % dst.page_size` on the decode side.

Since pages are HND (`[heads, page_size, head_dim]`), a Copy — a run of heads contiguous
on both ranks times a run of tokens within one page on both sides — moves one strided
block: `num_heads` slabs of `num_tokens * head_dim` contiguous elements each.

Pure logic: no torch, no I/O.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Optional

from .layout import KVLayout

KINDS = ("k", "v")


@dataclass(frozen=True, slots=True)
class Copy:
    """Copy heads `[src_head, src_head+num_heads)` (local to src_rank) of tokens
    `[src_offset, src_offset+num_tokens)` of page `src_page` of the `kind` pool of `layer`
    into local heads `[dst_head, ...)`, offsets `[dst_offset, ...)` of page `dst_page` on
    dst_rank. Both runs lie inside one page on each side."""

    src_rank: int
    dst_rank: int
    layer: int
    kind: str  # 'k' or 'v'
    src_head: int
    dst_head: int
    num_heads: int
    src_page: int
    src_offset: int
    dst_page: int
    dst_offset: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class ReshardPlan:
    """The copies that move one request's KV (or a chunk of it) from `src` to `dst`.
    Copies are ordered layer-major, then kind, so a per-layer stream can slice them."""

    src: KVLayout
    dst: KVLayout
    copies: tuple[Copy, ...]

    @property
    def num_copies(self) -> int:
        return len(self.copies)

    def __len__(self) -> int:
        return len(self.copies)

    def __iter__(self) -> Iterator[Copy]:
        return iter(self.copies)

    def copy_bytes(self, c: Copy) -> int:
        """Bytes moved by one copy."""
        return c.num_heads * c.num_tokens * self.src.head_dim * self.src.dtype_bytes

    def total_bytes(self) -> int:
        return sum(self.copy_bytes(c) for c in self.copies)

    def bytes_by_pair(self) -> dict[tuple[int, int], int]:
        """Bytes moved per (src_rank, dst_rank) pair, over every copy in the plan."""
        out: dict[tuple[int, int], int] = defaultdict(int)
        for c in self.copies:
            out[(c.src_rank, c.dst_rank)] += self.copy_bytes(c)
        return dict(out)

    def for_layer(self, layer: int) -> "ReshardPlan":
        """The sub-plan of one layer (both kinds)."""
        return ReshardPlan(self.src, self.dst, tuple(c for c in self.copies if c.layer == layer))


# (src_rank, dst_rank, src_head, dst_head, num_heads): heads local to each rank.
_HeadRun = tuple[int, int, int, int, int]
# (src_page, src_offset, dst_page, dst_offset, num_tokens)
_TokenRun = tuple[int, int, int, int, int]


def _check_compatible(src: KVLayout, dst: KVLayout) -> None:
    for name in ("num_kv_heads", "head_dim", "num_layers", "dtype_bytes"):
        a, b = getattr(src, name), getattr(dst, name)
        if a != b:
            raise ValueError(f"src and dst layouts disagree on {name}: {a} != {b}")


def _check_pages(side: str, pages: Sequence[int], layout: KVLayout, end: int) -> None:
    """The first pages covering tokens [0, end) must exist and be distinct ids >= 0."""
    need = layout.pages_for(end)
    if len(pages) < need:
        raise ValueError(f"{side}_pages has {len(pages)} pages, {end} tokens need {need} "
                         f"of {layout.page_size} tokens")
    used = pages[:need]
    if any(p < 0 for p in used) or len(set(used)) != need:
        raise ValueError(f"{side}_pages must be distinct non-negative ids: {list(used)}")


def check_request(src: KVLayout, dst: KVLayout, token_range: range, src_pages: Sequence[int],
                   dst_pages: Sequence[int], layers: Optional[range]) -> range:
    """Validate a planning request (ValueError naming what is wrong); the layers to plan."""
    _check_compatible(src, dst)
    if token_range.step != 1 or token_range.start < 0:
        raise ValueError(f"token_range must be a non-negative range of step 1: {token_range}")
    layers = range(src.num_layers) if layers is None else layers
    if len(layers) and (min(layers) < 0 or max(layers) >= src.num_layers):
        raise ValueError(f"layers {layers} outside [0, {src.num_layers})")
    if len(token_range):
        _check_pages("src", src_pages, src, token_range.stop)
        _check_pages("dst", dst_pages, dst, token_range.stop)
    return layers


def _choose_holder(src: KVLayout, head: int, dst_rank: int, replica_hint: int) -> int:
    """Deterministic prefill holder of `head` for `dst_rank`: spreads the reads of
    different decode ranks (and of different `replica_hint`s, e.g. DP ranks) over replicas."""
    holders = src.holders(head)
    return holders[(dst_rank + replica_hint) % len(holders)]


def head_runs_of(src: KVLayout, dst: KVLayout, replica_hint: int) -> list[_HeadRun]:
    """Maximal runs of heads that one dst rank reads from one src rank, contiguous on both."""
    runs: list[_HeadRun] = []
    for dst_rank in range(dst.tp):
        heads = dst.heads_of(dst_rank)
        cur: Optional[list[int]] = None  # [src_rank, dst_rank, src_head, dst_head, n]
        for h in heads:
            s_rank = _choose_holder(src, h, dst_rank, replica_hint)
            s_local = src.local_head_index(s_rank, h)
            if cur and cur[0] == s_rank and cur[2] + cur[4] == s_local:
                cur[4] += 1
                continue
            if cur:
                runs.append(tuple(cur))
            cur = [s_rank, dst_rank, s_local, h - heads.start, 1]
        if cur:
            runs.append(tuple(cur))
    return runs


def token_runs_of(src: KVLayout, dst: KVLayout, tokens: range,
                src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[_TokenRun]:
    """Split `tokens` at both sides' page boundaries; each run lies in one page per side."""
    runs: list[_TokenRun] = []
    ps_s, ps_d = src.page_size, dst.page_size
    t = tokens.start
    while t < tokens.stop:
        off_s, off_d = t % ps_s, t % ps_d
        n = min(tokens.stop - t, ps_s - off_s, ps_d - off_d)
        runs.append((src_pages[t // ps_s], off_s, dst_pages[t // ps_d], off_d, n))
        t += n
    return runs


def plan_tokens(src: KVLayout, dst: KVLayout, token_range: range,
                src_pages: Sequence[int], dst_pages: Sequence[int],
                layers: Optional[range] = None, *, replica_hint: int = 0) -> ReshardPlan:
    """Plan the copies of the tokens in `token_range` (a chunk streamed by prefill).

    `layers` defaults to every layer. `replica_hint` (e.g. the decode DP rank) shifts which
    replica is read when prefill heads are replicated; any value gives a valid plan.
    Raises ValueError on incompatible layouts, a bad range, or too few/duplicate pages.
    """
    layers = check_request(src, dst, token_range, src_pages, dst_pages, layers)
    if len(token_range) == 0:
        return ReshardPlan(src, dst, ())
    head_runs = head_runs_of(src, dst, replica_hint)
    token_runs = token_runs_of(src, dst, token_range, src_pages, dst_pages)
    # The layer-independent template, repeated per (layer, kind).
    copies = tuple(
        Copy(sr, dr, layer, kind, sh, dh, nh, sp, so, dp, do, nt)
        for layer in layers
        for kind in KINDS
        for (sr, dr, sh, dh, nh) in head_runs
        for (sp, so, dp, do, nt) in token_runs
    )
    return ReshardPlan(src, dst, copies)


def plan_request(src: KVLayout, dst: KVLayout, num_tokens: int,
                 src_pages: Sequence[int], dst_pages: Sequence[int],
                 layers: Optional[range] = None, *, replica_hint: int = 0) -> ReshardPlan:
    """Plan the copies of a whole request of `num_tokens` tokens: `plan_tokens` over
    `range(num_tokens)`."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return plan_tokens(src, dst, range(num_tokens), src_pages, dst_pages, layers,
                       replica_hint=replica_hint)
