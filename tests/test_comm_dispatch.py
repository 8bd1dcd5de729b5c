"""GroupComm collectives and EPDispatcher on real gloo worlds (spawned CPU processes),
over gloo alone and with the shared-memory tensor channels (`ShmCollectives`: sized so
that some calls fit and others fall back to gloo, per call on every rank alike).

Every world runs under a wall-clock bound: the parent drains results until the bound,
then kills whatever is left and fails, so a hang can never stall CI.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from free_ports import free_ports

from phalanx.comm.group_comm import CollectiveError, GroupComm
from phalanx.comm.dispatch import EPDispatcher, make_expert_placement, moe_reference
from phalanx.kernels.moe import fused_experts, route_ref
from phalanx.spawn import run_ranks

E, K, H, I = 16, 4, 32, 16
DEADLINE_S = 3.0
TP_BYTES, WORLD_BYTES = 64, 2048  # the shared-memory channels' capacities when opened
WORLD_TIMEOUT_S = 40.0


# ----------------------------------------------------------------------- harness

class Ports:
    """Free ports picked afresh for each attempt of a world (`_run_world`): `n` of them
    as a list, or one as an int."""

    def __init__(self, n: int = 1, single: bool = False) -> None:
        self.n, self.single = n, single

    def pick(self):
        ports = free_ports(self.n)
        return ports[0] if self.single else ports


def _run_world(fn, world: int, *args, expect=None, timeout_s: float = WORLD_TIMEOUT_S) -> dict:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks; rank -> return value.

    ``expect``: ranks that must report (default all). Fails on a worker exception or if
    the ranks are not done within ``timeout_s`` (leftovers are killed either way). A
    `Ports` argument becomes free ports; a world whose port was taken between picking
    and binding (EADDRINUSE) runs once more on new ones.
    """
    for attempt in range(2):
        picked = tuple(a.pick() if isinstance(a, Ports) else a for a in args)
        results, errors = run_ranks(fn, world, picked, timeout_s=timeout_s, expect=expect,
                                    torch_threads=1)
        if not (attempt == 0 and any("EADDRINUSE" in t for t in errors.values())):
            break
    failed = {r: t for r, t in errors.items() if not t.startswith("no result")}
    assert not failed, "worker failed:\n" + "\n".join(f"rank {r}:\n{t}" for r, t in failed.items())
    assert not errors, f"ranks {sorted(errors)} gave no result within {timeout_s}s: {errors}"
    return results


# --------------------------------------------------------------------- ranks' work

def _open_channels(comm: GroupComm, shm: bool) -> None:
    if shm:
        comm.open_tensor_channels(TP_BYTES, WORLD_BYTES)
        assert (comm._tp_tensors is not None) == (comm.tp_size > 1)
        assert (comm._world_tensors is not None) == (comm.dp_size > 1)


