"""`packed_table`: copy tables packed for control messages (pure logic, milliseconds)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.kv_transfer.planning import messages as m
from phalanx.kv_transfer.planning.copy_table import plan_batches
from phalanx.kv_transfer.planning.layout import KVLayout
from phalanx.kv_transfer.planning.packed_table import RAW, RLE, pack_table, unpack_table

WIDTH = len(m.COPY_FIELDS)
I32 = st.integers(np.iinfo(np.int32).min, np.iinfo(np.int32).max)


@st.composite
def tables(draw):
    """Tables mixing columns of constant-step runs (as plans have) and arbitrary values."""
    rows = draw(st.integers(1, 60))
    columns = []
    for _ in range(WIDTH):
        if draw(st.booleans()):
            columns.append(draw(st.lists(I32, min_size=rows, max_size=rows)))
        else:
            start, step = draw(st.integers(-1000, 1000)), draw(st.integers(-3, 3))
            columns.append([start + step * i for i in range(rows)])
    return np.array(columns, dtype=np.int64).T.astype(np.int32)


@settings(max_examples=300, deadline=None)
@given(tables())
def test_round_trip_and_never_larger_than_raw(table):
    packed = pack_table(table)
    assert len(packed) <= 1 + table.nbytes
    out = unpack_table(packed, WIDTH, 64)
    assert out.dtype == np.dtype("<i4") and np.array_equal(out, table)


def test_a_long_request_with_consecutive_pages_packs_to_a_few_hundred_bytes():
    layout = KVLayout(1, 4, 16, 128, 2, 2)
    pages = list(range(3, 3 + 2048))
    ((template, _),) = plan_batches(layout, layout, range(32768 - 5), pages, pages)[(0, 0)]
    packed = pack_table(template)
    assert packed[:1] == RLE and len(packed) < 400 < template.nbytes // 100
    assert np.array_equal(unpack_table(packed, WIDTH, m.MAX_TEMPLATE_ROWS), template)
    shuffled = np.random.default_rng(0).permutation(4096)[:2048].tolist()
    ((template, _),) = plan_batches(layout, layout, range(32768), shuffled, pages)[(0, 0)]
    assert len(pack_table(template)) < template.nbytes  # the page column stays random


@pytest.mark.parametrize("mutate", [
    lambda p: p[:-8],                      # cut short
    lambda p: b"\x07" + p[1:],             # unknown kind
    lambda p: p[:1] + (0).to_bytes(8, "little") + p[9:],  # zero rows
    lambda p: p[:1] + (10**6).to_bytes(8, "little") + p[9:],  # rows beyond the limit
    lambda p: p[:9] + (0).to_bytes(8, "little") + p[17:],  # a column with no runs
    lambda p: p + (1).to_bytes(8, "little"),  # a trailing word
    lambda p: b"",
])
def test_malformed_packed_tables_raise(mutate):
    table = np.tile(np.arange(WIDTH, dtype=np.int32), (50, 1))
    table[:, 5] = np.arange(50)
    packed = pack_table(table)
    assert packed[:1] == RLE
    with pytest.raises(ValueError, match="packed table"):
        unpack_table(mutate(packed), WIDTH, 100)


def test_raw_tables_are_checked_too():
    table = np.random.default_rng(1).integers(-10**9, 10**9, (20, WIDTH)).astype(np.int32)
    packed = pack_table(table)
    assert packed[:1] == RAW
    with pytest.raises(ValueError, match="packed table"):
        unpack_table(packed[:-4], WIDTH, 100)
    with pytest.raises(ValueError, match="packed table"):
        unpack_table(packed, WIDTH, 10)
