"""MoE expert-parallel dispatch / combine over the DP x EP world (ARCHITECTURE §3, §8).

Every rank holds full attention for its own tokens and only its experts. A MoE layer
sends each (token, slot) pair to the rank that owns the slot's expert, that rank runs
the expert (already weighted by the routing weight), and the results come back and are
summed per token. A rank with no tokens still takes part in every collective (a dummy
step). Two exchanges, same results bit for bit:

- exact (default): the ranks first swap their row counts and the all-to-alls carry
  uneven splits, so the host reads the counts (a device sync per layer on GPU);
- padded (`step_tokens` set: the most tokens any rank dispatches this step, which the
  ranks agree on before the step): every rank sends `step_tokens * k` rows to every
  rank, its pairs first and padding rows (local expert -1, which experts skip) after;
  no counts, no host sync, so a GPU step is queued without waiting for the device.

Torch reference over :class:`~phalanx.comm.group_comm.GroupComm` (gloo on CPU). The padded
exchange can instead go through two :class:`~phalanx.comm.peer_exchange.PeerExchange`
channels (:meth:`EPDispatcher.use_peer_exchanges`: symmetric memory, NVSHMEM on GPU):
each block carries only its pairs (the receiver marks the rest as padding from the
counts that travel with the flags), nothing waits on the host, and a step whose rows
exceed the channels' capacity goes through ``GroupComm`` as before. With two pairs of
channels (two lanes), a step's two micro-batches each exchange through their own pair
(`lane` selects it; `engine/lanes.py` runs the lanes on two streams), so each pair's
exchanges stay in one order on one stream, as a channel requires.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

from ..kernels.moe import fused_experts_ref
from .exchange_worker import INLINE, ExchangeWorker
from .group_comm import GroupComm
from .peer_exchange import PeerExchange
from .peer_memory import LocalWorld

__all__ = ["EPDispatcher", "make_expert_placement", "moe_reference"]

ExpertCompute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# Same-size integer dtype per element size: a weight's bits travel as one int64, exactly.
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def make_expert_placement(num_experts: int, world_size: int
                          ) -> tuple[list[int], list[int], list[list[int]]]:
    """Contiguous, as-even-as-possible blocks of experts per rank (16 over 3: 6, 5, 5).

    Returns ``(owner, local_index, experts_of_rank)``: ``owner[e]`` is the rank holding
    global expert ``e``, ``local_index[e]`` its index in that rank's ``w13``/``w2``
    stack, and ``experts_of_rank[r]`` rank r's global ids in local-index order.
    """
    if num_experts < 1 or world_size < 1:
        raise ValueError(f"need num_experts >= 1 and world_size >= 1, got {num_experts}, {world_size}")
    base, extra = divmod(num_experts, world_size)
    experts_of_rank: list[list[int]] = []
    start = 0
    for r in range(world_size):
        n = base + (1 if r < extra else 0)
        experts_of_rank.append(list(range(start, start + n)))
        start += n
    owner = [0] * num_experts
    local_index = [0] * num_experts
    for r, experts in enumerate(experts_of_rank):
        for i, e in enumerate(experts):
            owner[e], local_index[e] = r, i
    return owner, local_index, experts_of_rank


def moe_reference(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  w13_full: torch.Tensor, w2_full: torch.Tensor) -> torch.Tensor:
    """Single-rank oracle: :func:`fused_experts_ref` with every expert held locally."""
    return fused_experts_ref(x, topk_weights, topk_ids, w13_full, w2_full)


class EPDispatcher:
    """Expert-parallel MoE over all ``comm.world_size`` ranks.

    ``owner[e]`` is the rank holding global expert ``e`` and ``local_index[e]`` its
    index in that rank's ``w13``/``w2`` stack; on each rank the local indices must be
    exactly ``0..n-1``. Each rank dispatches the tokens it passes to :meth:`moe` (with
    TP > 1 inside a DP rank, the caller decides which TP rank sends which rows).
    """

    def __init__(self, comm: GroupComm, num_experts: int, owner: Sequence[int],
                 local_index: Sequence[int]) -> None:
        owner, local_index = list(owner), list(local_index)
        if len(owner) != num_experts or len(local_index) != num_experts:
            raise ValueError(f"owner/local_index must have {num_experts} entries, "
                             f"got {len(owner)}/{len(local_index)}")
        if any(not 0 <= r < comm.world_size for r in owner):
            raise ValueError(f"owner ranks must lie in [0, {comm.world_size}): {owner}")
        experts_of_rank: list[list[int]] = [[] for _ in range(comm.world_size)]
        for e in sorted(range(num_experts), key=lambda e: local_index[e]):
            experts_of_rank[owner[e]].append(e)
        for r, experts in enumerate(experts_of_rank):
            if [local_index[e] for e in experts] != list(range(len(experts))):
                raise ValueError(f"local indices on rank {r} are not 0..{len(experts) - 1}")
        self.comm = comm
        self.num_experts = num_experts
        self.experts_of_rank = experts_of_rank
        self._owner = torch.tensor(owner, dtype=torch.int64)
        self._local_index = torch.tensor(local_index, dtype=torch.int64)
        self._on_device: dict[torch.device, tuple[torch.Tensor, ...]] = {}
        # padded exchange: the most tokens any rank passes to `moe` this step (None: exact)
        self.step_tokens: int | None = None
        self._peer: tuple[tuple[PeerExchange, PeerExchange], ...] | None = None  # per lane
        self.lane = 0  # the pair of peer channels this micro-batch's exchanges use
        # two-batch overlap: the exchanges of `moe_stages` run on `_worker` (set per step)
        self.overlap = False
        self._worker: ExchangeWorker | None = None

    def use_peer_exchanges(self, *channels: PeerExchange) -> None:
        """Send the padded exchange's rows through peer channels whenever a step fits
        their `max_rows`: (dispatch, combine) for each lane, one or two lanes; dispatch
        rows are H wide plus the pair metadata, combine rows H."""
        if len(channels) not in (2, 4):
            raise ValueError(f"need a (dispatch, combine) pair per lane, 1 or 2 lanes; "
                             f"got {len(channels)} channels")
        for ex in channels:
            if (ex.rank, ex.world_size) != (self.comm.rank, self.comm.world_size):
                raise ValueError(f"exchange of rank {ex.rank}/{ex.world_size} for dispatcher "
                                 f"of rank {self.comm.rank}/{self.comm.world_size}")
        self._peer = tuple(zip(channels[0::2], channels[1::2]))
        self._constants(channels[0].device)  # copied now, not inside the first step

    @property
    def peer_lanes(self) -> int:
        """How many micro-batches can exchange through peer channels at once (0: none)."""
        return 0 if self._peer is None else len(self._peer)

    def peer_fits(self, top_k: int) -> bool:
        """Whether this step's padded exchange (`step_tokens`, `top_k` rows a token) fits
        the peer channels."""
        return (self._peer is not None and self.step_tokens is not None
                and self.step_tokens * top_k <= min(ex.max_rows for ex in self._peer[0]))

    @contextlib.contextmanager
    def rehearsal(self) -> Iterator[None]:
        """Within: the peer channels are stand-ins of the same shapes in a world this
        process simulates, whose peers never send: each wait gives up after one spin,
        so a forward runs (its results garbage) without any peer. A forward in it loads
        every kernel a step will launch (e.g. before capturing CUDA graphs), none of
        them then loaded while a peer's wait spins."""
        real = self._peer
        if real is None:
            yield
            return
        world = LocalWorld(self.comm.world_size, real[0][0].device).rank(self.comm.rank)
        self._peer = tuple(
            tuple(PeerExchange(world, f"{name}{lane}", ex.max_rows, ex.width, ex.dtype,
                               max_spins=1, load_kernels=False)
                  for name, ex in zip(("dispatch", "combine"), pair))
            for lane, pair in enumerate(real))
        try:
            yield
        finally:
            self._peer = real

    @property
    def local_experts(self) -> list[int]:
        """Global ids of this rank's experts, in local-index (weight stack) order."""
        return self.experts_of_rank[self.comm.rank]

    def moe(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            compute: ExpertCompute) -> torch.Tensor:
        """Dispatch, compute and combine one MoE layer; collective over the world.

        Args:
            x: [T, H] this rank's tokens; T may be 0 (the rank still takes part).
                H and dtype must agree over ranks.
            topk_weights: [T, k] routing weights (same dtype on every rank).
            topk_ids: [T, k] int64 global expert ids.
            compute: ``compute(recv_x [R, H], recv_local_ids [R] int64,
                recv_weights [R]) -> [R, H]``: each received pair's expert output,
                already multiplied by its weight (R may be 0; it is still called).

        Returns:
            [T, H] in ``x.dtype``: ``out[t] = sum_{j=0..k-1} y[t, j]`` summed in slot
            order in float32, cast once: per row deterministic and independent of
            which other tokens share the batch (given a row-wise ``compute``).

        Raises:
            CollectiveError: a peer failed or missed the deadline; discard the step.
        """
        self._check(x, topk_weights, topk_ids)
        capacity = None if self.step_tokens is None else self.step_tokens * topk_ids.shape[1]
        peer = self._peer
        if capacity is not None and peer is not None and not self.overlap \
                and capacity <= min(ex.max_rows for ex in peer[self.lane]):
            return self._moe_peer(x, topk_weights, topk_ids, compute, capacity)
        stages = self.moe_stages(x, topk_weights, topk_ids, compute)
        try:
            while True:
                next(stages)
        except StopIteration as stop:
            return stop.value

    def moe_stages(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   compute: ExpertCompute):
        """`moe` over `GroupComm` as a stage generator (`models/stages.py`): it yields
        once while its dispatch and once while its combine is in flight, and returns
        `moe`'s result. With `overlap` set the exchanges run on this rank's
        `ExchangeWorker` (two micro-batches interleaved), else at submission."""
        T, H = self._check(x, topk_weights, topk_ids)
        k, worker = topk_ids.shape[1], self._worker_now(x.device)
        if self.step_tokens is not None:
            order, rows, send, _ = self._padded_rows(x, topk_weights, topk_ids,
                                                     self.step_tokens * k)
            padded = torch.zeros((self.comm.world_size * self.step_tokens * k, send.shape[1]),
                                 dtype=x.dtype, device=x.device)
            padded[:, H:] = self._constants(x.device)[2].view(x.dtype)  # padding: no expert
            padded[rows] = send
            recv = torch.empty_like(padded)
            pending = worker.submit("moe_dispatch",
                                    lambda: self.comm.all_to_all_single(recv, padded))
            yield
            self._wait(pending)
            y = self._experts(compute, self._unpack(recv, H, topk_weights.dtype), x.dtype)
            back = torch.empty_like(y)
            pending = worker.submit("moe_combine", lambda: self.comm.all_to_all_single(back, y))
            yield
            self._wait(pending)
            return self._combine(back[rows], order, T, k, x.dtype)
        order, send_counts = self._plan(topk_ids)
        send = self._pair_rows(x, topk_weights, topk_ids, order, k)
        pending = worker.submit("moe_dispatch", lambda: self._send_rows(send, send_counts))
        yield
        recv, send_split, recv_split = self._wait(pending)
        y = self._experts(compute, self._unpack(recv, H, topk_weights.dtype), x.dtype)
        back = torch.empty((len(order), H), dtype=x.dtype, device=x.device)
        pending = worker.submit("moe_combine", lambda: self.comm.all_to_all_single(
            back, y, send_split, recv_split))
        yield
        self._wait(pending)
        return self._combine(back, order, T, k, x.dtype)

    def _check(self, x: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor) -> tuple[int, int]:
        T, H = x.shape
        if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_weights.shape != topk_ids.shape:
            raise ValueError(f"x {tuple(x.shape)}, topk_weights {tuple(topk_weights.shape)} and "
                             f"topk_ids {tuple(topk_ids.shape)} disagree")
        if topk_ids.dtype != torch.int64:
            raise ValueError(f"topk_ids must be int64, got {topk_ids.dtype}")
        k = topk_ids.shape[1]
        if self.step_tokens is not None and T > self.step_tokens:
            raise ValueError(f"{T} tokens x {k} slots exceed the step's "
                             f"{self.step_tokens * k} rows per rank")
        return T, H

    def _worker_now(self, device: torch.device):
        """Where this layer's exchanges run: the worker thread while overlapping (on a
        CUDA device, with a stream of its own there)."""
        if not self.overlap:
            return INLINE
        if self._worker is None:
            self._worker = ExchangeWorker(f"phalanx-exchange-r{self.comm.rank}", device)
        return self._worker

    def _wait(self, pending):
        return pending.wait(2 * self.comm.deadline_s + 5.0, self.comm.epoch, self.comm.rank)

    def close(self) -> None:
        """End the exchange thread (the group's epoch is over)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def _send_rows(self, send: torch.Tensor, send_counts: torch.Tensor
                   ) -> tuple[torch.Tensor, list[int], list[int]]:
        """The exact dispatch: swap the row counts, then the rows (and their metadata)
        in one all-to-all; (received rows, send split, receive split)."""
        recv_counts = self._exchange_counts(send_counts)
        send_split, recv_split = send_counts.tolist(), recv_counts.tolist()
        recv = torch.empty((sum(recv_split), send.shape[1]), dtype=send.dtype, device=send.device)
        self.comm.all_to_all_single(recv, send, recv_split, send_split)
        return recv, send_split, recv_split

    def _padded_rows(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     capacity: int):
        """The padded exchange's rows: pair p (sorted by destination) goes to row
        `dest * capacity + its rank among dest's pairs`; (order, rows, the pairs' rows,
        the destination bounds [world + 1])."""
        k, world = topk_ids.shape[1], self.comm.world_size
        owner = self._constants(x.device)[0]
        dest = owner[topk_ids.reshape(-1)]
        order = torch.argsort(dest, stable=True)
        sorted_dest = dest[order]
        bounds = torch.searchsorted(sorted_dest, torch.arange(world + 1, device=x.device))
        rows = sorted_dest * capacity + torch.arange(len(order), device=x.device) - bounds[:-1][sorted_dest]
        return order, rows, self._pair_rows(x, topk_weights, topk_ids, order, k), bounds

    def _moe_peer(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  compute: ExpertCompute, capacity: int) -> torch.Tensor:
        """The padded exchange through the peer channels: each block carries only its
        pairs; the receiver marks rows past a block's count as padding."""
        T, H = x.shape
        k, world = topk_ids.shape[1], self.comm.world_size
        order, rows, send, bounds = self._padded_rows(x, topk_weights, topk_ids, capacity)
        no_expert = self._constants(x.device)[2].view(x.dtype)
        dispatch, combine = self._peer[self.lane]
        counts = bounds[1:] - bounds[:-1]  # pairs per destination (bincount would sync)
        padded = torch.empty((world * capacity, send.shape[1]), dtype=x.dtype, device=x.device)
        padded[rows] = send
        recv = dispatch.exchange(padded, counts)  # rows past a block's count: undefined
        got = dispatch.recv_counts
        live = torch.arange(capacity, device=x.device)[None, :] < got[:, None]
        recv = torch.cat([recv[:, :H], torch.where(live.reshape(-1, 1), recv[:, H:],
                                                   no_expert)], dim=1)
        y = self._experts(compute, self._unpack(recv, H, topk_weights.dtype), x.dtype)
        back = combine.exchange(y, got)
        return self._combine(back[rows], order, T, k, x.dtype)

    def _constants(self, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(owner, local_index, the padding row's metadata as int64 [-1, 0]) on
        `device`, copied there once: a copy from host memory per layer would make the
        host wait for the device's queue every layer."""
        got = self._on_device.get(device)
        if got is None:
            got = tuple(t.to(device) for t in (self._owner, self._local_index,
                                               torch.tensor([-1, 0], dtype=torch.int64)))
            self._on_device[device] = got
        return got

    @staticmethod
    def _experts(compute: ExpertCompute, received: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 dtype: torch.dtype) -> torch.Tensor:
        """`compute` on the received (rows, local ids, weights): [R, H] in `dtype`,
        contiguous, ready to send back."""
        recv_x = received[0]
        y = compute(*received)
        if tuple(y.shape) != tuple(recv_x.shape):
            raise ValueError(f"compute returned {tuple(y.shape)}, expected {tuple(recv_x.shape)}")
        return y.to(dtype).contiguous()

    def _plan(self, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pairs p = t*k + j sorted (stably) by destination rank, and rows per rank."""
        flat = topk_ids.reshape(-1)
        # The range check reads the ids on the host: on GPU that is a sync per layer
        # for a check of our own router's output, so it runs on CPU tensors only.
        if flat.numel() and not flat.is_cuda and (
                int(flat.min()) < 0 or int(flat.max()) >= self.num_experts):
            raise ValueError(f"expert ids must lie in [0, {self.num_experts})")
        dest = self._constants(flat.device)[0][flat]
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=self.comm.world_size)
        return order, send_counts

    def _exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """The agreement step: how many rows each rank sends where (int64 [world])."""
        recv_counts = torch.empty_like(send_counts)
        return self.comm.all_to_all_single(recv_counts, send_counts.contiguous())

    def _pair_rows(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   order: torch.Tensor, k: int) -> torch.Tensor:
        """Per pair in `order`: x's row with (local expert id, weight bits) as int64 [2]
        appended in x's dtype."""
        int_dtype = _INT_OF_SIZE[topk_weights.element_size()]
        ids = self._constants(x.device)[1][topk_ids.reshape(-1)[order]]
        # Sign-extending the same-size int view to int64 and narrowing back is exact.
        bits = topk_weights.reshape(-1)[order].contiguous().view(int_dtype).to(torch.int64)
        meta = torch.stack([ids, bits], dim=1).view(x.dtype)  # [P, 16 / itemsize]
        return torch.cat([x[order // k], meta], dim=1)

    @staticmethod
    def _unpack(recv: torch.Tensor, H: int, wdtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Received rows -> (x rows, local expert ids, routing weights)."""
        int_dtype = _INT_OF_SIZE[wdtype.itemsize]
        recv_meta = recv[:, H:].contiguous().view(torch.int64)
        recv_w = recv_meta[:, 1].to(int_dtype).view(wdtype)
        return recv[:, :H].contiguous(), recv_meta[:, 0].contiguous(), recv_w

    @staticmethod
    def _combine(back: torch.Tensor, order: torch.Tensor, T: int, k: int,
                 dtype: torch.dtype) -> torch.Tensor:
        """Un-sort the returned rows to pair order and sum each token's slots j = 0..k-1."""
        rows = torch.empty_like(back)
        rows[order] = back
        rows = rows.view(T, k, back.shape[1])
        acc = torch.zeros((T, back.shape[1]), dtype=torch.float32, device=back.device)
        for j in range(k):  # elementwise adds in slot order: no cross-row reduction
            acc += rows[:, j].float()
        return acc.to(dtype)
