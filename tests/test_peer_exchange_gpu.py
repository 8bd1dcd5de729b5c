"""The peer exchange on a GPU (GPU machine only; the CPU runs are in
test_peer_exchange.py): a world simulated on one GPU, each rank a stream, so the waits
spin in device code while the other ranks' stores land; the host's abort word, and the
watchdog alone, ending a wait whose peer never sends (finished waits spared); one NVSHMEM
process exchanging with itself; two ranks' MoE layers queued from one thread with no
host sync; and two processes (on two GPUs, or sharing one) exchanging through NVSHMEM
(two GPUs only) and CUDA IPC, with a peer that dies."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _ranks(world: int, max_rows: int, width: int):
    from phalanx.comm.peer_exchange import PeerExchange
    from phalanx.comm.peer_memory import LocalWorld
    lw = LocalWorld(world, "cuda")
    return [PeerExchange(lw.rank(r), "ch", max_rows, width, torch.bfloat16) for r in range(world)]


@pytest.mark.parametrize("world,cap,width", [(2, 1024, 2056), (4, 130, 2056), (8, 16, 136)])
def test_blocks_land_on_one_gpu_with_ranks_on_streams(world, cap, width):
    ex = _ranks(world, cap, width)
    streams = [torch.cuda.Stream() for _ in range(world)]
    g = torch.Generator(device="cuda").manual_seed(world)
    for rnd in range(3):
        sends = [torch.randn(world * cap, width, device="cuda", generator=g).bfloat16()
                 for _ in range(world)]
        counts = [torch.randint(0, cap + 1, (world,), device="cuda", generator=g)
                  if rnd == 1 else None for _ in range(world)]
        torch.cuda.synchronize()
        recvs = []
        for r in range(world):  # every put before any wait (streams may share a queue)
            with torch.cuda.stream(streams[r]):
                ex[r].put(sends[r], counts[r])
        for r in range(world):
            with torch.cuda.stream(streams[r]):
                recvs.append(ex[r].wait().clone())
        torch.cuda.synchronize()
        for d in range(world):
            assert not ex[d].failed()
            for s in range(world):
                n = cap if counts[s] is None else int(counts[s][d])
                assert int(ex[d].recv_counts[s]) == n
                assert torch.equal(recvs[d][s * cap:s * cap + n], sends[s][d * cap:d * cap + n]), \
                    f"round {rnd}: block {s}->{d}"


def test_abort_word_ends_a_wait_whose_peer_never_sends():
    from phalanx.comm.group_comm import CollectiveError
    ex = _ranks(2, 64, 256)
    ex[0].put(torch.ones(128, 256, dtype=torch.bfloat16, device="cuda"))
    ex[0].wait()
    t0 = time.monotonic()
    with pytest.raises(CollectiveError):
        ex[0].settle(0.3)
    took = time.monotonic() - t0
    assert ex[0].status.tolist() == [0, 1]
    assert took < 5.0, f"settle took {took:.2f} s with a 0.3 s deadline"
    assert float(torch.ones(4, device="cuda").sum()) == 4.0  # the GPU goes on


def test_watchdog_aborts_a_pending_wait_and_spares_finished_ones():
    """deadline_s: a wait whose event is still pending at the deadline is aborted (the
    host never syncs here: the watchdog thread alone ends the spin); waits that finished
    are not, though nothing settled them."""
    from phalanx.comm.peer_exchange import PeerExchange
    from phalanx.comm.peer_memory import LocalWorld
    lw = LocalWorld(2, "cuda")
    ex = [PeerExchange(lw.rank(r), "ch", 64, 256, torch.bfloat16, deadline_s=0.3)
          for r in range(2)]
    streams = [torch.cuda.Stream() for _ in range(2)]
    rows = torch.ones(128, 256, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    for _ in range(2):
        for e, st in zip(ex, streams):
            with torch.cuda.stream(st):
                e.put(rows)
        for e, st in zip(ex, streams):
            with torch.cuda.stream(st):
                e.wait()
        torch.cuda.synchronize()
        time.sleep(0.5)
    assert not any(e.failed() for e in ex)
    ex[0].put(rows)
    ex[0].wait()
    t0 = time.monotonic()
    torch.cuda.synchronize()  # returns only once the watchdog raised the abort word
    took = time.monotonic() - t0
    assert ex[0].status.tolist() == [0, 1]
    assert took < 10, f"the pending wait ended after {took:.1f} s with a 0.3 s deadline"


_NVSHMEM_ONE_PE = """
import torch
from phalanx.comm.gpu.nvshmem_peers import NvshmemPeers
from phalanx.comm.peer_exchange import PeerExchange
torch.cuda.set_device(0)
peers = NvshmemPeers(0, 1, torch.device("cuda", 0), broadcast=lambda t: t, barrier=lambda: None)
ex = PeerExchange(peers, "ch", 32, 64, torch.bfloat16)
for rnd in range(3):
    send = torch.randn(32, 64, device="cuda").bfloat16()
    got = ex.exchange(send).clone()
    ex.settle(5.0)
    assert torch.equal(got, send), rnd
