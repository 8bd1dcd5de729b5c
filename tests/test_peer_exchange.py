"""The peer exchange (comm/peer_exchange.py): an all-to-all through symmetric memory
whose waits spin in device code, run on CPU under Triton's interpreter (in a subprocess:
TRITON_INTERPRET must be set before triton is imported) over a world simulated in one
process (`LocalWorld`).

- blocks land bit for bit where `all_to_all_single` would put them, over several
  exchanges of one channel (each with its own sequence number), full or cut by counts;
- a peer that never sends: the wait ends after its spin bound (or at once when the host
  raises the abort word from another thread, or when the watchdog does at the deadline),
  only that source is marked failed, and `settle` raises CollectiveError; an earlier
  exchange's flags never satisfy a later wait; finished waits are never aborted later;
- the padded MoE through two channels equals the single-rank reference, with ranks as
  processes sharing /dev/shm (`ShmPeers`), one rank with no tokens.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

import pytest
from interpreter_checks import checks_in, print_results, run_checks, run_module


def _world(world: int, max_rows: int = 32, width: int = 64, dtype=None, max_spins: int = 400):
    import torch
    from phalanx.comm.peer_exchange import PeerExchange
    from phalanx.comm.peer_memory import LocalWorld
    lw = LocalWorld(world)
    return [PeerExchange(lw.rank(r), "ch", max_rows=max_rows, width=width,
                         dtype=dtype or torch.bfloat16, max_spins=max_spins)
            for r in range(world)]


def check_blocks_land_where_all_to_all_puts_them() -> dict:
    import torch
    g = torch.Generator().manual_seed(1)
    cases = 0
    for world, cap, W, dtype in [(1, 5, 7, torch.float32), (2, 16, 64, torch.bfloat16),
                                 (3, 20, 40, torch.bfloat16), (4, 33, 9, torch.int64)]:
        ex = _world(world, max_rows=40, width=64, dtype=dtype)
        for rnd in range(4):  # full blocks, counts, counts with empty blocks, full again
            sends = [(torch.randn(world * cap, W, generator=g) * 100).to(dtype)
                     for _ in range(world)]
            counts = [None] * world
            if rnd in (1, 2):
                hi = cap + 1 if rnd == 1 else 2
                counts = [torch.randint(0, hi, (world,), generator=g) for _ in range(world)]
            for r in range(world):
                ex[r].put(sends[r], counts[r])
            recvs = [ex[r].wait().clone() for r in range(world)]
            for d in range(world):
                for s in range(world):
                    n = cap if counts[s] is None else int(counts[s][d])
                    got = recvs[d][s * cap:s * cap + n]
                    if not torch.equal(got, sends[s][d * cap:d * cap + n]):
                        return {"error": f"world {world} round {rnd}: block {s}->{d} differs"}
                    if int(ex[d].recv_counts[s]) != n:
                        return {"error": f"world {world} round {rnd}: count {s}->{d} "
                                         f"{int(ex[d].recv_counts[s])} != {n}"}
            if any(e.failed() for e in ex):
                return {"error": f"world {world} round {rnd}: a wait failed"}
            cases += 1
    return {"cases": cases}


def check_missing_peer_fails_only_its_block_and_settle_raises() -> dict:
    import torch
    from phalanx.comm.group_comm import CollectiveError
    ex = _world(3, max_spins=300)
    sends = [torch.ones(3 * 8, 16, dtype=torch.bfloat16) * (r + 1) for r in range(3)]
    for r in range(3):  # one good exchange: rank 2's flags now hold sequence 1
        ex[r].exchange(sends[r]) if r == 2 else ex[r].put(sends[r])
    for r in range(2):
        ex[r].wait()
    if any(e.failed() for e in ex):
        return {"error": "the first exchange failed"}
    for r in range(2):  # the second: rank 2 never sends
        ex[r].put(sends[r] * 2)
    t0 = time.monotonic()
    recv = ex[0].wait()
    took = time.monotonic() - t0
    status = ex[0].status.tolist()
    if status != [0, 0, 1]:
        return {"error": f"status {status}, want only source 2 failed (stale flags taken?)"}
    if not torch.equal(recv[8:16], sends[1][:8] * 2):
        return {"error": "rank 1's block did not land beside the missing one"}
    try:
        ex[0].settle(1.0)
    except CollectiveError as e:
        return {"took_s": took, "raised": str(e)}
    return {"error": "settle did not raise after a failed wait"}


def check_host_abort_ends_a_spinning_wait() -> dict:
    import torch
    ex = _world(2, max_spins=2**31 - 1)
    ex[0].put(torch.zeros(2 * 4, 8, dtype=torch.bfloat16))
    timer = threading.Timer(0.5, ex[0].abort)
    timer.start()
    t0 = time.monotonic()
    ex[0].wait()
    took = time.monotonic() - t0
    timer.join()
    if ex[0].status.tolist() != [0, 1]:
        return {"error": f"status {ex[0].status.tolist()}, want [0, 1]"}
    if not 0.4 < took < 30:
        return {"error": f"wait took {took:.2f} s with the abort raised at 0.5 s"}
    return {"took_s": took}


def check_watchdog_aborts_a_pending_wait_and_spares_finished_ones() -> dict:
    import torch
    from phalanx.comm.peer_exchange import PeerExchange
    from phalanx.comm.peer_memory import LocalWorld
    lw = LocalWorld(2)
    ex = [PeerExchange(lw.rank(r), "ch", 4, 8, torch.bfloat16, max_spins=2**31 - 1,
                       deadline_s=0.3) for r in range(2)]
    rows = torch.ones(8, 8, dtype=torch.bfloat16)
    for _ in range(2):  # finished waits, left unsettled past the deadline: no abort
        for e in ex:
            e.put(rows)
        for e in ex:
            e.wait()
        time.sleep(0.5)
    if any(e.failed() for e in ex):
        return {"error": "a finished wait was aborted by the watchdog"}
    ex[0].put(rows)  # rank 1 never sends: the watchdog ends the spinning wait
    t0 = time.monotonic()
    ex[0].wait()
    took = time.monotonic() - t0
    if ex[0].status.tolist() != [0, 1] or not 0.25 < took < 30:
        return {"error": f"status {ex[0].status.tolist()} after {took:.2f} s, want [0, 1] "
                         "after ~0.3 s"}
    return {"took_s": took}


def check_channels_sharing_an_abort_word_end_together() -> dict:
    """A step's dispatch and combine share one abort word: once the watchdog ends one
    channel's wait, the other's waits end at once (not one deadline each)."""
    import torch
    from phalanx.comm.peer_exchange import PeerExchange, new_abort_word
    from phalanx.comm.peer_memory import LocalWorld
    lw, word = LocalWorld(2), new_abort_word(torch.device("cpu"))
    a, b = (PeerExchange(lw.rank(0), name, 4, 8, torch.bfloat16, max_spins=2**31 - 1,
                         deadline_s=0.3, abort_word=word) for name in ("a", "b"))
    rows = torch.ones(8, 8, dtype=torch.bfloat16)
    a.exchange(rows)  # rank 1 never sends: the watchdog ends it
    t0 = time.monotonic()
    b.exchange(rows)
    took = time.monotonic() - t0
    if not (a.failed() and b.failed()) or took > 0.25:
        return {"error": f"failed {a.failed()}, {b.failed()}; the second wait took {took:.2f} s"}
    return {"second_wait_s": took}


def check_bad_calls_are_refused() -> dict:
    import torch
    ex = _world(2, max_rows=8, width=16)[0]
    bad = {
        "cap over max_rows": lambda: ex.put(torch.zeros(2 * 9, 16, dtype=torch.bfloat16)),
        "rows not a multiple of world": lambda: ex.put(torch.zeros(3, 16, dtype=torch.bfloat16)),
        "too wide": lambda: ex.put(torch.zeros(4, 17, dtype=torch.bfloat16)),
        "dtype": lambda: ex.put(torch.zeros(4, 16)),
        "counts shape": lambda: ex.put(torch.zeros(4, 16, dtype=torch.bfloat16),
                                       torch.zeros(3, dtype=torch.int64)),
    }
    for name, call in bad.items():
        try:
            call()
        except ValueError:
            continue
        return {"error": f"{name}: accepted"}
    try:
        ex.wait()
    except RuntimeError:
        return {"refused": len(bad) + 1}
    return {"error": "wait without put: accepted"}


_MOE = dict(world=3, E=8, k=2, H=16, I=8, tokens=[5, 0, 3])  # rank 1 runs a dummy step


def _moe_inputs():
    import torch
    c = _MOE
    g = torch.Generator().manual_seed(3)
    w13 = torch.randn(c["E"], 2 * c["I"], c["H"], generator=g) * 0.3
    w2 = torch.randn(c["E"], c["H"], c["I"], generator=g) * 0.3
    xs = [torch.randn(t, c["H"], generator=g) for t in c["tokens"]]
    ids = [torch.stack([torch.randperm(c["E"], generator=g)[:c["k"]] for _ in range(t)])
           if t else torch.zeros(0, c["k"], dtype=torch.int64) for t in c["tokens"]]
    wts = [torch.rand(t, c["k"], generator=g) for t in c["tokens"]]
    return w13, w2, xs, ids, wts


def _moe_rank(r: int, tag: str, out) -> None:
    """One rank process: the padded MoE of its tokens through shared-memory exchanges."""
    try:
        import torch
        from types import SimpleNamespace
        from phalanx.comm.dispatch import EPDispatcher, make_expert_placement
        from phalanx.kernels.moe import fused_experts_ref
        from phalanx.comm.peer_exchange import PeerExchange
        from phalanx.comm.shm_peers import ShmPeers
        c = _MOE
        w13, w2, xs, ids, wts = _moe_inputs()
        owner, local_index, experts_of_rank = make_expert_placement(c["E"], c["world"])
        peers = ShmPeers(r, c["world"], tag)
        d = EPDispatcher(SimpleNamespace(rank=r, world_size=c["world"]), c["E"], owner,
                         local_index)
        d.step_tokens = max(c["tokens"])
        channels = [PeerExchange(peers, f"{name}{lane}", 16, width, torch.float32,
                                 max_spins=10**7)
                    for lane in range(2) for name, width in (("dispatch", c["H"] + 4),
                                                             ("combine", c["H"]))]
        d.use_peer_exchanges(*channels)  # two lanes: each micro-batch its own pair
        a, b = w13[experts_of_rank[r]], w2[experts_of_rank[r]]
        ys = []
        for lane in (1, 0):
            d.lane = lane
            ys.append(d.moe(xs[r], wts[r], ids[r], lambda x, lid, w: fused_experts_ref(
                x, w[:, None], lid[:, None], a, b)))
        failed = any(ex.failed() for ex in channels)
        failed |= not all(ex.exchanges == 1 for ex in channels)  # each lane its own pair
        peers.close()
        out.put((r, ys[0].tolist(), failed or not torch.equal(ys[0], ys[1]), None))
    except Exception:
        out.put((r, None, True, traceback.format_exc()))


def check_padded_moe_through_shared_memory_ranks_equals_reference() -> dict:
    """Rank processes (spawned) exchanging through /dev/shm, as the CPU path runs; the
    same layer through the second lane's channels, then the first's, gives the same rows."""
    import multiprocessing as mp
    import torch
    from phalanx.comm.dispatch import moe_reference
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    tag = f"test{os.getpid()}"
    procs = [ctx.Process(target=_moe_rank, args=(r, tag, out)) for r in range(_MOE["world"])]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            r, y, failed, err = out.get(timeout=240)
            if err or failed:
                return {"error": f"rank {r}: {err or 'a wait failed'}"}
            got[r] = torch.tensor(y).reshape(-1, _MOE["H"])
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    w13, w2, xs, ids, wts = _moe_inputs()
    err = 0.0
    for r, t in enumerate(_MOE["tokens"]):
        if t:
            ref = moe_reference(xs[r], wts[r], ids[r], w13, w2)
            err = max(err, float((got[r] - ref).abs().max() / ref.abs().max()))
        elif got[r].numel():
            return {"error": f"rank {r} had no tokens but got {tuple(got[r].shape)}"}
    return {"err": err} if err < 1e-5 else {"error": f"relative error {err:.2e}"}


def check_rehearsal_runs_a_rank_alone_and_restores_its_channels() -> dict:
    """`EPDispatcher.rehearsal`: rank 0 of a world whose other ranks never act runs its
    padded MoE through stand-in channels (each wait gives up at once, results garbage),
    and its real channels come back untouched: no exchange counted, no failure, no flag
    raised in any rank's buffers."""
    import torch
    from types import SimpleNamespace
    from phalanx.comm.dispatch import EPDispatcher, make_expert_placement
    from phalanx.comm.peer_exchange import PeerExchange
    from phalanx.comm.peer_memory import LocalWorld
    c = _MOE
    w13, w2, xs, ids, wts = _moe_inputs()
    owner, local_index, experts_of_rank = make_expert_placement(c["E"], c["world"])
    lw = LocalWorld(c["world"])
    real = (PeerExchange(lw.rank(0), "dispatch", 16, c["H"] + 4, torch.float32, max_spins=10**7),
            PeerExchange(lw.rank(0), "combine", 16, c["H"], torch.float32, max_spins=10**7))
    d = EPDispatcher(SimpleNamespace(rank=0, world_size=c["world"]), c["E"], owner, local_index)
    d.step_tokens = max(c["tokens"])
    d.use_peer_exchanges(*real)
    a, b = w13[experts_of_rank[0]], w2[experts_of_rank[0]]
    t0 = time.monotonic()
    with d.rehearsal():
        stand_ins = d._peer
        y = d.moe(xs[0], wts[0], ids[0], lambda x, lid, w: x * 0)
    took = time.monotonic() - t0
    if stand_ins[0][0] is real[0] or d._peer != (real,):
        return {"error": "the rehearsal did not swap the channels in and back"}
    if tuple(y.shape) != tuple(xs[0].shape):
        return {"error": f"output {tuple(y.shape)}, expected {tuple(xs[0].shape)}"}
    if any(ex.exchanges or ex.failed() for ex in real):
        return {"error": "the real channels were used"}
    if any(int(lw.rank(0).world._buffers[f"{n}.flags"][r].abs().sum())
           for n in ("dispatch", "combine") for r in range(c["world"])):
        return {"error": "a flag was raised in the real buffers"}
    if not all(ex.failed() for ex in stand_ins[0]):
        return {"error": "a stand-in wait saw a block"}
    return {"seconds": round(took, 2)}


if __name__ == "__main__":
    print_results(run_checks(globals()))
    sys.exit(0)

# ---------------------------------------------------------------- pytest side

CHECKS = checks_in(globals())


@pytest.fixture(scope="module")
def results() -> dict:
    return run_module(__file__, workers=1)  # its checks time their waits: one core each


@pytest.mark.parametrize("name", CHECKS)
def test_peer_exchange(results, name):
    res = results[name]
    assert "error" not in res, res.get("error")