def _tp_collectives(rank, world, ports):
    """TP sizes 1, 2, 4 over gloo alone (epochs 0-2), then with the shared-memory
    channels (epochs 3-5), one world for both."""
    for epoch, (tp, port) in enumerate(zip((1, 2, 4) * 2, ports)):
        comm = GroupComm.init(rank, world, tp, f"tcp://127.0.0.1:{port}", epoch, DEADLINE_S)
        _open_channels(comm, shm=epoch >= 3)
        assert (comm.tp_size, comm.dp_size, comm.epoch) == (tp, world // tp, epoch)
        assert (comm.dp_rank, comm.tp_rank) == (rank // tp, rank % tp)
        group = [comm.dp_rank * tp + i for i in range(tp)]
        t = torch.arange(3, dtype=torch.float32) * (rank + 1)
        assert comm.all_reduce_tp(t) is t
        assert torch.equal(t, torch.arange(3.0) * sum(r + 1 for r in group))
        big = torch.arange(40, dtype=torch.float32) * (rank + 1)  # past TP_BYTES: gloo
        assert torch.equal(comm.all_reduce_tp(big), torch.arange(40.0) * sum(r + 1 for r in group))
        half = torch.arange(6, dtype=torch.bfloat16).view(2, 3) * (rank + 1)
        assert torch.equal(comm.all_reduce_tp(half),
                           torch.arange(6, dtype=torch.bfloat16).view(2, 3) * sum(r + 1 for r in group))
        mine = torch.full((2, 3), float(rank)) + torch.arange(3.0)
        for dim in (0, 1):
            want = torch.cat([torch.full((2, 3), float(r)) + torch.arange(3.0) for r in group], dim)
            assert torch.equal(comm.all_gather_tp(mine, dim), want)
        b = torch.full((4,), float(rank))
        assert comm.broadcast_tp(b, src_tp_rank=tp - 1) is b
        assert torch.equal(b, torch.full((4,), float(group[-1])))
        assert comm.all_reduce_world_max(10 * rank + epoch) == 10 * (world - 1) + epoch
        comm.barrier()
        comm.check_epoch(epoch)
        try:
            comm.check_epoch(epoch + 1)
            raise AssertionError("stale epoch accepted")
        except CollectiveError as e:
            assert (e.op, e.epoch, e.rank) == ("epoch", epoch, rank)
        assert comm.destroy()
    return True


def _weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) * 0.2
    w2 = torch.randn(E, H, I, generator=g) * 0.2
    return w13, w2


def _routing(T: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w, ids = route_ref(torch.randn(T, E, generator=g), K, True, torch.float32)
    return x, w, ids


def _expert_compute(disp: EPDispatcher, w13_full, w2_full):
    local = disp.local_experts
    w13, w2 = w13_full[local], w2_full[local]
    return lambda rx, rid, rw: fused_experts(rx, rw[:, None], rid[:, None], w13, w2)


def _scale_compute(disp: EPDispatcher):
    """Row-wise fake expert: y = x * w * (global id + 1), exactly reproducible."""
    gid = torch.tensor(disp.local_experts + [0], dtype=torch.int64)
    return lambda rx, rid, rw: (rx.float() * rw.float()[:, None] * (gid[rid] + 1.0)[:, None]).to(rx.dtype)


def _scale_expected(x, w, ids):
    acc = torch.zeros(x.shape, dtype=torch.float32)
    for j in range(ids.shape[1]):
        acc += (x.float() * w[:, j].float()[:, None] * (ids[:, j] + 1.0)[:, None]).to(x.dtype).float()
    return acc.to(x.dtype)


def _make_dispatcher(rank, world, port, epoch, shm=False):
    comm = GroupComm.init(rank, world, 1, f"tcp://127.0.0.1:{port}", epoch, DEADLINE_S)
    _open_channels(comm, shm)
    owner, local_index, _ = make_expert_placement(E, world)
    return comm, EPDispatcher(comm, E, owner, local_index)


def _check_fused_call(disp, compute, w13_full, w2_full, T, seed):
    x, w, ids = _routing(T, seed)
    out = disp.moe(x, w, ids, compute)
    assert out.shape == (T, H) and out.dtype == x.dtype
    torch.testing.assert_close(out, moe_reference(x, w, ids, w13_full, w2_full), rtol=1e-5, atol=1e-6)


def _ep_moe(rank, world, port, sizes, shm=False):
    """sizes[call][rank] = tokens of this rank in that call (0 = idle dummy step), over
    the exact exchange and then the padded one on the same world (padded: `step_tokens`
    = the call's most tokens on any rank)."""
    comm, disp = _make_dispatcher(rank, world, port, 0, shm)
    for padded in (False, True):
        _ep_moe_calls(disp, rank, sizes, padded)
    assert comm.destroy()
    return True


def _ep_moe_calls(disp, rank, sizes, padded):
    mode = "padded" if padded else "exact"
    w13_full, w2_full = _weights()
    compute = _expert_compute(disp, w13_full, w2_full)
    for call, Ts in enumerate(sizes):  # consecutive MoE layers
        disp.step_tokens = max(max(Ts), 1) if padded else None
        _check_fused_call(disp, compute, w13_full, w2_full, Ts[rank], 100 * call + rank)
    scale = _scale_compute(disp)
    for call, Ts in enumerate(sizes):  # exact routing and slot order; signed bf16 weights
        disp.step_tokens = max(max(Ts), 1) if padded else None
        dtype = (torch.float32, torch.bfloat16)[call % 2]
        x, _, ids = _routing(Ts[rank], 7 + 100 * call + rank, dtype)
        w = torch.randn(ids.shape, generator=torch.Generator().manual_seed(call)).to(torch.bfloat16)
        out = disp.moe(x, w, ids, scale)
        assert torch.equal(out, _scale_expected(x, w, ids)), (mode, call)
        half = Ts[rank] // 2  # same rows in a smaller batch: bit-identical
        assert torch.equal(disp.moe(x[:half], w[:half], ids[:half], scale), out[:half]), (mode, call)


def _dead_peer(rank, world, ports, shm):
    comm, disp = _make_dispatcher(rank, world, ports[0], 0, shm)
    w13_full, w2_full = _weights()
    compute = _expert_compute(disp, w13_full, w2_full)
    _check_fused_call(disp, compute, w13_full, w2_full, 5 + rank, rank)
    if rank == 2:  # die right before the x-rows all-to-all, after the counts exchange
        real, calls = comm.all_to_all_single, [0]

        def dying(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 2:
                os._exit(1)
            return real(*args, **kwargs)

        comm.all_to_all_single = dying
    x, w, ids = _routing(6, 50 + rank)
    t0 = time.monotonic()
    try:
        disp.moe(x, w, ids, compute)
        raise AssertionError("moe survived a dead peer")
    except CollectiveError as e:
        raised_s = time.monotonic() - t0
        err = (e.op, e.epoch, e.rank, type(e.__cause__).__name__)
    t0 = time.monotonic()
    try:
        disp.moe(x, w, ids, compute)
        raise AssertionError("broken comm ran a collective")
    except CollectiveError:
        again_s = time.monotonic() - t0
    assert comm.broken
    t0 = time.monotonic()
    destroyed = comm.destroy()
    destroy_s = time.monotonic() - t0
    # Continue narrower: the two survivors re-form at epoch 1 and re-run the step.
    comm, disp = _make_dispatcher(rank, 2, ports[1], 1, shm)
    _check_fused_call(disp, _expert_compute(disp, w13_full, w2_full), w13_full, w2_full, 6, 50 + rank)
    assert comm.destroy()
    return dict(err=err, raised_s=raised_s, again_s=again_s, destroyed=destroyed, destroy_s=destroy_s)


def _stalled_peer(rank, world, port, shm):
    comm, disp = _make_dispatcher(rank, world, port, 0, shm)
    w13_full, w2_full = _weights()
    compute = _expert_compute(disp, w13_full, w2_full)
    _check_fused_call(disp, compute, w13_full, w2_full, 3, rank)
    if rank == 2:  # alive but never enters the next step
        time.sleep(DEADLINE_S + 2)
        comm.destroy()
        return None
    x, w, ids = _routing(4, 60 + rank)
    t0 = time.monotonic()
    try:
        disp.moe(x, w, ids, compute)
        raise AssertionError("moe survived a stalled peer")
    except CollectiveError as e:
        raised_s = time.monotonic() - t0
        err = (e.op, e.epoch, e.rank)
    comm.destroy()
    return dict(err=err, raised_s=raised_s)


# -------------------------------------------------------------------------- tests

def test_make_expert_placement():
    owner, local_index, per_rank = make_expert_placement(16, 3)
    assert [len(p) for p in per_rank] == [6, 5, 5]
    assert per_rank[1] == list(range(6, 11)) and owner[6] == 1 and local_index[6] == 0
    assert sum(per_rank, []) == list(range(16))
    assert [len(p) for p in make_expert_placement(3, 4)[2]] == [1, 1, 1, 0]


SHM = pytest.mark.parametrize("shm", [False, True], ids=["gloo", "shm"])


def test_tp_collectives_world4():
    """Over gloo and over the shared-memory channels (one world runs both)."""
    assert _run_world(_tp_collectives, 4, Ports(6)) == {r: True for r in range(4)}


@SHM
@pytest.mark.parametrize("world,sizes", [
    (2, [(5, 0), (0, 7), (9, 3), (0, 0), (1, 12)]),
    (4, [(5, 0, 9, 2), (1, 6, 0, 13), (0, 0, 0, 0), (8, 3, 1, 0)]),
])
def test_ep_moe_matches_reference(world, sizes, shm):
    """Exact (uneven splits) and padded exchanges, one after the other on one world
    (spawning a world costs more than its calls), both equal the single-rank reference,
    and are bit-exact per row whatever else shares the batch."""
    assert _run_world(_ep_moe, world, Ports(single=True), sizes, shm) == {
        r: True for r in range(world)}


@SHM
def test_dead_peer_mid_dispatch_raises_within_deadline(shm):
    t0 = time.monotonic()
    res = _run_world(_dead_peer, 3, Ports(2), shm, expect=(0, 1))
    for rank in (0, 1):
        r = res[rank]
        print(f"rank {rank}: raised {r['raised_s']:.3f}s after entering moe, {r['err']}; "
              f"again {r['again_s'] * 1e3:.2f} ms; destroy {r['destroy_s']:.3f}s")
        assert r["err"][:3] == ("all_to_all_single", 0, rank)
        assert r["raised_s"] < 10.0 and r["again_s"] < 0.5 and r["destroyed"]
    print(f"dead-peer world total {time.monotonic() - t0:.1f}s")


@SHM
def test_stalled_peer_times_out_at_deadline(shm):
    res = _run_world(_stalled_peer, 3, Ports(single=True), shm)
    for rank in (0, 1):
        r = res[rank]
        print(f"rank {rank}: stalled peer -> CollectiveError after {r['raised_s']:.3f}s {r['err']}")
        assert r["err"] == ("all_to_all_single", 0, rank)
        assert DEADLINE_S - 0.5 < r["raised_s"] < DEADLINE_S + 7.0


class _StuckWork:
    """An NCCL work that never completes (a peer died inside the collective)."""

    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:  # never reached: the deadline fires first
        raise AssertionError("waited on a stuck work")


def test_nccl_wait_honours_its_deadline_and_breaks_the_comm():
    """The NCCL wait loop gives up at the deadline it is given (the epoch's connect
    deadline at init, the collective deadline otherwise), aborts the epoch and leaves
    the communicator broken."""
    comm = GroupComm(rank=0, world_size=2, tp_size=1, epoch=3, deadline_s=30.0, tp_group=None,
                     nccl=True)
    t0 = time.monotonic()
    with pytest.raises(CollectiveError, match="no completion within 0.2 s"):
        comm._wait("all_to_all_single", _StuckWork(), 0.2)
    assert 0.2 <= time.monotonic() - t0 < 5.0
    assert comm.broken
    with pytest.raises(CollectiveError, match="broken"):
        comm.all_reduce_world_max(1)

