"""KV transfer throughput: a whole request's KV moved through the resharding planner and
the ucxx transport, against raw ucxx send/recv of the same bytes in the same run.

    python bench/kv_transfer.py [--device cpu|cuda] [--tokens 2048,8192] [--reps 3]
                                [--layouts 1-1,2-1] [--staging 3] [--payload-mib 32]
                                [--tls ...] [--ucx-env K=V,...] [--no-nccl]

Shape: Qwen3-30B-A3B-like KV, 48 layers, 4 KV heads, head_dim 128, 2-byte elements
(int16 stands in for bf16 on CPU; bf16 on GPU), page 16 on both sides, pages of the
request shuffled in both pools. Layout `P-D`: prefill TP=P (P sender processes, one per
rank) -> one decode rank with TP=D=1 (one receiver process). Every process pins torch to
one thread. The spawned processes get UCX_TLS=--tls (default cpu: tcp,sm,self; cuda:
cuda_copy,cuda_ipc,tcp,sm,self) and on cpu, by default, 512 KiB tcp segments (--ucx-env;
'' keeps UCX's 8 KiB, a far slower wire on loopback); on cuda no extra UCX variables.

--device cuda (helpers in `kv_transfer_gpu`): sender rank r keeps its pools and raw
buffers on cuda:r, the receiver on cuda:P (each process binds its GPU before ucxx starts);
a layout needing more GPUs than visible is skipped with a message (2 GPUs: only 1-1).
Every transfer is then device memory to device memory, raw baselines included.

Per (layout, tokens), in the same processes and over the same UCX worker:
- raw: each sender sends its share of the bytes as one buffer on its own endpoint and
  waits for a 1-byte reply once the receiver has it (no gather, no scatter);
- raw_layers: the same bytes as 48 messages (one per layer), all posted at once, the
  receiver keeping `--staging` receives posted (the transport's message pattern without
  planner, gather, scatter, control messages or acks);
- pipelined: each sender streams every layer with `KVSender.send_layer` (the copies of
  one layer as `planner.Copy` lists, encoded inside), all layers submitted at once; the
  transport coalesces the backlog into messages of up to the receiver's
  `--payload-mib` (32 MiB) and keeps `--staging` of them in flight; done when every ack
  is in;
- sequential: the same, one layer at a time (each waits for the previous ack);
- nccl (cuda only, --no-nccl to leave out): the raw pattern through torch.distributed
  NCCL send/recv between the same processes' GPUs (one buffer per sender, 1-byte reply).
Time: from a start instant all senders wait for (CLOCK_MONOTONIC, shared on one host)
to the last sender's end; best of `--reps` after one warm-up. The receiver checks the
landed slot counts after every run. Planning is done before timing (reported apart).
Prints a table last and writes JSON to $OUT/kv_transfer.json (or ./kv_transfer.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import resource
import time
from functools import lru_cache

import numpy as np
import torch

import kv_transfer_gpu as gpu

LAYERS, KV_HEADS, HEAD_DIM, PAGE = 48, 4, 128, 16
START_DELAY_S = 0.3
MODES = ("raw", "raw_layers", "pipelined", "sequential")
# UCX's tcp transport moves 8 KiB segments by default: ~1.5 GB/s on loopback; 512 KiB
# segments ~4-5 GB/s (raw and transport alike)
TCP_TUNING = "UCX_TCP_TX_SEG_SIZE=512k,UCX_TCP_RX_SEG_SIZE=512k"
DEFAULT_TLS = {"cpu": "tcp,sm,self", "cuda": "cuda_copy,cuda_ipc,tcp,sm,self"}
DEFAULT_UCX_ENV = {"cpu": TCP_TUNING, "cuda": ""}


def _layouts(p: int, d: int):
    from phalanx.kv_transfer.layout import KVLayout
    return (KVLayout(p, KV_HEADS, PAGE, HEAD_DIM, LAYERS, 2),
            KVLayout(d, KV_HEADS, PAGE, HEAD_DIM, LAYERS, 2))


def _pages(num_pages: int, tokens: int, seed: int) -> list[int]:
    need = -(-tokens // PAGE)
    return [int(x) for x in np.random.default_rng(seed).permutation(num_pages)[:need]]


def _pools(num_pages: int, heads: int, fill: bool, dev: torch.device):
    shape = (num_pages, heads, PAGE, HEAD_DIM)

    def make() -> torch.Tensor:
        if dev.type == "cuda":  # bf16 as in the engine
            return (torch.randn if fill else torch.zeros)(shape, dtype=torch.bfloat16,
                                                          device=dev)
        if fill:
            return torch.randint(-30000, 30000, shape, dtype=torch.int16)
        return torch.zeros(shape, dtype=torch.int16)

    pools = [(make(), make()) for _ in range(LAYERS)]
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return pools


def _buf(nbytes: int, dev: torch.device):
    """A raw-mode byte buffer: numpy on CPU, a device tensor on CUDA (ucxx takes both)."""
    if dev.type == "cpu":
        return np.ones(nbytes, dtype=np.uint8)
    buf = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize(dev)
    return buf


def _set_env(args: dict, gpu_index: int) -> torch.device:
    """Environment of a spawned process; on cuda binds it to cuda:gpu_index (before ucxx
    starts and before anything is allocated)."""
    os.environ.update({"UCX_TLS": args["tls"], "UCX_SOCKADDR_TLS_PRIORITY": "tcp",
                       "UCX_WARN_UNUSED_ENV_VARS": "n", **args["ucx_env"]})
    torch.set_num_threads(1)
    if args["device"] != "cuda":
        return torch.device("cpu")
    dev = gpu.bind(gpu_index)
    if args["nccl"]:
        gpu.nccl_init(gpu_index, args["p"] + 1, args["nccl_port"], dev)
    return dev


async def _recv_cmd(pipe):
    return await asyncio.get_running_loop().run_in_executor(None, pipe.recv)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _profiled(args, role: str, fn) -> None:
    """Run `fn`; with --profile, under cProfile, top functions to $OUT/profile_<role>.txt."""
    if not args.get("profile"):
        return fn()
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    try:
        return prof.runcall(fn)
    finally:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
        path = os.path.join(os.environ.get("OUT", "."), f"profile_{role}.txt")
        with open(path, "w") as f:
            f.write(out.getvalue())


async def _sleep_until(t: float) -> None:
    await asyncio.sleep(max(t - time.monotonic(), 0))


# ----------------------------------------------------------------------- receiver

def receiver_main(pipe, args) -> None:
    dev = _set_env(args, args["p"])
    try:
        _profiled(args, "receiver", lambda: asyncio.run(_receiver(pipe, args, dev)))
    finally:
        if args["nccl"]:
            gpu.nccl_close()


async def _receiver(pipe, args, dev: torch.device) -> None:
    from phalanx.kv_transfer.transport import KVReceiver, ensure_ucx, shutdown_ucx
    ucxx = ensure_ucx(args["progress"])
    num_pages = -(-args["max_tokens"] // PAGE) + 8
    rx = KVReceiver(_pools(num_pages, KV_HEADS, False, dev), rank=0, epoch=1,
                    timeout_s=60.0, staging_buffers=args["staging"], progress_mode=args["progress"],
                    max_payload_bytes=args["payload_mib"] << 20)
    addr = await rx.start()
    raw_eps, nccl_bufs = [], {}

    async def raw_serve(ep):  # [count, size] then count messages; reply 1 byte
        raw_eps.append(ep)
        bufs = [_buf(0, dev)] * args["staging"]
        head = np.empty(2, dtype="<u8")
        while True:
            try:
                await ep.recv(head)
                count, size = int(head[0]), int(head[1])
                bufs = [b if len(b) >= size else _buf(size, dev) for b in bufs]
                window = asyncio.Semaphore(len(bufs))

                async def one(i: int) -> None:
                    async with window:
                        await ep.recv(bufs[i % len(bufs)][:size])

                await asyncio.gather(*(one(i) for i in range(count)))
                await ep.send(np.ones(1, dtype=np.uint8))
            except Exception:
                return

    listener = ucxx.create_listener(raw_serve, 0)
    pipe.send((addr, ("127.0.0.1", listener.port)))
    while (cmd := await _recv_cmd(pipe)) is not None:
        if cmd == "cpu":
            pipe.send(_cpu())
            continue
        rid, tokens = cmd
        if rid == "nccl":  # blocks this loop: nothing else is in flight meanwhile
            if tokens not in nccl_bufs:
                shares = _shares(args["p"], tokens, num_pages)
                nccl_bufs[tokens] = [_buf(n, dev) for n in shares]
            gpu.nccl_recv(nccl_bufs[tokens])
            pipe.send("nccl")
            continue
        await rx.wait_request(rid, tokens, timeout_s=30.0)
        rx.release(rid)
        pipe.send(rx.stats["bytes"])
    await rx.close()
    for ep in raw_eps:
        ep.abort()
    await asyncio.sleep(0.2)  # let the raw handlers see the close and return
    listener.close()
    shutdown_ucx()


# ----------------------------------------------------------------------- senders

def sender_main(pipe, rank: int, args) -> None:
    dev = _set_env(args, rank)
    try:
        _profiled(args, f"sender{rank}", lambda: asyncio.run(_sender(pipe, rank, args, dev)))
    finally:
        if args["nccl"]:
            gpu.nccl_close()


@lru_cache(maxsize=None)
def _plan(p: int, tokens: int, num_pages: int):
    """The request's copy tables by (src, dst) rank pair (the same pages in every
    process; built as the prefill ranks build them) and the time it took."""
    from phalanx.kv_transfer.copy_table import plan_tables
    src, dst = _layouts(p, 1)
    t = time.perf_counter()
    tables = plan_tables(src, dst, range(tokens), _pages(num_pages, tokens, 1),
                         _pages(num_pages, tokens, 2))
    return tables, time.perf_counter() - t


def _shares(p: int, tokens: int, num_pages: int) -> list[int]:
    """Bytes each sender rank moves to the receiver."""
    from phalanx.kv_transfer.copy_table import table_nbytes
    tables = _plan(p, tokens, num_pages)[0]
    return [table_nbytes(tables[(r, 0)], HEAD_DIM, 2) for r in range(p)]


def _my_batches(rank: int, p: int, tokens: int, num_pages: int):
    """This rank's copies of the request, one table per layer; the planning time; bytes."""
    from phalanx.kv_transfer.copy_table import layer_slices
    tables, plan_s = _plan(p, tokens, num_pages)
    by_layer = layer_slices(tables[(rank, 0)])
    batches = [by_layer[layer] for layer in range(LAYERS)]
    return batches, plan_s, _shares(p, tokens, num_pages)[rank]


