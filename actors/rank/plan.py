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

from ...engine.model_runner import BatchInputs

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


def share(comm, leader: bool, epoch: int, status: int, inputs: Optional[BatchInputs],
          channel: bool) -> tuple[int, Optional[BatchInputs]]:
    """The TP leader's plan to its followers (`comm`: a `GroupComm`; collective over its
    TP group): (status, inputs) on every rank. `channel`: try the group's shared-memory
    channel first (one message), else (or when the plan does not fit it) two gloo
    broadcasts."""
    header = header_of(status, epoch, inputs)
    if channel:
        shared = _share_words(comm, leader, epoch, header, inputs)
        if shared is not None:
            return shared
    comm.broadcast_tp(header)
    if leader:
        if inputs is not None:
            comm.broadcast_tp(payload_of(inputs))
        return status, inputs
    payload = torch.empty(payload_size(header), dtype=torch.int64)
    if payload.numel():
        comm.broadcast_tp(payload)
    return int(header[0]), inputs_of(header, payload, epoch)


def _share_words(comm, leader: bool, epoch: int, header: torch.Tensor,
                 inputs: Optional[BatchInputs]):
    """The plan as one message through the TP group's shared-memory channel:
    (status, inputs), or None when it goes over gloo this round (too large)."""
    if leader:
        words = header if inputs is None else torch.cat([header, payload_of(inputs)])
        sent = comm.share_tp(words.numpy())
        return None if sent is None else (int(header[0]), inputs)
    got = comm.share_tp(None)
    if got is None:
        return None
    words = torch.from_numpy(got)
    return int(words[0]), inputs_of(words[:HEADER_SIZE], words[HEADER_SIZE:], epoch)
