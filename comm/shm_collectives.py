"""`ShmCollectives`: sum, gather and all-to-all of CPU tensors over the ranks of one
machine, through shared memory, in tens of microseconds where a gloo collective takes
~0.5-1.2 ms (a tiny model's TP step makes ten of them); bounded by a deadline, a rank
whose process is gone noticed at once (its pid is published, as in `ShmAgreement`).

Layout: every rank owns one `ShmPeers` buffer of int64 ``[2 (parity), 1 + world +
capacity // 4]`` and its pid after them. Round ``r`` (counted alike on every rank: every
rank makes the same calls in the same order) writes parity ``r % 2``: word 0 is the
header ``tag | fits`` (fits: 1 when this rank's payload fitted, 0 when the round goes
over gloo), words ``1..world`` are the rows this rank sends to each rank (all-to-all;
else 0), then the payload, 4 bytes per word; every word is ``tag << 32 | value`` with
tag ``r mod 2**31``, so a reader takes a word as round r's only when its tag says so and
no ordering between words is needed (an aligned 8-byte store is seen whole).

Every rank waits for every rank's header each round, so when a rank completes round
r + 1 every rank has started it, i.e. finished reading round r: the parity a rank
overwrites in round r + 2 is read by nobody. A sum adds the ranks' parts in rank order
on every rank, so every rank gets the same bits.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch

from .shm_peers import ShmPeers
from .shm_agreement import spin_until

__all__ = ["ShmCollectives"]

_TAG_MOD = 1 << 31
_LOW = (1 << 32) - 1
_SUMMABLE = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class ShmCollectives:
    """Collectives over `peers`' world for CPU tensors of up to `capacity` bytes per
    rank; a call whose tensors do not fit (an all-to-all's rows must also be 4-byte
    multiples) returns False on every rank alike, and the caller runs it over gloo."""

    def __init__(self, peers: ShmPeers, capacity: int, deadline_s: float,
                 name: str = "tensors") -> None:
        if capacity < 4:
            raise ValueError(f"capacity must be >= 4 bytes, got {capacity}")
        self.rank, self.world_size, self.deadline_s = peers.rank, peers.world_size, deadline_s
        self._head = 1 + self.world_size
        self.capacity = capacity // 4 * 4
        width = self._head + self.capacity // 4
        peers.alloc(name, 2 * width + 1, torch.int64)  # + the owner's pid
        views = [v.numpy() for v in peers.views(name)]
        self._slots = [v[:2 * width].reshape(2, width) for v in views]
        views[self.rank][2 * width] = os.getpid()
        self._pid_words = [v[2 * width:] for v in views]
        self._peers = peers  # owns the mappings the views read
        self._round = 0

    # -- the collectives -------------------------------------------------------------
    def all_reduce_sum(self, t: torch.Tensor) -> bool:
        """Sum `t` (contiguous CPU, same shape and dtype on every rank) over the ranks
        in place; False (nothing done) when it goes over gloo instead."""
        if t.dtype not in _SUMMABLE or not _fits(t, self.capacity):
            return False
        parts = self._parts(t)
        acc = _as_tensor(parts[0], t.dtype, t.shape).clone()
        for part in parts[1:]:  # rank order on every rank: the same bits everywhere
            acc += _as_tensor(part, t.dtype, t.shape)
        t.copy_(acc)
        return True

    def all_gather(self, t: torch.Tensor) -> Optional[list[torch.Tensor]]:
        """Every rank's `t` (contiguous CPU, same shape and dtype on every rank), in rank
        order; None when it goes over gloo instead."""
        if not _fits(t, self.capacity):
            return None
        parts = self._parts(t)
        return [_as_tensor(p, t.dtype, t.shape) for p in parts]

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                   output_split_sizes: Optional[Sequence[int]],
                   input_split_sizes: Optional[Sequence[int]]) -> bool:
        """`all_to_all_single` along dim 0 (splits as there; None: even); False on every
        rank (nothing done) when any rank's input does not fit."""
        world = self.world_size
        out_rows = _splits(output, output_split_sizes, world)
        in_rows = _splits(input, input_split_sizes, world)
        row = math.prod(input.shape[1:]) * input.element_size()  # bytes per row
        fits = (not input.is_cuda and input.dim() > 0 and input.dtype == output.dtype
                and input.shape[1:] == output.shape[1:] and row % 4 == 0
                and input.numel() * input.element_size() <= self.capacity)
        heads = self._publish(input if fits else None, in_rows, fits)
        if not all(int(h[0]) & 1 for h in heads):
            return False  # some rank's input did not fit: the round goes over gloo
        width = row // 4
        pieces = []
        for q, head in enumerate(heads):
            sent = [int(w) & _LOW for w in head[1:]]
            if sent[self.rank] != out_rows[q]:
                raise ValueError(f"rank {q} sends {sent[self.rank]} rows to rank {self.rank}, "
                                 f"which expects {out_rows[q]}")
            start = sum(sent[:self.rank]) * width
            pieces.append(self._read(q, start, out_rows[q] * width))
        got = np.concatenate(pieces) if pieces else np.empty(0, np.uint32)
        output.copy_(_as_tensor(got, output.dtype, output.shape))
        return True

    # -- the rounds ------------------------------------------------------------------
    def _parts(self, t: torch.Tensor) -> list[np.ndarray]:
        """Every rank's `t` (same size everywhere), as the words it was sent in."""
        self._publish(t, [0] * self.world_size, True)
        n = -(-t.numel() * t.element_size() // 4)
        return [self._read(q, 0, n) for q in range(self.world_size)]

    def _publish(self, t: Optional[torch.Tensor], rows: list[int], fits: bool) -> list[np.ndarray]:
        """Write this round's payload (`t`, or none) and header, then wait for every
        rank's header: the headers (each `[fits, rows per rank...]` words, tags kept)."""
        self._round += 1
        parity, tag = self._round % 2, (self._round % _TAG_MOD) << 32
        mine = self._slots[self.rank][parity]
        if t is not None and t.numel():  # tagged in a temporary: written in one pass
            raw = t.contiguous().view(-1).view(torch.uint8).numpy()
            if len(raw) % 4:  # padded to whole words
                raw = np.concatenate([raw, np.zeros(4 - len(raw) % 4, np.uint8)])
            words = raw.view(np.uint32)
            mine[self._head:self._head + len(words)] = words.astype(np.int64) | tag
        mine[1:self._head] = np.asarray(rows, dtype=np.int64) | tag
        mine[0] = tag | int(fits)
        want = tag >> 32
        heads = []
        for q in range(self.world_size):
            head = self._slots[q][parity, :self._head]
            heads.append(head if q == self.rank else
                         self._wait(q, head, want, f"header of round {self._round}"))
        return heads

    def _read(self, q: int, start: int, n: int) -> np.ndarray:
        """Rank q's payload words [start, start + n) of this round, as uint32."""
        words = self._slots[q][self._round % 2, self._head + start:self._head + start + n]
        if q != self.rank and n:
            words = self._wait(q, words, self._round % _TAG_MOD, f"round {self._round}")
        return (words & _LOW).astype(np.uint32)

    def _wait(self, q: int, words: np.ndarray, want: int, what: str) -> np.ndarray:
        """A copy of `words` (rank q's) once every one carries tag `want`."""
        box: list[np.ndarray] = []

        def landed() -> bool:
            if (int(words[-1]) >> 32) != want:  # the last word first: cheap while waiting
                return False
            got = words.copy()
            if np.all((got >> 32) == want):
                box.append(got)
                return True
            return False

        spin_until(landed, self.deadline_s, int(self._pid_words[q][0]), f"{what}, rank {q}")
        return box[0]


def _fits(t: torch.Tensor, capacity: int) -> bool:
    return not t.is_cuda and t.numel() * t.element_size() <= capacity


def _splits(t: torch.Tensor, sizes: Optional[Sequence[int]], world: int) -> list[int]:
    if sizes is not None:
        return [int(s) for s in sizes]
    if len(t) % world:
        raise ValueError(f"{len(t)} rows do not split evenly over {world} ranks")
    return [len(t) // world] * world


def _as_tensor(words: np.ndarray, dtype: torch.dtype, shape) -> torch.Tensor:
    """The first `shape`'s worth of `words` (uint32) as a tensor of `dtype`."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not nbytes:
        return torch.empty(shape, dtype=dtype)
    raw = torch.from_numpy(np.ascontiguousarray(words)).view(torch.uint8)[:nbytes]
    return raw.view(dtype).view(shape)
