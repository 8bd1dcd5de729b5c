"""The resharding plan as wire-format copy tables, built with numpy (no `Copy` objects).

`plan_tables` returns the same copies as `planner.plan_tokens`, in the same order
(layer-major, then kind, head run, token run), already encoded as the transport's int32
table (`messages.COPY_FIELDS`) and grouped by (src_rank, dst_rank). A long request has
hundreds of thousands of copies (48 layers × 2 kinds × one per page); building them as
Python objects costs more than moving the bytes over NVLink, a table costs microseconds
per layer. `plan_batches` gives the same copies in the form the sender sends them
(`messages.CopyBatch`: the per-(layer, kind) template once, and one block per (layer,
kind)), without materialising the repeated table at all. Pure logic: numpy, no torch,
no I/O.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Optional

import numpy as np

from . import messages as m
from .layout import KVLayout
from .planner import check_request, head_runs_of, token_runs_of

__all__ = ["plan_batches", "plan_tables", "layer_batches", "layer_slices", "table_nbytes"]

_I32 = np.dtype("<i4")


def _templates(src: KVLayout, dst: KVLayout, token_range: range, src_pages: Sequence[int],
               dst_pages: Sequence[int], layers: Optional[range], replica_hint: int
               ) -> tuple[dict[tuple[int, int], np.ndarray], range]:
    """({(src_rank, dst_rank): the per-(layer, kind) template, layer and kind 0}, layers);
    arguments and errors as `planner.plan_tokens`."""
    layers = check_request(src, dst, token_range, src_pages, dst_pages, layers)
    if len(token_range) == 0 or len(layers) == 0:
        return {}, layers
    tokens = np.asarray(token_runs_of(src, dst, token_range, src_pages, dst_pages), dtype=np.int64)
    by_pair: dict[tuple[int, int], list[np.ndarray]] = defaultdict(list)
    for s_rank, d_rank, s_head, d_head, n_heads in head_runs_of(src, dst, replica_hint):
        base = np.zeros((len(tokens), len(m.COPY_FIELDS)), dtype=np.int64)
        base[:, m.F_SRC_HEAD], base[:, m.F_DST_HEAD], base[:, m.F_NUM_HEADS] = s_head, d_head, n_heads
        base[:, [m.F_SRC_PAGE, m.F_SRC_OFFSET, m.F_DST_PAGE, m.F_DST_OFFSET, m.F_NUM_TOKENS]] = tokens
        by_pair[(s_rank, d_rank)].append(base)
    return {pair: np.concatenate(parts) for pair, parts in by_pair.items()}, layers


def plan_tables(src: KVLayout, dst: KVLayout, token_range: range,
                src_pages: Sequence[int], dst_pages: Sequence[int],
                layers: Optional[range] = None, *, replica_hint: int = 0
                ) -> dict[tuple[int, int], np.ndarray]:
    """{(src_rank, dst_rank): int32 table `[n, len(COPY_FIELDS)]`} of the copies of the
    tokens in `token_range`; arguments and errors as `planner.plan_tokens`."""
    templates, layers = _templates(src, dst, token_range, src_pages, dst_pages, layers,
                                   replica_hint)
    return {pair: _repeat_over(t, layers) for pair, t in templates.items()}


def plan_batches(src: KVLayout, dst: KVLayout, token_range: range,
                 src_pages: Sequence[int], dst_pages: Sequence[int],
                 layers: Optional[range] = None, *, replica_hint: int = 0
                 ) -> dict[tuple[int, int], list[m.CopyBatch]]:
    """{(src_rank, dst_rank): [CopyBatch]}: `plan_tables`' copies as templates of at most
    `messages.MAX_TEMPLATE_ROWS` rows, each with one block per (layer, kind), layer-major
    then kind; arguments and errors as `planner.plan_tokens`."""
    templates, layers = _templates(src, dst, token_range, src_pages, dst_pages, layers,
                                   replica_hint)
    out: dict[tuple[int, int], list[m.CopyBatch]] = {}
    for pair, template in templates.items():
        out[pair] = []
        for a in range(0, len(template), m.MAX_TEMPLATE_ROWS):
            part = np.ascontiguousarray(template[a:a + m.MAX_TEMPLATE_ROWS], dtype=_I32)
            blocks = np.zeros((2 * len(layers), len(m.BLOCK_FIELDS)), dtype=_I32)
            blocks[:, 0] = np.repeat(np.asarray(layers, dtype=np.int64), 2)
            blocks[:, 1] = np.tile(np.arange(2), len(layers))
            blocks[:, 3] = len(part)
            out[pair].append(m.CopyBatch(part, blocks))
    return out


def layer_batches(batches: Sequence[m.CopyBatch]) -> dict[int, list[m.CopyBatch]]:
    """{layer: the batches restricted to that layer's blocks} (templates shared)."""
    out: dict[int, list[m.CopyBatch]] = defaultdict(list)
    for batch in batches:
        layer = batch.blocks[:, 0]
        for lo, hi in _runs_of(layer):
            out[int(layer[lo])].append(m.CopyBatch(batch.template, batch.blocks[lo:hi]))
    return dict(out)


def _runs_of(column: np.ndarray) -> list[tuple[int, int]]:
    """[(start, stop)] of the maximal runs of equal values of `column`."""
    cuts = np.flatnonzero(np.diff(column)) + 1
    return list(zip(np.concatenate(([0], cuts)).tolist(),
                    np.concatenate((cuts, [len(column)])).tolist()))


def _repeat_over(template: np.ndarray, layers: range) -> np.ndarray:
    """The per-(layer, kind) template repeated layer-major, then kind."""
    n, reps = len(template), 2 * len(layers)
    table = np.tile(template, (reps, 1))
    table[:, m.F_LAYER] = np.repeat(np.asarray(layers, dtype=np.int64), 2 * n)
    table[:, m.F_KIND] = np.tile(np.repeat(np.arange(2), n), len(layers))
    return np.ascontiguousarray(table, dtype=_I32)


def layer_slices(table: np.ndarray) -> dict[int, np.ndarray]:
    """{layer: its rows} of a layer-major table (views, no copies)."""
    layer = table[:, m.F_LAYER]
    return {int(layer[a]): table[a:b] for a, b in _runs_of(layer)}


def table_nbytes(table: np.ndarray, head_dim: int, dtype_bytes: int) -> int:
    """Payload bytes of a table."""
    return m.payload_nbytes(table, head_dim, dtype_bytes)
