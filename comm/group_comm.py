"""One rank's communicators (world + its TP group), fenced by an epoch, bounded by a deadline.

Layout (ARCHITECTURE §3): ``world = dp x tp`` ranks; rank ``r`` has ``dp_rank = r // tp``
and ``tp_rank = r % tp``, so a TP group is ``tp`` consecutive ranks. The world group is
the default process group; it carries the DP x EP all-to-all and world-wide agreement.

Failure model (§5): every collective either finishes within ``deadline_s`` or raises
:class:`CollectiveError`; after the first error the communicator is *broken* and every
later call raises at once, so a step that saw a fault can only be aborted. Re-forming
means :meth:`GroupComm.destroy` and a new :meth:`GroupComm.init` with a bumped epoch on
a new rendezvous address (the caller picks both; `rendezvous.held_address` gives one whose
port is already bound).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .errors import CollectiveError
from .rendezvous import rendezvous_store
from .local_channels import LocalChannels
from .shm_agreement import ShmAgreement
from .shm_broadcast import ShmBroadcast
from .shm_collectives import ShmCollectives

__all__ = ["CollectiveError", "GroupComm"]  # CollectiveError re-exported from .errors

_R = TypeVar("_R")
# Deadline of an epoch's first NCCL collective, which sets up the connections (seconds).
NCCL_CONNECT_S = 60.0


class GroupComm(LocalChannels):
    """Communicators of one rank for one epoch; build with :meth:`init`.

    All ranks of the world must call the same collectives in the same order; a rank
    with no work still takes part (it passes empty tensors).

    Backends: tensors on the CPU travel over gloo, whose process-group timeout turns a
    dead or stalled peer into an exception within the deadline; when every rank runs on
    one machine, the small ones (a step's agreement, plans, and after
    :meth:`open_tensor_channels` the TP sums and gathers and the all-to-alls up to a
    capacity) go through shared memory instead (`LocalChannels`), under the same
    deadline. With ``device="cuda"`` the groups are ``cpu:gloo,cuda:nccl``: control
    messages (plans, agreement, epochs) stay on gloo, activations go over NCCL. NCCL is no detector (a survivor waited over
    60 s with a 5 s timeout), so every NCCL collective is issued with ``async_op`` and
    this class polls the work until a monotonic deadline; past it, every communicator of
    the epoch is aborted (``ncclCommAbort`` frees the stuck kernel) and the call raises
    :class:`CollectiveError`.

    Ranks that share one GPU (a machine with fewer GPUs than ranks: NCCL refuses two
    ranks of a communicator on one device) are found at :meth:`init` (device UUIDs
    gathered over gloo); the world then *relays* its CUDA tensors' collectives through
    host memory over gloo (``relay``), bounded by gloo's timeout like the CPU path.
    """

    def __init__(self, rank: int, world_size: int, tp_size: int, epoch: int,
                 deadline_s: float, tp_group: Any, nccl: bool = False) -> None:
        self.rank = rank
        self.world_size = world_size
        self.tp_size = tp_size
        self.dp_size = world_size // tp_size
        self.tp_rank = rank % tp_size
        self.dp_rank = rank // tp_size
        self.epoch = epoch
        self.deadline_s = deadline_s
        self._tp_group = tp_group
        self.nccl = nccl  # CUDA tensors go over NCCL with our own deadline wait loop
        self.relay = False  # CUDA tensors go through host memory over gloo instead
        self._agreement: ShmAgreement | None = None  # world on one machine: shared memory
        self.one_machine = False  # every rank of the world runs on this machine
        self._tp_channel: ShmBroadcast | None = None  # the TP leader's plans (open_tp_channel)
        self._tp_tensors: ShmCollectives | None = None  # CPU sums, gathers (open_tensor_channels)
        self._world_tensors: ShmCollectives | None = None  # CPU all-to-alls (the same)
        self._broken: str | None = None
        self._destroyed = False
        self._aborting: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def init(cls, rank: int, world_size: int, tp_size: int, init_method: str, epoch: int,
             deadline_s: float, device: str = "cpu") -> GroupComm:
        """Join the world at ``init_method`` (e.g. ``"tcp://127.0.0.1:PORT"``, new per epoch).

        Creates the default process group and every TP group (same order on all ranks),
        all with ``timeout=deadline_s``, then checks that every rank joined with the same
        ``epoch``. Raises :class:`CollectiveError` (op ``"init"``) on a bad layout, a
        rendezvous that misses the deadline, an already initialized default group, or an
        epoch mismatch. ``device``: ``"cpu"`` (gloo only) or ``"cuda"`` (gloo for CPU
        tensors, NCCL for CUDA tensors; call after ``torch.cuda.set_device``).
        """
        if world_size < 1 or tp_size < 1 or world_size % tp_size or not 0 <= rank < world_size:
            raise CollectiveError("init", epoch, rank,
                                  f"bad layout rank={rank} world={world_size} tp={tp_size}")
        timeout = timedelta(seconds=deadline_s)
        nccl = device.startswith("cuda")
        backend = "cpu:gloo,cuda:nccl" if nccl else "gloo"
        if nccl:  # we abort on our own deadline; NCCL's watchdog must not kill the process
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
        created = False
        try:
            store = rendezvous_store(init_method, rank, timeout)
            dist.init_process_group(backend, init_method=None if store else init_method,
                                    store=store, world_size=world_size, rank=rank,
                                    timeout=timeout)
            created = True
            tp_group = None
            if tp_size > 1:
                for dp in range(world_size // tp_size):
                    ranks = list(range(dp * tp_size, (dp + 1) * tp_size))
                    group = dist.new_group(ranks=ranks, timeout=timeout, backend=backend)
                    if rank in ranks:
                        tp_group = group
            comm = cls(rank, world_size, tp_size, epoch, deadline_s, tp_group, nccl)
            comm._agree_on_epoch()
            comm._agreement = comm._open_agreement()
            if nccl:
                comm.relay = comm._ranks_share_a_gpu()
                if not comm.relay:
                    comm._connect_nccl()
        except Exception as e:
            if created:  # never tear down a default group that someone else owns
                cls._destroy_default_bounded(deadline_s)
            if isinstance(e, CollectiveError):
                raise
            raise CollectiveError("init", epoch, rank, str(e)) from e
        return comm

    def _agree_on_epoch(self) -> None:
        # MAX over (epoch, -epoch) gives (max, -min): equal to ours iff all ranks agree.
        t = torch.tensor([self.epoch, -self.epoch], dtype=torch.int64)
        self._run("init", dist.all_reduce, t, op=dist.ReduceOp.MAX)
        hi, lo = int(t[0]), -int(t[1])
        if hi != self.epoch or lo != self.epoch:
            self._broken = f"epoch mismatch: ranks joined with epochs in [{lo}, {hi}]"
            raise CollectiveError("init", self.epoch, self.rank, self._broken)

    def _ranks_share_a_gpu(self) -> bool:
        """Whether two ranks of the world run on one GPU (same device UUID; every rank
        sees every UUID, so all decide alike)."""
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return self._distinct_ids(uuid.UUID(str(props.uuid)).bytes) < self.world_size

    def _connect_nccl(self) -> None:
        """Set up the epoch's NCCL communicators now, under the connect deadline: NCCL
        connects a group on its first collective, which would otherwise be the first
        step's and count against the collective deadline (a re-formed group's first MoE
        all-to-all once missed its 5 s that way on two H200s, after the previous epoch's
        ranks had just been torn down)."""
        deadline = max(self.deadline_s, NCCL_CONNECT_S)
        for group in [None] + ([self._tp_group] if self._tp_group is not None else []):
            t = torch.zeros(1, device="cuda")
            self._run("init", dist.all_reduce, t, group=group, _deadline_s=deadline)

    def destroy(self) -> bool:
        """Tear down this epoch's process groups; never hangs. Idempotent.

        Runs ``destroy_process_group`` in a helper thread bounded by
        ``min(deadline_s, 10)`` seconds (with a dead peer a backend shutdown may block).
        Returns True iff the groups are gone, i.e. a new :meth:`init` can follow.
        """
        if self._destroyed:
            return True
        self._broken = self._broken or "destroyed"
        if self._aborting is not None:
            self._aborting.join(timeout=min(self.deadline_s, 10.0))
            self._destroyed = not self._aborting.is_alive() and not dist.is_initialized()
            return self._destroyed
        self._tp_group = None
        self._destroyed = self._destroy_default_bounded(self.deadline_s)
        return self._destroyed

    @staticmethod
    def _destroy_default_bounded(deadline_s: float) -> bool:
        def target() -> None:
            try:
                dist.destroy_process_group()
            except Exception:  # best effort: the group is being thrown away anyway
                pass

        th = threading.Thread(target=target, name="phalanx-destroy-pg", daemon=True)
        th.start()
        th.join(timeout=min(deadline_s, 10.0))
        return not th.is_alive() and not dist.is_initialized()

    @property
    def broken(self) -> bool:
        """True once a collective failed (or after :meth:`destroy`)."""
        return self._broken is not None

    def check_epoch(self, epoch: int) -> None:
        """Raise :class:`CollectiveError` (op ``"epoch"``) unless ``epoch`` is this comm's."""
        if epoch != self.epoch:
            raise CollectiveError("epoch", self.epoch, self.rank,
                                  f"stale epoch {epoch} (current {self.epoch})")

    # ---------------------------------------------------------------- collectives

    def _run(self, name: str, fn: Callable[..., _R], *args: Any,
             _deadline_s: float | None = None, **kwargs: Any) -> _R:
        """Call torch.distributed collective ``name``; any failure breaks the comm.

        On a CUDA tensor (first argument) with NCCL, the collective is asynchronous and
        :meth:`_wait` bounds it by the deadline (``_deadline_s``, default the comm's)."""
        def call() -> _R:
            on_gpu = self.nccl and _first_tensor(args).is_cuda
            if on_gpu and self.relay:
                return _through_host(fn, args, kwargs)
            if not on_gpu:
                return fn(*args, **kwargs)
            work = fn(*args, async_op=True, **kwargs)
            self._wait(name, work, _deadline_s or self.deadline_s)
            return None

        return self._guarded(name, call)

    def _guarded(self, name: str, call: Callable[[], _R]) -> _R:
        """`call()` on behalf of collective `name`: refused on a broken comm, and any
        failure breaks it (CollectiveError)."""
        if self._broken is not None:
            raise CollectiveError(name, self.epoch, self.rank,
                                  f"communicator is broken ({self._broken})")
        try:
            return call()
        except CollectiveError:
            raise
        except Exception as e:
            self._broken = f"{name}: {type(e).__name__}: {str(e)[:200]}"
            raise CollectiveError(name, self.epoch, self.rank, str(e)) from e

    def _wait(self, name: str, work: Any, deadline_s: float) -> None:
        """Poll an NCCL work until done or the deadline; past it, abort the epoch."""
        deadline = time.monotonic() + deadline_s
        polls = 0
        while not work.is_completed():
            if time.monotonic() > deadline:
                self._broken = f"{name}: no completion within {deadline_s:g} s"
                self._abort_nccl()
                raise CollectiveError(name, self.epoch, self.rank, self._broken)
            polls += 1
            if polls > 200:  # spin briefly (µs-scale collectives), then yield the core
                time.sleep(50e-6)
        work.wait()  # orders the caller's stream after the collective; raises its error

    def _abort_nccl(self) -> None:
        """Abort every communicator of this epoch on a helper thread: the caller raises
        at once; :meth:`destroy` waits (bounded) for the abort to finish."""
        def target() -> None:
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception:  # best effort: the epoch is being thrown away
                pass

        self._tp_group = None
        self._aborting = threading.Thread(target=target, name="phalanx-abort-pg", daemon=True)
        self._aborting.start()

    def all_reduce_tp(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the TP group in place and return it (identity when tp == 1)."""
        if self.tp_size == 1:
            return self._check_alive("all_reduce_tp", t)
        if not self._local_sum_tp(t):
            self._run("all_reduce_tp", dist.all_reduce, t, op=dist.ReduceOp.SUM,
                      group=self._tp_group)
        return t

    def all_gather_tp(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate the TP ranks' equally shaped ``t`` along ``dim``, in tp_rank order."""
        if self.tp_size == 1:
            return self._check_alive("all_gather_tp", t)
        t = t.contiguous()
        parts = self._local_gather_tp(t)
        if parts is None:
            parts = [torch.empty_like(t) for _ in range(self.tp_size)]
            self._run("all_gather_tp", dist.all_gather, parts, t, group=self._tp_group)
        return torch.cat(parts, dim=dim)

    def broadcast_tp(self, t: torch.Tensor, src_tp_rank: int = 0) -> torch.Tensor:
        """Overwrite ``t`` in place with TP rank ``src_tp_rank``'s copy and return it."""
        if not 0 <= src_tp_rank < self.tp_size:
            raise ValueError(f"src_tp_rank {src_tp_rank} out of range for tp={self.tp_size}")
        if self.tp_size == 1:
            return self._check_alive("broadcast_tp", t)
        src = self.dp_rank * self.tp_size + src_tp_rank
        self._run("broadcast_tp", dist.broadcast, t, src=src, group=self._tp_group)
        return t

    def all_reduce_world_max(self, *values: int) -> int | list[int]:
        """Element-wise maximum of ``values`` over all ranks of the world; an int for one
        value, else a list. Ranks of one machine agree through shared memory (values in
        [0, 2**32), at most 8: `ShmAgreement`), others over gloo."""
        if self._agreement is not None:
            out = self._guarded("all_reduce_world_max", lambda: self._agreement.max(values))
            return out[0] if len(values) == 1 else out
        t = torch.tensor(values, dtype=torch.int64)
        self._run("all_reduce_world_max", dist.all_reduce, t, op=dist.ReduceOp.MAX)
        return int(t[0]) if len(values) == 1 else t.tolist()

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Sequence[int] | None = None,
                          input_split_sizes: Sequence[int] | None = None) -> torch.Tensor:
        """World all-to-all along dim 0 with (possibly uneven, possibly zero) splits.

        ``input_split_sizes[r]`` rows of ``input`` go to rank r; ``output_split_sizes[r]``
        rows of ``output`` come from rank r. Both tensors contiguous. Returns ``output``.
        """
        if self._local_all_to_all(output, input, output_split_sizes, input_split_sizes):
            return output
        self._run("all_to_all_single", dist.all_to_all_single, output, input,
                  list(output_split_sizes) if output_split_sizes is not None else None,
                  list(input_split_sizes) if input_split_sizes is not None else None)
        return output

    def broadcast_world(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite the CPU tensor ``t`` in place with rank ``src``'s copy (gloo)."""
        if t.is_cuda:
            raise ValueError("broadcast_world carries CPU tensors (control data) only")
        self._run("broadcast_world", dist.broadcast, t, src=src)
        return t

    def barrier(self) -> None:
        """Wait until every rank of the world got here (within the deadline; over gloo)."""
        self._run("barrier", dist.all_reduce, torch.zeros(1, dtype=torch.int64))

    def _check_alive(self, op: str, t: torch.Tensor) -> torch.Tensor:
        # Identity ops still refuse to run on a broken comm: the step is being aborted.
        if self._broken is not None:
            raise CollectiveError(op, self.epoch, self.rank,
                                  f"communicator is broken ({self._broken})")
        return t

    def __repr__(self) -> str:
        state = f"broken={self._broken!r}" if self._broken else "ok"
        return (f"GroupComm(rank={self.rank}, world={self.world_size}, tp={self.tp_size}, "
                f"epoch={self.epoch}, deadline_s={self.deadline_s}, {state})")


def _through_host(fn: Callable[..., _R], args: Sequence[Any], kwargs: dict) -> _R:
    """Collective `fn` with its CUDA tensors (arguments, or lists of them) replaced by
    host copies (so it runs over gloo), whose results are then copied back."""
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def host(a: Any) -> Any:
        if isinstance(a, torch.Tensor) and a.is_cuda:
            copies.append((a, a.cpu()))
            return copies[-1][1]
        if isinstance(a, list) and a and all(isinstance(x, torch.Tensor) for x in a):
            return [host(x) for x in a]
        return a

    out = fn(*[host(a) for a in args], **kwargs)
    for dev, h in copies:
        dev.copy_(h)
    return out


def _first_tensor(args: Sequence[Any]) -> torch.Tensor:
    """The tensor a collective works on (lists of tensors: the first one)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return a[0]
    raise TypeError("collective called without a tensor")
