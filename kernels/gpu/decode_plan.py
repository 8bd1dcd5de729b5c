"""Decode attention's plan: KV positions per tile, positions per split, and the grid's
split count, for `decode_attention_triton` (kernels/gpu/attention.py).

The default plan follows the batch (few sequences: short splits, so that enough programs
fill the SMs), so a sequence's sums depend on its company; the batch-invariant mode's
(kernels/batch_invariant.py) follows a sequence's length alone. Plain Python over
host ints: nothing here launches or syncs.
"""

from __future__ import annotations

import math

import triton

__all__ = ["decode_plan", "INVARIANT_BLOCK_N", "INVARIANT_PART", "GRID_POSITIONS"]


def _decode_block_n(num_seqs: int, head_dim: int) -> int:
    """KV positions per tile of the split kernel: 32 past 64 sequences, else 64 (32 for
    head dims past 128). One H100, ctx 1k: alone (bench/probes/decode_attention_tiles.py)
    128 sequences take 103 µs with 32 against 122 with 64, 64 sequences 61 against 66;
    in the decode step (decode_gpu.py --baselines attn64, 24 layers) 128 sequences gain
    3.4%, 64 lose 0.6% (so they keep 64)."""
    return 32 if num_seqs > 64 or head_dim > 128 else 64


def _decode_partition(num_seqs: int, num_kv_heads: int, num_heads: int, head_dim: int,
                      bound: int, block_n: int) -> int:
    """Positions per split (a multiple of block_n).

    Aims at enough (split, kv_head, seq) programs to fill ~132 SMs for a ~1k context:
    few sequences -> short partitions; up to 64 sequences never past 256 positions, since
    splitting a 1k context four ways beat one program per (kv_head, seq) even at 64
    sequences. From a sweep on one H200 (graph replay, ctx 1k, 256-page tables;
    bench/NOTES.md): B=1 best at 64 (7.4 µs vs 8.1 at 128), B=4 at 64, B=16 at 256, B=64
    at 256 (49.7 vs 54.5 at 1024). Past 64 sequences up to 2048 (one H100, 32-position
    tiles, 128 sequences: 103 µs at 2048, 110 at 512). Longer contexts only add programs,
    up to the grid's splits (`_decode_grid_splits`, at most 256: the merge walks a
    sequence's splits one after another), past which a sequence's splits grow instead.
    Grown if the float32 partial buffer [S, H, grid splits, D] would pass
    128 MiB (huge block tables).
    """
    want = triton.next_power_of_2(num_seqs * num_kv_heads * 4)
    part = max(64, min(256, want)) if num_seqs <= 64 else min(2048, want)
    part = max(part, block_n)
    if GRID_POSITIONS is None:  # at most 256 splits of the table (else: of the grid)
        part = max(part, triton.next_power_of_2(triton.cdiv(bound, _MAX_SPLITS)))
    while num_seqs * num_heads * _decode_grid_splits(triton.cdiv(bound, part), part, num_seqs, num_kv_heads) \
            * head_dim * 4 > (128 << 20):
        part *= 2
    return part


# The split kernel's grid covers at most this many positions of the block table with
# PART-position splits (and at least `_GRID_PROGRAMS` programs): a longer sequence's
# positions are cut in that many larger chunks instead (`_split_chunk`), so a wide table
# (a server's max_model_len, the model's 40960 unless set) adds no programs that find no
# positions and return, nor a longer partition (batch 1 kept 64 positions a split). One
# H100, ctx 1k, 24 layers, tables of 40960 positions: decode steps 1.017-1.026x the
# program-per-split grid's at batch 16-128 (attention at batch 64 1,502 against 1,859 µs
# a step), as fast as with 4096-wide tables (batch 1: 548-555 tok/s against 552-554;
# 528 with the 256-position splits the table's width forced before); at 4096 the same
# grid, tokens and speed.
# None: a program for every PART-position split of the table (at most 256).
GRID_POSITIONS: int | None = 4096
_GRID_PROGRAMS = 2048
_MAX_SPLITS = 256  # a sequence's splits at most (the merge walks them one after another)


def _decode_grid_splits(n_split: int, part: int, num_seqs: int, num_kv_heads: int) -> int:
    """The grid's split dimension for a table of `n_split` splits of `part` positions."""
    if GRID_POSITIONS is None:
        return n_split
    wanted = max(GRID_POSITIONS // part, triton.cdiv(_GRID_PROGRAMS, num_seqs * num_kv_heads))
    return max(1, min(n_split, wanted, _MAX_SPLITS))


# The batch-invariant mode's plan (kernels/batch_invariant.py): a sequence's positions
# split by its length alone, so its result is the same bits in any batch and table width.
INVARIANT_BLOCK_N = 32
INVARIANT_PART = 256


def _invariant_plan(bound: int) -> tuple[int, int, int]:
    """(tile, positions per split, grid splits) in the batch-invariant mode: fixed tile
    and split size, and at least two grid splits, so that the merge is always taken (one
    DIRECT program would round differently) and a sequence of up to 256 splits (65,536
    positions) is always cut in `INVARIANT_PART`-position splits (`_split_chunk`)."""
    splits = max(2, min(_MAX_SPLITS, triton.cdiv(bound, INVARIANT_PART)))
    return INVARIANT_BLOCK_N, INVARIANT_PART, splits


def decode_plan(num_seqs: int, num_kv_heads: int, num_heads: int, head_dim: int, bound: int,
                partition: int | None = None, block_n: int | None = None,
                invariant: bool = False) -> tuple[int, int, int]:
    """(tile, positions per split, grid splits) for `num_seqs` sequences over block tables
    of `bound` positions. ``invariant``: `_invariant_plan`. Otherwise ``block_n`` and
    ``partition`` (a multiple of the tile; tests force several splits with it) override
    the heuristics (`_decode_block_n`, `_decode_partition`)."""
    if invariant:
        return _invariant_plan(bound)
    block_n = block_n or _decode_block_n(num_seqs, head_dim)
    part = partition or _decode_partition(num_seqs, num_kv_heads, num_heads, head_dim, bound, block_n)
    if part % block_n:
        block_n = math.gcd(part, block_n)
    return block_n, part, _decode_grid_splits(triton.cdiv(bound, part), part, num_seqs, num_kv_heads)