peers.close()
print("NVSHMEM_OK")
"""


def test_nvshmem_world_of_one_exchanges_with_itself():
    pytest.importorskip("nvshmem.core")
    proc = subprocess.run([sys.executable, "-c", _NVSHMEM_ONE_PE], capture_output=True,
                          text=True, timeout=120)
    assert "NVSHMEM_OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def _peer_rank(rank: int, port: int, backend: str, out) -> None:
    """One process per rank, on GPU `rank % device_count` (both on one GPU where it is
    alone), symmetric memory over `backend` ("nvshmem" or "ipc") joined over gloo: three
    exchanges checked against the peer's (seeded) rows, then rank 1 exits before its
    fourth put, and rank 0's step must end with CollectiveError at its deadline."""
    import os
    import traceback
    try:
        from phalanx.comm.group_comm import CollectiveError, GroupComm
        from phalanx.comm.peer_exchange import PeerExchange
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        comm = GroupComm.init(rank, 2, 1, f"tcp://127.0.0.1:{port}", 1, 30.0)
        if backend == "nvshmem":
            from phalanx.comm.gpu.nvshmem_peers import NvshmemPeers
            peers = NvshmemPeers(rank, 2, device, comm.broadcast_world, comm.barrier)
        else:
            from phalanx.comm.gpu.ipc_peers import CudaIpcPeers
            peers = CudaIpcPeers(rank, 2, device, comm.broadcast_world, comm.barrier)
        ex = PeerExchange(peers, "ch", 256, 2056, torch.bfloat16, epoch=1, deadline_s=2.0)

        def rows(r: int, rnd: int) -> torch.Tensor:
            g = torch.Generator(device="cuda").manual_seed(100 * rnd + r)
            return torch.randn(2 * 256, 2056, device="cuda", generator=g).bfloat16()

        for rnd in range(3):
            got = ex.exchange(rows(rank, rnd)).clone()
            ex.settle(10.0)
            for s in range(2):
                want = rows(s, rnd)[rank * 256:(rank + 1) * 256]
                if not torch.equal(got[s * 256:(s + 1) * 256], want):
                    out.put((rank, f"round {rnd}: block from {s} differs"))
                    return
            comm.barrier()  # a lone channel: the peer's next put waits for this read
        if rank == 1:
            out.put((rank, "ok"))
            out.close()
            out.join_thread()  # the message is written before the process dies
            os._exit(0)  # dies before its fourth put
        ex.exchange(rows(rank, 3))
        t0 = time.monotonic()
        try:
            ex.settle(2.0)
            out.put((rank, "settle did not raise with the peer gone"))
        except CollectiveError:
            took = time.monotonic() - t0
            out.put((rank, "ok" if took < 10 else f"settle took {took:.1f} s"))
    except Exception:
        out.put((rank, traceback.format_exc()))


