"""`ShmBroadcast` (a TP group's step plans through shared memory) between spawned
processes: every round's words arrive whole and in order, rounds that do not fit (too
many words, values out of range) are reported as going another way on every rank, and a
root that exits ends the readers' waits at once."""

from __future__ import annotations

import os
import time

import numpy as np

from free_ports import free_port
from phalanx.comm.shm_broadcast import ShmBroadcast
from phalanx.spawn import run_ranks

ROUNDS, CAPACITY = 200, 64


def _words(round_: int) -> np.ndarray:
    rng = np.random.default_rng(round_)
    n = int(rng.integers(0, CAPACITY + 8))  # some rounds do not fit
    words = rng.integers(0, 2**32 - 1, n, dtype=np.int64)
    if round_ % 17 == 5 and n:
        words[0] = -1  # out of range: goes another way
    return words


def _fits(words: np.ndarray) -> bool:
    return len(words) <= CAPACITY and (len(words) == 0 or int(words.min()) >= 0)


def _channel(rank: int, world: int, tag: str) -> ShmBroadcast:
    from phalanx.comm.shm_peers import ShmPeers
    channel = ShmBroadcast(ShmPeers(rank, world, tag), CAPACITY, 5.0)
    return channel


def _rounds(rank: int, world: int, tag: str) -> int:
    channel = _channel(rank, world, tag)
    for r in range(ROUNDS):
        want = _words(r)
        if rank == 0:
            if channel.publish(want) != _fits(want):
                raise AssertionError(f"round {r}: publish said the wrong thing")
            if r % 13 == 0:
                time.sleep(0.002)  # readers wait for a late root
        else:
            got = channel.receive()
            if (got is None) == _fits(want) or (got is not None and not np.array_equal(got, want)):
                raise AssertionError(f"round {r}: got {got}, want {want if _fits(want) else None}")
    channel._peers.close()
    return ROUNDS


def _root_exits(rank: int, world: int, tag: str) -> str:
    channel = _channel(rank, world, tag)
    if rank == 0:
        channel.publish(np.arange(3, dtype=np.int64))
        channel._peers.close()
        os._exit(0)
    channel.receive()
    channel._peers.close()
    t0 = time.monotonic()
    try:
        channel.receive()
    except RuntimeError as e:
        return f"RuntimeError after {time.monotonic() - t0:.2f}s: {e}"
    return "no error"


def test_every_round_arrives_whole_or_goes_another_way_on_every_rank():
    results, errors = run_ranks(_rounds, 3, (f"bcast{os.getpid()}",), timeout_s=120)
    assert not errors, errors
    assert results == {0: ROUNDS, 1: ROUNDS, 2: ROUNDS}


def test_a_root_that_exits_ends_the_readers_waits():
    results, errors = run_ranks(_root_exits, 3, (f"bcast{os.getpid()}x",), timeout_s=60,
                                expect=[1, 2])
    assert not errors, errors
    for rank in (1, 2):
        assert results[rank].startswith("RuntimeError") and "exited" in results[rank], results
        assert float(results[rank].split(" after ")[1].split("s")[0]) < 3.0, results


def _tp_plans(rank: int, world: int, port: int) -> list:
    from phalanx.comm.group_comm import GroupComm
    comm = GroupComm.init(rank, world, 2, f"tcp://127.0.0.1:{port}", 1, 20.0)
    try:
        got = [comm.open_tp_channel(16)]
        for words in (np.arange(5, dtype=np.int64) + 10 * comm.dp_rank,
                      np.arange(40, dtype=np.int64)):  # the second does not fit
            got.append(None if (out := comm.share_tp(words if comm.tp_rank == 0 else None))
                       is None else out.tolist())
        return got
    finally:
        comm.destroy()


def test_group_comm_tp_leaders_share_plans_through_shared_memory():
    results, errors = run_ranks(_tp_plans, 4, (free_port(),), timeout_s=90)
    assert not errors, errors
    for rank, got in results.items():  # dp rank r's TP group: [10r, 10r + 5)
        assert got == [True, list(range(10 * (rank // 2), 10 * (rank // 2) + 5)), None], got
