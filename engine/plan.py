"""A step plan: what a group leader tells its followers to run, as int64 tensors.

The leader schedules; followers run its plan. A plan travels as two broadcasts: a fixed
header, then a payload whose size the header gives; or, when the group's ranks share a
machine, as one message of header and payload through shared memory
(`GroupComm.share_tp`).

Header (int64[8]): status, epoch, T (tokens), S (sequences), P (block-table width),
L (rows to sample), max_query_len, max_seq_len.
Payload (int64): input_ids[T], positions[T], slot_mapping[T], query_start_loc[S+1],
seq_lens[S], block_tables[S*P], logits_indices[L], row_keys[S] (per row: the key of
the KV stream it feeds, 0 for none).
"""

from __future__ import annotations

from typing import Optional

import torch

from .model_runner import BatchInputs

IDLE, WORK, STOP = 0, 1, 2
HEADER_SIZE = 8



class StalePlan(RuntimeError):
    """A plan from another epoch reached this rank: it is dropped, never run."""


def header_of(status: int, epoch: int, inputs: Optional[BatchInputs]) -> torch.Tensor:
    if inputs is None:
        return torch.tensor([status, epoch, 0, 0, 0, 0, 0, 0], dtype=torch.int64)
    h = inputs.host
    s, p = h["block_tables"].shape
    return torch.tensor([status, epoch, h["input_ids"].numel(), s, p, h["logits_indices"].numel(),
                         inputs.max_query_len, inputs.max_seq_len], dtype=torch.int64)


def payload_of(inputs: BatchInputs) -> torch.Tensor:
    h = inputs.host
    parts = [h["input_ids"], h["positions"], h["slot_mapping"], h["query_start_loc"],
             h["seq_lens"], h["block_tables"].reshape(-1), h["logits_indices"], h["row_keys"]]
    return torch.cat([t.to(torch.int64) for t in parts])


def max_words(max_tokens: int, max_seqs: int, max_pages: int) -> int:
    """The most int64 words a plan (header and payload) can take: steps of up to
    `max_tokens` tokens over `max_seqs` sequences of up to `max_pages` pages."""
    return HEADER_SIZE + 3 * max_tokens + 4 * max_seqs + 1 + max_seqs * max_pages


def payload_size(header: torch.Tensor) -> int:
    """Elements of the payload that follows `header` (0: no batch, nothing follows)."""
    t, s, p, l = (int(x) for x in header[2:6])
    return 0 if t == 0 else 3 * t + (s + 1) + 2 * s + s * p + l


def inputs_of(header: torch.Tensor, payload: torch.Tensor, epoch: int) -> Optional[BatchInputs]:
    """A follower's copy of the leader's batch (no sequences: followers never sample)."""
    if int(header[1]) != epoch:
        raise StalePlan(f"plan of epoch {int(header[1])} reached a rank of epoch {epoch}")
    if int(header[0]) != WORK or int(header[2]) == 0:
        return None
    t, s, p, l, max_q, max_s = (int(x) for x in header[2:8])
    sizes = [t, t, t, s + 1, s, s * p, l, s]
    ids, pos, slots, qsl, lens, tables, logits, keys = torch.split(payload, sizes)
    host = {"input_ids": ids, "positions": pos, "slot_mapping": slots,
            "query_start_loc": qsl.to(torch.int32), "seq_lens": lens.to(torch.int32),
            "block_tables": tables.to(torch.int32).reshape(s, p), "logits_indices": logits,
            "row_keys": keys}
    return BatchInputs(host, max_q, max_s, sampled=[])
