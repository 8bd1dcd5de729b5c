"""`SlabSpans`: which runs of a copy template are one piece of a pool (moved in place).

The oracle is `messages.copy_rows`: the pool elements of every slot of a run of rows, in
payload order; a run is a span exactly when those elements are consecutive."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.kv_transfer.planning import messages as m
from phalanx.kv_transfer.planning.copy_table import plan_tables
from phalanx.kv_transfer.planning.layout import KVLayout
from phalanx.kv_transfer.planning.spans import SlabSpans

HEAD_DIM = 4


def _elements(table: np.ndarray, side: str, heads: int, page_size: int) -> np.ndarray:
    """Pool elements of every slot of `table`, in payload order (the oracle)."""
    rows = m.copy_rows(table, side, heads, page_size)
    return (rows[:, None] * HEAD_DIM + np.arange(HEAD_DIM)).ravel()


@st.composite
def _tables(draw):
    """A (layer 0, K) template between random layouts and pages: runs, shuffles, or runs
    with holes, and the side whose spans are asked for."""
    kv = draw(st.sampled_from([1, 2, 4, 8]))
    tps = [t for t in (1, 2, 4) if kv % t == 0 or t % kv == 0]
    src = KVLayout(draw(st.sampled_from(tps)), kv, draw(st.sampled_from([4, 8, 16])), HEAD_DIM, 1, 2)
    dst = KVLayout(draw(st.sampled_from(tps)), kv, draw(st.sampled_from([4, 8, 16])), HEAD_DIM, 1, 2)
    tokens = draw(st.integers(1, 200))
    start = draw(st.integers(0, tokens - 1)) if draw(st.booleans()) else 0

    def pages(layout: KVLayout) -> list[int]:
        need = layout.pages_for(tokens)
        order = draw(st.sampled_from(["runs", "shuffled", "holes"]))
        if order == "runs":
            return list(range(3, 3 + need))
        if order == "holes":
            return sorted(draw(st.permutations(range(need + 4)))[:need])
        return draw(st.permutations(range(need)))

    tables = plan_tables(src, dst, range(start, tokens), pages(src), pages(dst))
    (s, d), table = draw(st.sampled_from(sorted(tables.items(), key=lambda kv: kv[0])))
    table = table[(table[:, m.F_LAYER] == 0) & (table[:, m.F_KIND] == 0)]
    side = draw(st.sampled_from(["src", "dst"]))
    layout, rank = (src, s) if side == "src" else (dst, d)
    return table, side, len(layout.heads_of(rank)), layout.page_size


@settings(max_examples=300, deadline=None)
@given(_tables(), st.data())
def test_span_is_exactly_a_consecutive_run_of_elements(case, data):
    """For random row ranges: `span` returns [start, stop) iff the rows' slots, in payload
    order, are exactly those consecutive pool elements; `split` cuts a range into pieces
    that cover it in order, in-place pieces being spans of at least the minimum size."""
    table, side, heads, page_size = case
    spans = SlabSpans(table, side, heads, page_size, HEAD_DIM)
    n = len(table)
    for _ in range(5):
        r0 = data.draw(st.integers(0, n - 1))
        r1 = data.draw(st.integers(r0 + 1, n))
        elems = _elements(table[r0:r1], side, heads, page_size)
        consecutive = bool((np.diff(elems) == 1).all())
        got = spans.span(r0, r1)
        assert (got is not None) == consecutive
        if got is not None:
            assert got == (int(elems[0]), int(elems[-1]) + 1)
        least = data.draw(st.integers(1, 4 * HEAD_DIM * page_size))
        pieces = spans.split(r0, r1, least)
        assert [p[0] for p in pieces] == [r0] + [p[1] for p in pieces[:-1]]
        assert pieces[-1][1] == r1
        for a, b, in_place in pieces:
            if in_place:
                lo, hi = spans.span(a, b)
                assert hi - lo >= least


def test_whole_pages_of_consecutive_pages_are_one_span():
    """The engine's usual case: every head on one side, consecutive pages, a partial last
    page. Its whole pages are one span, the last page one span per head."""
    layout = KVLayout(1, 4, 16, HEAD_DIM, 1, 2)
    (table,) = plan_tables(layout, layout, range(45), [5, 6, 7], [9, 10, 11]).values()
    table = table[(table[:, m.F_LAYER] == 0) & (table[:, m.F_KIND] == 0)]
    spans = SlabSpans(table, "dst", 4, 16, HEAD_DIM)
    page = 4 * 16 * HEAD_DIM
    assert spans.span(0, 2) == (9 * page, 11 * page)
    assert spans.span(0, 3) is None and spans.span(2, 3) is None  # 4 heads x 13 tokens
    assert spans.split(0, 3, page) == [(0, 2, True), (2, 3, False)]
    assert spans.split(0, 3, 3 * page) == [(0, 3, False)]


def test_direct_spans_land_whole_slots_inside_the_pools_or_are_refused():
    """`direct_spans` (where a direct message's blocks land, from their layer, kind,
    start and size alone) gives each block's elements in its (layer, kind) pool; a
    block outside the pool, the message's layers or whole token slots, or counts that
    disagree, is refused naming the block."""
    from phalanx.kv_transfer.planning.spans import direct_spans
    pool, esize = 10 * 2 * 4 * HEAD_DIM, 2  # 10 pages x 2 heads x page 4, 2-byte elements
    blocks = np.array([[1, 0, 0, 5], [1, 1, 0, 5], [2, 0, 7, 9]], dtype=np.int32)
    starts = np.array([0, 16, pool - 8], dtype="<i8")
    sizes = [5 * HEAD_DIM * esize, 2 * HEAD_DIM * esize, 2 * HEAD_DIM * esize]

    def spans(b=blocks, s=starts, z=sizes, layers=range(1, 3)):
        return direct_spans(b, s.tobytes(), z, layers, 3, pool, HEAD_DIM, esize)

    assert spans() == [(1, 0, (0, 20)), (1, 1, (16, 24)), (2, 0, (pool - 8, pool))]
    bad_kind = blocks.copy()
    bad_kind[0, 1] = 2
    for case, kwargs in [("past the pool", dict(s=starts + np.array([0, 0, 4]))),
                         ("not a slot start", dict(s=starts + np.array([1, 0, 0]))),
                         ("part of a slot", dict(z=[sizes[0] - 2, *sizes[1:]])),
                         ("negative start", dict(s=starts - np.array([1, 0, 0]) * HEAD_DIM)),
                         ("kind", dict(b=bad_kind)),
                         ("outside the message's layers", dict(layers=range(1, 2)))]:
        try:
            spans(**kwargs)
        except ValueError as e:
            assert "direct block" in str(e), case
        else:
            raise AssertionError(f"{case}: accepted")
    try:
        spans(z=sizes[:2])
    except ValueError as e:
        assert "3 blocks, 3 starts and 2 sizes" in str(e)
    else:
        raise AssertionError("count mismatch accepted")