async def _sender(pipe, rank: int, args, dev: torch.device) -> None:
    from phalanx.kv_transfer.transport import KVSender, ensure_ucx, shutdown_ucx
    ucxx = ensure_ucx(args["progress"])
    src, _ = _layouts(args["p"], 1)
    heads = len(src.heads_of(rank))
    num_pages = -(-args["max_tokens"] // PAGE) + 8
    tx = KVSender(_pools(num_pages, heads, True, dev), rank=rank, epoch=1, timeout_s=60.0,
                  staging_buffers=args["staging"], progress_mode=args["progress"])
    addr, raw_addr = pipe.recv()
    await tx.connect(tuple(addr))
    raw_ep = await ucxx.create_endpoint(*raw_addr)
    raw_buf, reply = _buf(0, dev), np.empty(1, dtype=np.uint8)
    plans = {}
    pipe.send("ready")
    while (cmd := await _recv_cmd(pipe)) is not None:
        what, rid, tokens, start = cmd
        if tokens not in plans:
            plans[tokens] = _my_batches(rank, args["p"], tokens, num_pages)
        batches, plan_s, nbytes = plans[tokens]
        if what.startswith("raw") or what == "nccl":
            if len(raw_buf) < nbytes:
                raw_buf = _buf(nbytes, dev)
        await _sleep_until(start)
        cpu0 = _cpu()
        if what == "nccl":
            gpu.nccl_send(raw_buf[:nbytes], args["p"])
        elif what.startswith("raw"):
            count = 1 if what == "raw" else LAYERS
            size = nbytes // count
            await raw_ep.send(np.array([count, size], dtype="<u8"))
            await asyncio.gather(*(raw_ep.send(raw_buf[i * size:(i + 1) * size])
                                   for i in range(count)))
            await raw_ep.recv(reply)
        elif what == "pipelined":
            await asyncio.gather(*(tx.send_layer(tuple(addr), rid, b) for b in batches))
        else:
            for b in batches:
                await tx.send_layer(tuple(addr), rid, b)
        pipe.send((time.monotonic(), nbytes, plan_s, _cpu() - cpu0))
    await tx.close()
    raw_ep.abort()
    shutdown_ucx()


# ----------------------------------------------------------------------- coordinator

def _run(procs, rx_pipe, tx_pipes, what: str, rid: str, tokens: int) -> dict:
    """One timed transfer: seconds, bytes, planning seconds (rank 0), CPU seconds used
    by the senders and by the receiver process during the run."""
    rx_pipe.send("cpu")
    rx_cpu = _reply(rx_pipe, procs)
    start = time.monotonic() + START_DELAY_S
    if what == "nccl":
        rx_pipe.send(("nccl", tokens))
    for pipe in tx_pipes:
        pipe.send((what, rid, tokens, start))
    ends = [_reply(pipe, procs) for pipe in tx_pipes]
    if what == "nccl":
        assert _reply(rx_pipe, procs) == "nccl"
    rx_pipe.send("cpu")
    rx_cpu = _reply(rx_pipe, procs) - rx_cpu
    if what in ("pipelined", "sequential"):
        rx_pipe.send((rid, tokens))
        _reply(rx_pipe, procs)
    return {"seconds": max(e[0] for e in ends) - start, "bytes": sum(e[1] for e in ends),
            "plan_seconds": ends[0][2], "sender_cpu_s": sum(e[3] for e in ends),
            "receiver_cpu_s": rx_cpu}


def _reply(pipe, procs, timeout_s: float = 300.0):
    if not pipe.poll(timeout_s):
        dead = [p.exitcode for p in procs]
        raise TimeoutError(f"no reply within {timeout_s} s (process exit codes {dead})")
    return pipe.recv()


def bench_layout(p: int, tokens_list: list[int], args) -> list[dict]:
    ctx = mp.get_context("spawn")
    nccl = args.device == "cuda" and not args.no_nccl
    cfg = {"p": p, "max_tokens": max(tokens_list), "staging": args.staging, "tls": args.tls,
           "ucx_env": _ucx_env(args.ucx_env), "device": args.device, "nccl": nccl,
           "nccl_port": gpu.free_port() if nccl else 0, "payload_mib": args.payload_mib,
           "profile": args.profile, "progress": args.progress_mode}
    modes = MODES + (("nccl",) if nccl else ())
    rx_pipe, child = ctx.Pipe()
    procs = [ctx.Process(target=receiver_main, args=(child, cfg), daemon=True)]
    tx_pipes = []
    for rank in range(p):
        parent, child = ctx.Pipe()
        tx_pipes.append(parent)
        procs.append(ctx.Process(target=sender_main, args=(child, rank, cfg), daemon=True))
    for proc in procs:
        proc.start()
    rows = []
    try:
        addrs = _reply(rx_pipe, procs)
        for pipe in tx_pipes:
            pipe.send(addrs)
        for pipe in tx_pipes:
            assert _reply(pipe, procs) == "ready"
        n = 0
        for tokens in tokens_list:
            best: dict[str, dict] = {}
            for rep in range(args.reps + 1):  # rep 0: warm-up
                for what in modes:
                    n += 1
                    run = _run(procs, rx_pipe, tx_pipes, what, f"r{n}", tokens)
                    if rep and (what not in best or run["seconds"] < best[what]["seconds"]):
                        best[what] = run
            for what, run in best.items():
                rows.append({"layout": f"tp{p}->tp1", "tokens": tokens, "what": what, **run,
                             "gb_per_s": run["bytes"] / run["seconds"] / 1e9,
                             "of_raw": best["raw"]["seconds"] / run["seconds"]})
                print(f"  {rows[-1]}", flush=True)
    finally:
        for pipe in [rx_pipe, *tx_pipes]:
            try:
                pipe.send(None)
            except OSError:
                pass
        for proc in procs:
            proc.join(20)
            if proc.is_alive():
                proc.kill()
    return rows


def _ucx_env(spec: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in spec.split(",") if kv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where pools and raw buffers live (cuda: one GPU per process)")
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--layouts", default="1-1,2-1", help="prefill TP - decode TP (1)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--staging", type=int, default=3, help="staging buffers per connection")
    ap.add_argument("--payload-mib", type=int, default=32,
                    help="receiver's largest message (KVReceiver max_payload_bytes), MiB")
    ap.add_argument("--tls", default=None, help="UCX_TLS of the spawned processes "
                    f"(default cpu: {DEFAULT_TLS['cpu']}; cuda: {DEFAULT_TLS['cuda']})")
    ap.add_argument("--ucx-env", default=None,
                    help="extra UCX_*=value,... for the spawned processes ('' for none; "
                    f"default cpu: {TCP_TUNING}; cuda: none)")
    ap.add_argument("--no-nccl", action="store_true", help="cuda: leave out the nccl row")
    ap.add_argument("--progress-mode", default="thread",
                    help="ucxx progress mode of every process (thread, polling, blocking, ...)")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile every process; top functions to $OUT/profile_<role>.txt")
    args = ap.parse_args()
    args.tls = DEFAULT_TLS[args.device] if args.tls is None else args.tls
    args.ucx_env = DEFAULT_UCX_ENV[args.device] if args.ucx_env is None else args.ucx_env
    tokens = [int(t) for t in args.tokens.split(",")]
    senders = []
    for layout in args.layouts.split(","):
        p, d = (int(x) for x in layout.split("-"))
        if d != 1:
            raise SystemExit("only decode TP 1 is benchmarked (one receiver process)")
        senders.append(p)
    requested = senders
    if args.device == "cuda":
        senders = gpu.fitting_senders(senders)
    rows = []
    for p in senders:
        rows += bench_layout(p, tokens, args)
    import ucxx
    meta = {"host": platform.node(), "cpus": os.cpu_count(), "ucx": ucxx.__ucx_version__,
            "ucxx": ucxx.__version__, "torch": torch.__version__, "device": args.device,
            "tls": args.tls, "ucx_env": _ucx_env(args.ucx_env), "staging": args.staging,
            "payload_mib": args.payload_mib, "reps": args.reps,
            "shape": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                      "page": PAGE, "dtype_bytes": 2,
                      "dtype": "bfloat16" if args.device == "cuda" else "int16"}}
    if args.device == "cuda":
        meta.update(gpu.meta())
        meta["skipped_layouts"] = [f"{p}-1" for p in requested if p not in senders]
    path = os.path.join(os.environ.get("OUT", "."), "kv_transfer.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\nwrote {path}")
    if meta.get("skipped_layouts"):
        print(f"skipped (too few GPUs): {', '.join(meta['skipped_layouts'])}")
    print("| layout | tokens | what | bytes | seconds | GB/s | of raw | CPU s tx/rx |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['tokens']} | {r['what']} | {r['bytes']} | "
              f"{r['seconds']:.4f} | {r['gb_per_s']:.2f} | {r['of_raw']:.2f} | "
              f"{r['sender_cpu_s']:.2f}/{r['receiver_cpu_s']:.2f} |")


if __name__ == "__main__":
    main()
