"""`ShmAgreement` (the per-step world agreement of ranks on one machine) between spawned
processes: every rank gets the element-wise maximum every round; a rank whose process
exits ends its peers' waits at once; a rank that stalls alive ends them at the deadline;
values it cannot carry are refused; `GroupComm` uses it when its ranks share /dev/shm and
falls back to gloo on every rank when they do not."""

from __future__ import annotations

import os
import random
import time

import pytest

from free_ports import free_port
from phalanx.comm.shm_agreement import ShmAgreement
from phalanx.spawn import run_ranks

ROUNDS = 300


def _values(round_: int, rank: int) -> list[int]:
    rng = random.Random(round_ * 1000 + rank)
    return [rng.randrange(0, 2**32) for _ in range(1 + round_ % 3)]


def _agreement(rank: int, world: int, tag: str, deadline_s: float) -> ShmAgreement:
    from phalanx.comm.shm_peers import ShmPeers
    return ShmAgreement(ShmPeers(rank, world, tag, deadline_s=30.0), deadline_s)


def _agree_rounds(rank: int, world: int, tag: str) -> int:
    agree = _agreement(rank, world, tag, 30.0)
    for r in range(ROUNDS):
        mine = _values(r, rank)
        want = [max(col) for col in zip(*(_values(r, q) for q in range(world)))]
        got = agree.max(mine)
        if got != want:
            raise AssertionError(f"round {r}: got {got}, want {want}")
        if rank == r % world:
            time.sleep(0.001)  # a late rank now and then
    agree._peers.close()  # every rank mapped every file at its first allocation
    return ROUNDS


def _one_exits(rank: int, world: int, tag: str, stall: bool) -> str:
    agree = _agreement(rank, world, tag, 8.0 if not stall else 1.0)
    agree.max([1])
    agree._peers.close()  # every rank mapped every file: the names can go
    if rank == world - 1:
        if stall:
            time.sleep(6.0)
            return "stalled"
        os._exit(0)
    t0 = time.monotonic()
    try:
        agree.max([2])
    except (RuntimeError, TimeoutError) as e:
        return f"{type(e).__name__} after {time.monotonic() - t0:.2f}s: {e}"
    return "no error"


def test_every_rank_gets_the_maximum_every_round():
    tag = f"agree{os.getpid()}a"
    results, errors = run_ranks(_agree_rounds, 3, (tag,), timeout_s=120)
    assert not errors, errors
    assert results == {0: ROUNDS, 1: ROUNDS, 2: ROUNDS}


@pytest.mark.parametrize("stall", [False, True], ids=["exits", "stalls"])
def test_a_missing_rank_ends_the_wait(stall):
    tag = f"agree{os.getpid()}{'s' if stall else 'x'}"
    results, errors = run_ranks(_one_exits, 3, (tag, stall), timeout_s=60, expect=[0, 1])
    assert not errors, errors
    for rank in (0, 1):
        kind, rest = results[rank].split(" after ", 1)
        took = float(rest.split("s", 1)[0])
        if stall:  # alive but silent: the deadline (1 s)
            assert kind == "TimeoutError" and 1.0 <= took < 4.0, results
        else:  # gone: noticed from its pid, well before the 8 s deadline
            assert kind == "RuntimeError" and "exited" in results[rank] and took < 3.0, results


def test_values_it_cannot_carry_are_refused():
    from phalanx.comm.shm_peers import ShmPeers
    agree = ShmAgreement(ShmPeers(0, 1, f"agree{os.getpid()}v"), 1.0)
    assert agree.max([3, 2**32 - 1]) == [3, 2**32 - 1]
    for bad in ([-1], [2**32], [], list(range(9))):
        with pytest.raises(ValueError):
            agree.max(bad)
    agree._peers.close()


def _group_agreement(rank: int, world: int, port: int, root: str) -> tuple:
    """A gloo world's agreement; with `root`, each rank's files in its own folder (a
    machine whose processes do not share /dev/shm)."""
    import phalanx.comm.local_channels as channels
    from phalanx.comm.group_comm import GroupComm
    if root:
        channels.SHM_OPEN_S = 1.0
        shm_peers = channels.ShmPeers
        channels.ShmPeers = lambda *a, **k: shm_peers(*a, root=os.path.join(root, str(rank)), **k)
        os.makedirs(os.path.join(root, str(rank)), exist_ok=True)
    comm = GroupComm.init(rank, world, 1, f"tcp://127.0.0.1:{port}", 1, 20.0)
    try:
        return comm._agreement is not None, comm.all_reduce_world_max(rank, 7 - rank)
    finally:
        comm.destroy()


@pytest.mark.parametrize("split", [False, True], ids=["shared", "split-shm"])
def test_group_comm_agrees_through_shared_memory_or_falls_back_together(split, tmp_path):
    root = str(tmp_path) if split else ""
    results, errors = run_ranks(_group_agreement, 3, (free_port(), root), timeout_s=90)
    assert not errors, errors
    assert results == {r: (not split, [2, 7]) for r in range(3)}, results


def _wake_seen(rank: int, world: int, tag: str) -> int:
    agree = _agreement(rank, world, tag, 30.0)
    before = agree.wakes()  # read by every rank before rank 0 can get past round 1
    agree.max([1])
    agree._peers.close()
    if rank == 0:
        agree.wake()
    else:
        end = time.monotonic() + 30.0
        while agree.wakes() == before and time.monotonic() < end:
            time.sleep(0.001)
    agree.max([2])  # rank 0 stays mapped until the others have looked
    return agree.wakes() - before


def test_a_wake_is_seen_by_every_rank():
    """`wake` on one rank changes `wakes()` on every rank (what idle rank loops watch to
    start their next round at once)."""
    results, errors = run_ranks(_wake_seen, 3, (f"agree{os.getpid()}w",), timeout_s=60)
    assert not errors, errors
    assert results == {0: 1, 1: 1, 2: 1}, results
