"""The per-layer MoE benchmark of `bench/multi_gpu.py` (phase `moe`): layer 0's MoE at
each per-rank token count, `EPDispatcher.moe` with the experts and with an identity
expert, its four all-to-alls through `GroupComm` and through
`torch.distributed.all_to_all_single` directly, and the local expert compute alone."""

from __future__ import annotations

import statistics
import time

import torch

from multi_gpu_procs import log, sync


class _Timer:
    """Host wall time of collective calls; the ranks meet at a barrier before timing."""

    def __init__(self, comm, dev: torch.device, iters: int, warm: int = 3) -> None:
        self.comm, self.dev, self.iters, self.warm = comm, dev, iters, warm

    def _warm_up(self, fn) -> None:
        for _ in range(self.warm):
            fn()
        sync(self.dev)
        self.comm.barrier()

    def median_us(self, fn) -> float:
        """Median of per-call wall times; calls are collective, ranks meet at a barrier."""
        self._warm_up(fn)
        times = []
        for _ in range(self.iters):
            t0 = time.perf_counter()
            fn()
            sync(self.dev)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    def stream_us(self, fn) -> float:
        """Back-to-back calls, one sync at the end (stream-ordered cost per call)."""
        self._warm_up(fn)
        t0 = time.perf_counter()
        for _ in range(self.iters):
            fn()
        sync(self.dev)
        return (time.perf_counter() - t0) / self.iters * 1e6


def _expert_owner(disp, num_experts: int, dev: torch.device) -> torch.Tensor:
    """The rank owning each expert, on `dev`."""
    owner = torch.empty(num_experts, dtype=torch.int64)
    for r, experts in enumerate(disp.experts_of_rank):
        owner[experts] = r
    return owner.to(dev)


