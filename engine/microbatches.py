"""How a step's batch splits into two micro-batches (two-batch overlap, ARCHITECTURE §3).

The split is by sequences, never inside one: micro-batch 0 takes the first sequences of
the batch and micro-batch 1 the rest, cut where their token counts are closest (a
one-sequence batch leaves micro-batch 1 empty: it still takes part in the exchanges).
Their hidden states, concatenated in order, are the batch's token order, so logits and
sampling do not change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from ..kernels.attention import AttentionMetadata

__all__ = ["micro_batches", "split_point"]

Part = tuple[torch.Tensor, torch.Tensor, AttentionMetadata]  # input_ids, positions, metadata


def split_point(starts: Sequence[int]) -> int:
    """The first sequence of micro-batch 1, given the batch's `query_start_loc` (S + 1
    token offsets): the cut in 1..S-1 whose two token counts are closest (the earlier
    one on a tie); S for a batch of fewer than two sequences."""
    num_seqs = len(starts) - 1
    if num_seqs < 2:
        return max(num_seqs, 0)
    total = starts[-1]
    return min(range(1, num_seqs), key=lambda s: (abs(2 * starts[s] - total), s))


def micro_batches(dev: dict[str, torch.Tensor], host: dict[str, torch.Tensor]
                  ) -> list[Optional[Part]]:
    """The two micro-batches of a step whose inputs are `dev` (on the device) and `host`
    (the same on the host, read for the shapes): each (input_ids, positions, metadata),
    or None for an empty one."""
    starts = host["query_start_loc"].tolist()
    cut, num_seqs = split_point(starts), len(starts) - 1
    parts: list[Optional[Part]] = []
    for lo, hi in ((0, cut), (cut, num_seqs)):
        if hi == lo:
            parts.append(None)
            continue
        t0, t1 = starts[lo], starts[hi]
        meta = AttentionMetadata(
            query_start_loc=dev["query_start_loc"][lo:hi + 1] - t0,
            seq_lens=dev["seq_lens"][lo:hi], block_tables=dev["block_tables"][lo:hi],
            slot_mapping=dev["slot_mapping"][t0:t1],
            max_query_len=max(starts[i + 1] - starts[i] for i in range(lo, hi)),
            max_seq_len=int(host["seq_lens"][lo:hi].max()))
        parts.append((dev["input_ids"][t0:t1], dev["positions"][t0:t1], meta))
    return parts
