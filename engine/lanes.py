"""`Lanes`: a step's two micro-batches as two lanes, each with its own pair of peer channels
and, on a GPU, its own stream (two-batch overlap over the peer exchange, ARCHITECTURE §3).

The peer exchange waits on the device (comm/peer_exchange.py), so there is no host thread
to hand an exchange to: overlap comes from the GPU itself running one lane's kernels while
the other lane's wait spins. The host launches lane 0's whole forward on stream 0, then
lane 1's on stream 1; both streams first wait for the current stream (fork) and the
current stream waits for both at the end (join), so the same code captures into one CUDA
graph with two branches.

Invariants: a lane's exchanges all go through its own pair of channels
(`EPDispatcher.lane`), issued on its own stream, in the same order on every rank (every
rank runs lane 0 then lane 1, each micro-batch's MoE layers in order); kernels that keep
state between launches keep one copy per lane (`kernels/gpu/arrivals.py`). Without CUDA
(the channels' kernels under Triton's interpreter) the lanes run one after the other:
the same exchanges, no overlap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["Lanes"]


class Lanes:
    """The two lanes of one rank's dispatcher (`comm.dispatch.EPDispatcher` with two
    pairs of peer channels)."""

    def __init__(self, dispatcher, top_k: int, device: torch.device) -> None:
        if dispatcher.peer_lanes != 2:
            raise ValueError(f"the dispatcher has {dispatcher.peer_lanes} lanes of peer channels, "
                             "lanes need 2")
        self._dispatcher, self._top_k = dispatcher, top_k
        self._cuda = torch.device(device).type == "cuda"
        self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if self._cuda else ()

    def ready(self) -> bool:
        """Whether this step's exchanges fit the peer channels (otherwise two
        micro-batches overlap over `GroupComm` on the exchange thread)."""
        return self._dispatcher.peer_fits(self._top_k)

    def run(self, work: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run `work[i]` as lane i (one or two); their results, in order."""
        if len(work) not in (1, 2):
            raise ValueError(f"one or two lanes, got {len(work)}")
        if not self._cuda:
            return [self._within(i, fn) for i, fn in enumerate(work)]
        current = torch.cuda.current_stream()
        out = []
        for i, fn in enumerate(work):
            stream = self._streams[i]
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                out.append(self._within(i, fn))
        for stream in self._streams[:len(work)]:
            current.wait_stream(stream)
        return out

    def _within(self, lane: int, fn: Callable[[], Any]) -> Any:
        with self._lane(lane):
            return fn()

    @contextlib.contextmanager
    def _lane(self, lane: int) -> Iterator[None]:
        scope = contextlib.nullcontext()
        if self._cuda:
            from ..kernels.gpu.arrivals import lane_scope
            scope = lane_scope(lane)
        before, self._dispatcher.lane = self._dispatcher.lane, lane
        try:
            with scope:
                yield
        finally:
            self._dispatcher.lane = before
