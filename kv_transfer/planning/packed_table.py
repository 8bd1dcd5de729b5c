"""A copy table (`messages.COPY_FIELDS`, int32 `[rows, 10]`) packed for a control message.

A plan's template is a product of head runs and token runs, so its columns are runs of
arithmetic progressions: with consecutive pages every column is one to three runs of a
constant step, whatever the request's length. Packed, each column is run-length encoded
over its first differences (the first row's value as its first difference): 2048 rows
(32k tokens in pages of 16: 80 KiB raw) pack into a few hundred bytes, which travel
eagerly instead of by rendezvous, and cost the receiver a `repeat` and a `cumsum` per
column. A table whose packed form is not smaller (random page ids in every column)
travels raw.

Layout, little-endian: one byte `RAW` or `RLE`, then either the raw int32 table, or
int64 words: rows, the run count k_c of each column, then per column its k_c steps and
its k_c run lengths. Pure logic: numpy only.
"""

from __future__ import annotations

import numpy as np

__all__ = ["pack_table", "unpack_table"]

RAW, RLE = b"\x00", b"\x01"
_I32, _I64 = np.dtype("<i4"), np.dtype("<i8")
_LIMIT = (np.iinfo(np.int32).min, np.iinfo(np.int32).max)


def pack_table(table: np.ndarray) -> bytes:
    """`table` ([rows, width] int32) packed: RLE of each column's first differences,
    or raw when that is not smaller."""
    table = np.ascontiguousarray(table, dtype=_I32)
    raw = RAW + table.tobytes()
    rows, width = table.shape
    if rows == 0:
        return raw
    values = np.ascontiguousarray(table.T, dtype=np.int64)  # [width, rows]
    steps = np.empty_like(values)
    steps[:, 0], steps[:, 1:] = values[:, 0], values[:, 1:] - values[:, :-1]
    starts = np.ones_like(steps, dtype=bool)  # a run starts where the step changes
    starts[:, 1:] = steps[:, 1:] != steps[:, :-1]
    counts = starts.sum(axis=1)
    total = int(counts.sum())
    if 8 * (1 + width + 2 * total) >= len(raw) - 1:
        return raw
    flat = np.flatnonzero(starts)  # column-major positions: every column starts a run
    lengths = np.diff(flat, append=rows * width)
    words = np.empty(1 + width + 2 * total, dtype=_I64)
    words[0], words[1:1 + width] = rows, counts
    run_values, pos, first = steps[starts], 1 + width, 0
    for k in counts.tolist():  # per column: its k steps, then its k lengths
        words[pos:pos + k] = run_values[first:first + k]
        words[pos + k:pos + 2 * k] = lengths[first:first + k]
        pos, first = pos + 2 * k, first + k
    return RLE + words.tobytes()


def unpack_table(data: bytes, width: int, max_rows: int) -> np.ndarray:
    """The int32 table `[rows, width]` that `pack_table` packed; ValueError if `data` is
    malformed (its length, run counts or lengths inconsistent, more than `max_rows`
    rows, or values outside int32)."""
    kind, body = data[:1], memoryview(data)[1:]
    if kind == RAW:
        if len(body) % (width * _I32.itemsize):
            raise ValueError(f"packed table: raw body of {len(body)} bytes is not a "
                             f"multiple of {width * _I32.itemsize}")
        table = np.frombuffer(body, dtype=_I32).reshape(-1, width)
        if len(table) > max_rows:
            raise ValueError(f"packed table: {len(table)} rows, at most {max_rows}")
        return table
    if kind != RLE or len(body) % _I64.itemsize:
        raise ValueError("packed table: unknown kind or a length not a multiple of 8")
    words = np.frombuffer(body, dtype=_I64)
    if len(words) < 1 + width:
        raise ValueError("packed table: header cut short")
    rows, counts = int(words[0]), words[1:1 + width]
    if not 0 < rows <= max_rows:
        raise ValueError(f"packed table of {rows} rows: 1 to {max_rows}")
    if (counts <= 0).any() or (counts > rows).any() \
            or len(words) != 1 + width + 2 * int(counts.sum()):
        raise ValueError("packed table: rows and run counts do not match its length")
    # per column: its k steps then its k lengths
    ends = 1 + width + 2 * np.cumsum(counts)
    is_length = np.zeros(len(words), dtype=bool)
    for end, k in zip(ends.tolist(), counts.tolist()):
        is_length[end - k:end] = True
    steps, lengths = words[1 + width:][~is_length[1 + width:]], words[is_length]
    per_column = np.add.reduceat(lengths, np.concatenate(([0], np.cumsum(counts)[:-1])))
    if (lengths <= 0).any() or (per_column != rows).any():
        raise ValueError(f"packed table: run lengths do not sum to {rows} in every column")
    values = np.cumsum(np.repeat(steps, lengths).reshape(width, rows), axis=1)
    if values.min() < _LIMIT[0] or values.max() > _LIMIT[1]:
        raise ValueError("packed table: values leave int32")
    return np.ascontiguousarray(values.T, dtype=_I32)
