"""`ShmCollectives` (CPU tensors' sums, gathers and all-to-alls between the ranks of one
machine) between spawned processes: random rounds give every rank the same bits as the
rank-order reference; a round that does not fit on one rank returns False on every
rank; a rank whose process exits ends its peers' waits at once."""

from __future__ import annotations

import os
import random
import time

import torch

from phalanx.spawn import run_ranks

ROUNDS = 120
CAPACITY = 4096  # bytes per rank and round


def _channel(rank: int, world: int, tag: str, deadline_s: float):
    from phalanx.comm.shm_peers import ShmPeers
    from phalanx.comm.shm_collectives import ShmCollectives
    return ShmCollectives(ShmPeers(rank, world, tag, deadline_s=30.0), CAPACITY, deadline_s)


def _tensor(round_: int, rank: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(round_ * 1000 + rank)
    return torch.randn(shape, generator=g).to(dtype)


def _splits(round_: int, world: int) -> list[list[int]]:
    """rows[src][dst] of round `round_` (some rounds too large for one rank's input)."""
    rng = random.Random(round_)
    top = 40 if round_ % 5 == 0 else 6  # 40 rows x 40 bytes > CAPACITY on most ranks
    return [[rng.randrange(0, top) for _ in range(world)] for _ in range(world)]


def _round(ch, r: int, rank: int, world: int) -> None:
    kind = r % 3
    if kind == 0:  # sum, float32 or bfloat16; some rounds too large for the channel
        dtype = (torch.float32, torch.bfloat16)[r % 2]
        shape = (7, 3) if r % 7 else (40, 40)
        t = _tensor(r, rank, shape, dtype)
        want = _tensor(r, 0, shape, dtype).clone()
        for q in range(1, world):
            want += _tensor(r, q, shape, dtype)
        if ch.all_reduce_sum(t):
            assert torch.equal(t, want), f"round {r}: sum differs"
        else:
            assert shape == (40, 40), f"round {r}: a fitting sum was refused"
    elif kind == 1:  # gather
        t = _tensor(r, rank, (2, 5), torch.float32)
        got = ch.all_gather(t)
        assert all(torch.equal(g, _tensor(r, q, (2, 5), torch.float32)) for q, g in enumerate(got))
    else:  # all-to-all with uneven (and zero) splits, rows of 10 float32
        rows = _splits(r, world)
        send = torch.cat([_tensor(r, rank * world + d, (rows[rank][d], 10), torch.float32)
                          for d in range(world)])
        out = torch.full((sum(rows[s][rank] for s in range(world)), 10), float("nan"))
        fits = [sum(rows[s]) * 40 <= CAPACITY for s in range(world)]
        done = ch.all_to_all(out, send, [rows[s][rank] for s in range(world)], rows[rank])
        assert done == all(fits), f"round {r}: done {done}, fits {fits}"
        if done:
            want = torch.cat([_tensor(r, s * world + rank, (rows[s][rank], 10), torch.float32)
                              for s in range(world)])
            assert torch.equal(out, want), f"round {r}: all-to-all rows differ"


def _rounds(rank: int, world: int, tag: str) -> int:
    ch = _channel(rank, world, tag, 30.0)
    for r in range(ROUNDS):
        _round(ch, r, rank, world)
        if rank == r % world:
            time.sleep(0.001)  # a late rank now and then
    ch._peers.close()
    return ROUNDS


def _one_exits(rank: int, world: int, tag: str) -> str:
    ch = _channel(rank, world, tag, 8.0)
    ch.all_reduce_sum(torch.ones(4))
    ch._peers.close()  # every rank mapped every file: the names can go
    if rank == world - 1:
        os._exit(0)
    t0 = time.monotonic()
    try:
        ch.all_reduce_sum(torch.ones(4))
    except RuntimeError as e:
        return f"{type(e).__name__} after {time.monotonic() - t0:.2f}s: {e}"
    return "no error"


def test_every_rank_gets_the_reference_bits_every_round():
    tag = f"tensors{os.getpid()}a"
    results, errors = run_ranks(_rounds, 3, (tag,), timeout_s=120, torch_threads=1)
    assert not errors, errors
    assert results == {0: ROUNDS, 1: ROUNDS, 2: ROUNDS}


def test_a_rank_that_exits_ends_the_wait():
    tag = f"tensors{os.getpid()}x"
    results, errors = run_ranks(_one_exits, 3, (tag,), timeout_s=60, expect=[0, 1])
    assert not errors, errors
    for rank in (0, 1):
        kind, rest = results[rank].split(" after ", 1)
        assert kind == "RuntimeError" and "exited" in rest, results
        assert float(rest.split("s", 1)[0]) < 3.0, results  # not the 8 s deadline