def _a2a_buffers(comm, x, ids, owner, k: int, back_send) -> dict:
    """Counts (exchanged once here), split sizes and the send / receive buffers of the
    dispatcher's four all-to-alls for routed pairs `ids` of tokens `x`."""
    dev, (_, H) = x.device, x.shape
    dest = owner[ids.reshape(-1)]
    order = torch.argsort(dest, stable=True)
    send_counts = torch.bincount(dest, minlength=comm.world_size)
    recv_counts = torch.empty_like(send_counts)
    comm.all_to_all_single(recv_counts, send_counts)
    ss, rs = send_counts.tolist(), recv_counts.tolist()
    P, R = sum(ss), sum(rs)
    return dict(send_counts=send_counts, recv_counts=recv_counts, ss=ss, rs=rs, P=P, R=R,
                send_x=x[order // k].contiguous(),
                recv_x=torch.empty((R, H), dtype=x.dtype, device=dev),
                send_meta=torch.zeros((P, 2), dtype=torch.int64, device=dev),
                recv_meta=torch.empty((R, 2), dtype=torch.int64, device=dev),
                back_send=back_send, back_recv=torch.empty((P, H), dtype=x.dtype, device=dev))


def _four_a2a(op, buf: dict, dev: torch.device, sync_each: bool):
    """The four all-to-alls (counts, rows, metadata, return rows) through `op`."""
    ss, rs = buf["ss"], buf["rs"]

    def run():
        op(buf["recv_counts"], buf["send_counts"])
        if sync_each:
            sync(dev)
        op(buf["recv_x"], buf["send_x"], rs, ss)
        if sync_each:
            sync(dev)
        op(buf["recv_meta"], buf["send_meta"], rs, ss)
        if sync_each:
            sync(dev)
        op(buf["back_recv"], buf["back_send"], ss, rs)
    return run


def _wire_bytes(ss: list[int], rs: list[int], row_bytes: int, rank: int) -> dict:
    """Bytes of the four all-to-alls per peer: to rank r go its count (8 B), `ss[r]` rows
    with their (expert, weight) metadata (16 B) and the `rs[r]` rows it sent us, returned;
    from r the mirror image. Lists by peer rank (0 for this rank, whose share stays local)."""
    pairs = list(enumerate(zip(ss, rs)))
    to = [0 if r == rank else 8 + s * (row_bytes + 16) + q * row_bytes for r, (s, q) in pairs]
    frm = [0 if r == rank else 8 + q * (row_bytes + 16) + s * row_bytes for r, (s, q) in pairs]
    P, R, world = sum(ss), sum(rs), len(ss)
    return dict(pairs_sent=P, rows_received=R,
                bytes_sent=P * (row_bytes + 16) + R * row_bytes + 8 * world,
                bytes_to_peers=sum(to), bytes_to_peer=to, bytes_from_peer=frm,
                pairs_to_peer=[0 if r == rank else s for r, s in enumerate(ss)])


def _moe_case(comm, moe, cfg, owner, b: int, opts: dict, dev: torch.device, timer: _Timer) -> dict:
    """Every timing of one per-rank token count `b`."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from phalanx.kernels.moe import route

    ep, rank = moe.ep, comm.rank
    k, H, dtype = cfg.num_experts_per_tok, cfg.hidden_size, moe.w13.dtype
    g = torch.Generator(device=dev)
    g.manual_seed(opts["seed"] + 1000 * rank + b)
    x = torch.randn(b, H, generator=g, device=dev).to(dtype)
    weights, ids = route(F.linear(x, moe.gate), k, cfg.norm_topk_prob, dtype)
    got = {}

    def capture(rx, rids, rw):
        got.update(rx=rx.clone(), rids=rids.clone(), rw=rw.clone())
        return rx

    disp = ep.dispatcher
    padded = opts["ep_exchange"] in ("padded", "peer")  # peer: padded rows, own channels
    disp.step_tokens = None  # the exact exchange's rows: the raw all-to-alls' buffers
    ep.moe(x, weights, ids, capture)
    buf = _a2a_buffers(comm, x, ids, owner, k, got["rx"].contiguous())
    nccl = lambda out, inp, o=None, i=None: dist.all_to_all_single(out, inp, o, i)  # noqa: E731
    ours = lambda out, inp, o=None, i=None: comm.all_to_all_single(out, inp, o, i)  # noqa: E731
    row = dict(batch=b, exchange=opts["ep_exchange"],
               **_wire_bytes(buf["ss"], buf["rs"], H * x.element_size(), rank))
    disp.step_tokens = b if padded else None  # the ranks' batches are equal here

    row["moe_us"] = timer.median_us(lambda: ep.moe(x, weights, ids, moe._experts))
    row["dispatch_combine_us"] = timer.median_us(lambda: ep.moe(x, weights, ids, lambda rx, ri, rw: rx))
    disp.step_tokens = None
    row["a2a_groupcomm_us"] = timer.median_us(_four_a2a(ours, buf, dev, False))
    row["a2a_nccl_sync_each_us"] = timer.median_us(_four_a2a(nccl, buf, dev, True))
    row["a2a_nccl_us"] = timer.median_us(_four_a2a(nccl, buf, dev, False))
    row["a2a_nccl_stream_us"] = timer.stream_us(_four_a2a(nccl, buf, dev, False))
    row["experts_us"] = timer.median_us(lambda: moe._experts(got["rx"], got["rids"], got["rw"]))
    return row


def moe_bench(comm, model, opts: dict, dev: torch.device) -> list[dict]:
    """Per-layer MoE timings of layer 0 at each per-rank token count (see the docstring)."""
    from phalanx.models.qwen3_moe import SparseMoE

    moe = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE))
    owner = _expert_owner(moe.ep.dispatcher, model.cfg.num_experts, dev)
    timer = _Timer(comm, dev, opts["moe_iters"])
    rows = []
    for b in opts["batches"]:
        row = _moe_case(comm, moe, model.cfg, owner, b, opts, dev, timer)
        rows.append(row)
        log(opts, f"  moe batch {b}: full {row['moe_us']:.0f} us, dispatch+combine "
                  f"{row['dispatch_combine_us']:.0f}, 4 a2a ours {row['a2a_groupcomm_us']:.0f} / "
                  f"nccl {row['a2a_nccl_us']:.0f} (stream {row['a2a_nccl_stream_us']:.0f}), "
                  f"experts {row['experts_us']:.0f}")
    return rows