@pytest.mark.parametrize("backend", ["nvshmem", "ipc"])
def test_two_processes_exchange_and_a_dead_peer_ends_the_step(backend):
    import multiprocessing as mp
    from free_ports import free_port
    if backend == "nvshmem":
        pytest.importorskip("nvshmem.core")
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_peer_rank, args=(r, port, backend, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()
    assert got == {0: "ok", 1: "ok"}, got


def test_padded_moe_through_peer_exchanges_queues_without_host_syncs():
    """Two ranks' MoE layers (bf16, Triton experts) through peer exchanges on one GPU,
    queued one rank after the other from one host thread (after every kernel of a layer
    was launched once without peers): possible only if nothing in a layer waits for the
    device (rank 0's waits need rank 1's stores, queued later), and checked with torch's
    sync debug mode set to raise. Equals the single-rank reference."""
    from types import SimpleNamespace

    from phalanx.comm.dispatch import EPDispatcher, make_expert_placement, moe_reference
    from phalanx.kernels.moe import fused_experts
    from phalanx.comm.peer_exchange import PeerExchange
    from phalanx.comm.peer_memory import LocalWorld
    world, E, k, H, I = 2, 16, 4, 128, 64
    g = torch.Generator(device="cuda").manual_seed(7)
    dt = torch.bfloat16
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.05).to(dt)
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) * 0.05).to(dt)
    owner, local_index, experts_of_rank = make_expert_placement(E, world)
    lw = LocalWorld(world, "cuda")
    tokens = [6, 3]
    xs = [torch.randn(t, H, device="cuda", generator=g).to(dt) for t in tokens]
    ids = [torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(t)])
           for t in tokens]
    wts = [torch.rand(t, k, device="cuda", generator=g).to(dt) for t in tokens]
    ranks = []
    for r in range(world):
        d = EPDispatcher(SimpleNamespace(rank=r, world_size=world), E, owner, local_index)
        d.step_tokens = max(tokens)
        d.use_peer_exchanges(*(PeerExchange(lw.rank(r), name, 8 * k, width, dt, deadline_s=10.0)
                               for name, width in (("d", H + 8), ("c", H))))
        mine = experts_of_rank[r]
        compute = (lambda a, b: lambda x, lid, w: fused_experts(x, w[:, None], lid[:, None], a, b)
                   )(w13[mine].contiguous(), w2[mine].contiguous())
        ranks.append((d, compute, torch.cuda.Stream()))
    def layer(r: int) -> None:
        d, compute, stream = ranks[r]
        with torch.cuda.stream(stream):
            outs[r] = d.moe(xs[r], wts[r], ids[r], compute)

    # CUDA loads a kernel on its first launch, and a load may wait for the device to go
    # idle: in one process, with rank 0's wait spinning for rank 1's stores not queued
    # yet, that stalls. So every kernel of a layer is launched once first, without
    # peers: each rank's experts at the round's shapes, the rest in a world of one.
    rows = world * max(tokens) * k
    for r, (_, compute, _) in enumerate(ranks):
        n = len(experts_of_rank[r])
        compute(torch.zeros(rows, H, device="cuda", dtype=dt),
                torch.randint(-1, n, (rows,), device="cuda"), torch.ones(rows, device="cuda", dtype=dt))
    alone = EPDispatcher(SimpleNamespace(rank=0, world_size=1), E, [0] * E, list(range(E)))
    alone.step_tokens = max(tokens)
    alone.use_peer_exchanges(*(PeerExchange(LocalWorld(1, "cuda").rank(0), name, 8 * k, width, dt)
                               for name, width in (("d", H + 8), ("c", H))))
    alone.moe(xs[0], wts[0], ids[0], lambda x, lid, w: fused_experts(x, w[:, None], lid[:, None],
                                                                      w13, w2))
    for rnd in range(2):  # one thread, one rank after the other: nothing may wait for the device
        outs = [None] * world
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for r in range(world):
                layer(r)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        for d, _, _ in ranks:
            d._peer[0].settle(5.0)
            d._peer[1].settle(5.0)
        for r in range(world):
            ref = moe_reference(xs[r].float(), wts[r].float(), ids[r], w13.float(), w2.float())
            err = float((outs[r].float() - ref).abs().max() / ref.abs().max())
            assert err < 3e-2, f"round {rnd} rank {r}: relative error {err:.3e}"
