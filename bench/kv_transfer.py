"""KV transfer throughput: a whole request's KV moved through the resharding planner and
the ucxx transport, against raw ucxx send/recv of the same bytes in the same run.

    python bench/kv_transfer.py [--device cpu|cuda] [--tokens 2048,8192] [--reps 3]
                                [--layouts 1-1,2-1] [--pages runs,shuffled] [--no-direct]
                                [--staging 3] [--payload-mib 32]
                                [--tls ...] [--ucx-env K=V,...] [--no-nccl]
                                [--payload-only] [--trace] [--progress-mode M] [--profile]

Shape: Qwen3-30B-A3B-like KV, 48 layers, 4 KV heads, head_dim 128, 2-byte elements
(int16 stands in for bf16 on CPU; bf16 on GPU), page 16 on both sides. The request's
pages in both pools are `--pages`: `runs` (consecutive, as a fresh pool hands them out:
whole pages that are spans of both pools move in place, without staging) and/or
`shuffled` (random: every page-run goes through the staging buffers; `--no-direct`
forces staging for runs too). Layout `P-D`: prefill TP=P (P sender processes, one per
rank) -> one decode rank with TP=D=1 (one receiver process). Every process pins torch to
one thread. The spawned processes get UCX_TLS=--tls (default cpu: tcp,sm,self; cuda:
cuda_copy,cuda_ipc,tcp,sm,self) and on cpu, by default, 512 KiB tcp segments (--ucx-env;
'' keeps UCX's 8 KiB, a far slower wire on loopback); on cuda no extra UCX variables.

--device cuda (helpers in `kv_transfer_gpu`): sender rank r keeps its pools and raw
buffers on cuda:r, the receiver on cuda:P (each process binds its GPU before ucxx starts);
a layout needing more GPUs than visible is skipped with a message (2 GPUs: only 1-1).
--one-gpu puts every process on cuda:0 (device to the same device through cuda_ipc: the
host side of the protocol on a GPU host when only one GPU is lent; not the link's rate;
no nccl row).
Every transfer is then device memory to device memory, raw baselines included.

Per (layout, tokens), in the same processes and over the same UCX worker:
- raw: each sender sends its share of the bytes as one buffer on its own endpoint and
  waits for a 1-byte reply once the receiver has it (no gather, no scatter);
- raw_spans (pages `runs`, one sender): the request's (layer, kind) spans sent from the
  sender's pools into the receiver's pools, all posted at once on both sides: the
  in-place pattern without control messages or acks;
- raw_spans_early: the same, with the receiver's receives posted before the start
  instant (spans on their own tag, sent right behind the header): what a receiver that
  posts its in-place receives ahead of the sender, when it reserves the pages, could
  reach;
- raw_layers: the same bytes as 48 messages (one per layer), all posted at once, the
  receiver keeping `--staging` receives posted (the transport's message pattern without
  planner, gather, scatter, control messages or acks);
- whole: each sender sends its share of the request as one `KVSender.send_layer` batch
  (every layer's copies: a request whose KV is already computed), as the engine's
  prefill ranks pass copies: template batches (`copy_table.plan_batches`); the
  transport cuts it into messages of up to `--payload-mib` (direct messages sent from
  the pools excepted: one control message for all of them) and keeps `--staging` of
  them in flight;
- whole_prepared: the same after `KVSender.prepare` of the batch before the start
  instant (validation, templates located in both pools, messages cut, and the control
  messages of the parts that go from pool to pool announced, so the receiver posts
  their receives before the start: what the engine's prefill ranks do while the step
  computes; `--no-announce` leaves the announcing out); its time is reported apart
  (`prepare_seconds`, like planning);
- pipelined: each sender streams every layer with `KVSender.send_layer` (one layer's
  template batches), all layers submitted at once; the transport coalesces the backlog
  as above; done when every ack is in;
- sequential: the same, one layer at a time (each waits for the previous ack);
- nccl (cuda only, --no-nccl to leave out): the raw pattern through torch.distributed
  NCCL send/recv between the same processes' GPUs (one buffer per sender, 1-byte reply).
Time: from a start instant all senders wait for (CLOCK_MONOTONIC, shared on one host)
to the last sender's end; best of `--reps` after one warm-up (`of raw`: best against raw's
best; `median of raw`: raw's median against the mode's median; the modes take turns within
each repetition). The receiver checks the landed slot counts after every run, and after
each request size both sides hash the request's slots (`intact`: what landed equals what
was sent, bit for bit). Planning is done before timing (reported apart).
Prints a table last and writes JSON to $OUT/kv_transfer.json (or ./kv_transfer.json).
Code: this file parses the command line, runs the processes and reports; the processes
are in kv_transfer_receiver.py and kv_transfer_sender.py (shared pieces in
kv_transfer_proc.py, the request's shape and copy tables in kv_transfer_request.py).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import time

import torch

import kv_transfer_gpu as gpu
from kv_transfer_receiver import receiver_main
from kv_transfer_request import HEAD_DIM, KV_HEADS, LAYERS, PAGE, PAGE_ORDERS
from kv_transfer_sender import sender_main

START_DELAY_S = 0.3
MODES = ("raw", "raw_layers", "whole", "whole_prepared", "pipelined", "sequential")
# UCX's tcp transport moves 8 KiB segments by default: ~1.5 GB/s on loopback; 512 KiB
# segments ~4-5 GB/s (raw and transport alike)
TCP_TUNING = "UCX_TCP_TX_SEG_SIZE=512k,UCX_TCP_RX_SEG_SIZE=512k"
DEFAULT_TLS = {"cpu": "tcp,sm,self", "cuda": "cuda_copy,cuda_ipc,tcp,sm,self"}
DEFAULT_UCX_ENV = {"cpu": TCP_TUNING, "cuda": ""}


# ----------------------------------------------------------------------- coordinator

def _run(procs, rx_pipe, tx_pipes, what: str, rid: str, tokens: int) -> dict:
    """One timed transfer: seconds, bytes, planning seconds (rank 0), CPU seconds used
    by the senders and by the receiver process during the run."""
    if what == "raw_spans_early":  # the receiver posts its receives before the start
        rx_pipe.send(("early", tokens))
        assert _reply(rx_pipe, procs) == "posted"
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
            "plan_seconds": ends[0][2], "prepare_seconds": max(e[4] for e in ends),
            "sender_cpu_s": sum(e[3] for e in ends),
            "receiver_cpu_s": rx_cpu}


def _intact(procs, rx_pipe, tx_pipes, tokens: int) -> bool:
    """Whether the receiver's slots of the request hold, bit for bit, what each sender's
    slots hold (digests in payload order; every mode wrote the same values)."""
    rx_pipe.send(("digest", tokens))
    for pipe in tx_pipes:
        pipe.send(("digest", tokens))
    landed = _reply(rx_pipe, procs)
    return landed == [_reply(pipe, procs) for pipe in tx_pipes]


def _reply(pipe, procs, timeout_s: float = 300.0):
    if not pipe.poll(timeout_s):
        dead = [p.exitcode for p in procs]
        raise TimeoutError(f"no reply within {timeout_s} s (process exit codes {dead})")
    return pipe.recv()


def bench_layout(p: int, pages: str, tokens_list: list[int], args) -> list[dict]:
    ctx = mp.get_context("spawn")
    nccl = args.device == "cuda" and not args.no_nccl and not args.one_gpu
    cfg = {"p": p, "max_tokens": max(tokens_list), "staging": args.staging, "tls": args.tls,
           "ucx_env": _ucx_env(args.ucx_env), "device": args.device, "nccl": nccl,
           "nccl_port": gpu.free_port() if nccl else 0, "payload_mib": args.payload_mib,
           "profile": args.profile, "progress": args.progress_mode,
           "payload_only": args.payload_only, "trace": args.trace,
           "spin_ms": args.spin_ms, "one_gpu": args.one_gpu,
           "switch_interval": args.switch_interval, "pages": pages,
           "direct": not args.no_direct, "announce": not args.no_announce}
    spans = ("raw_spans", "raw_spans_early") if (p, pages) == (1, "runs") else ()
    modes = MODES + (("nccl",) if nccl else ()) + spans
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
            times: dict[str, list[float]] = {what: [] for what in modes}
            for rep in range(args.reps + 1):  # rep 0: warm-up
                for what in modes:
                    n += 1
                    run = _run(procs, rx_pipe, tx_pipes, what, f"r{n}", tokens)
                    if rep:
                        times[what].append(run["seconds"])
                    if rep and (what not in best or run["seconds"] < best[what]["seconds"]):
                        best[what] = run
            intact = _intact(procs, rx_pipe, tx_pipes, tokens)
            median = {what: statistics.median(ts) for what, ts in times.items() if ts}
            for what, run in best.items():
                rows.append({"layout": f"tp{p}->tp1", "pages": pages, "tokens": tokens,
                             "what": what, "intact": intact, **run,
                             "gb_per_s": run["bytes"] / run["seconds"] / 1e9,
                             "of_raw": best["raw"]["seconds"] / run["seconds"],
                             "median_seconds": median[what],
                             "of_raw_median": median["raw"] / median[what],
                             "all_seconds": times[what]})
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


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where pools and raw buffers live (cuda: one GPU per process)")
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--layouts", default="1-1,2-1", help="prefill TP - decode TP (1)")
    ap.add_argument("--pages", default="runs,shuffled",
                    help=f"the request's pages in both pools, any of {','.join(PAGE_ORDERS)}")
    ap.add_argument("--no-direct", action="store_true",
                    help="the receiver takes no payload in place (everything staged)")
    ap.add_argument("--no-announce", action="store_true",
                    help="KVSender(announce=False): prepare sends nothing ahead")
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
    ap.add_argument("--one-gpu", action="store_true",
                    help="cuda: every process on cuda:0 (host overheads, not the link)")
    ap.add_argument("--progress-mode", default=None,
                    help="ucxx progress mode of every process (thread, thread-polling, ...; "
                         "default: the transport's for the device, `progress_mode_for`)")
    ap.add_argument("--payload-only", action="store_true",
                    help="the transport moves its messages without gathering or scattering "
                         "pages (splits wire + control from the copies)")
    ap.add_argument("--switch-interval", type=float, default=0.0,
                    help="sys.setswitchinterval of every process (0: Python's 5 ms)")
    ap.add_argument("--spin-ms", type=float, default=0.0,
                    help="senders spin (instead of sleeping) the last N ms before the start")
    ap.add_argument("--trace", action="store_true",
                    help="timeline of every transport operation per process to "
                         "$OUT/trace_<role>.json (kv_transfer_trace)")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile every process; top functions to $OUT/profile_<role>.txt")
    args = ap.parse_args()
    args.tls = DEFAULT_TLS[args.device] if args.tls is None else args.tls
    args.ucx_env = DEFAULT_UCX_ENV[args.device] if args.ucx_env is None else args.ucx_env
    if args.progress_mode is None:
        from phalanx.kv_transfer.transport.ucx_runtime import progress_mode_for
        args.progress_mode = progress_mode_for(torch.device(args.device))
    return args


def _meta(args, requested: list[int], senders: list[int]) -> dict:
    """The JSON's run description (UCX, versions, the KV shape; on cuda the GPUs)."""
    import ucxx
    meta = {"host": platform.node(), "cpus": os.cpu_count(), "ucx": ucxx.__ucx_version__,
            "ucxx": ucxx.__version__, "torch": torch.__version__, "device": args.device,
            "tls": args.tls, "ucx_env": _ucx_env(args.ucx_env), "staging": args.staging,
            "payload_mib": args.payload_mib, "reps": args.reps, "direct": not args.no_direct,
            "announce": not args.no_announce,
            "one_gpu": args.one_gpu, "spin_ms": args.spin_ms, "progress": args.progress_mode,
            "shape": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                      "page": PAGE, "dtype_bytes": 2,
                      "dtype": "bfloat16" if args.device == "cuda" else "int16"}}
    if args.device == "cuda":
        meta.update(gpu.meta())
        meta["skipped_layouts"] = [f"{p}-1" for p in requested if p not in senders]
    return meta


def _print_table(rows: list[dict]) -> None:
    print("| layout | pages | tokens | intact | what | bytes | seconds | GB/s | of raw "
          "| median of raw | CPU s tx/rx |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['pages']} | {r['tokens']} | {r['intact']} | {r['what']} | {r['bytes']} | "
              f"{r['seconds']:.4f} | {r['gb_per_s']:.2f} | {r['of_raw']:.2f} | "
              f"{r['of_raw_median']:.2f} | "
              f"{r['sender_cpu_s']:.2f}/{r['receiver_cpu_s']:.2f} |")


def main() -> None:
    args = _parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    senders = []
    for layout in args.layouts.split(","):
        p, d = (int(x) for x in layout.split("-"))
        if d != 1:
            raise SystemExit("only decode TP 1 is benchmarked (one receiver process)")
        senders.append(p)
    requested = senders
    if args.device == "cuda":
        senders = gpu.fitting_senders(senders, one_gpu=args.one_gpu)
    orders = args.pages.split(",")
    if not set(orders) <= set(PAGE_ORDERS):
        raise SystemExit(f"--pages: any of {','.join(PAGE_ORDERS)}")
    rows = []
    for p in senders:
        for order in orders:
            rows += bench_layout(p, order, tokens, args)
    meta = _meta(args, requested, senders)
    path = os.path.join(os.environ.get("OUT", "."), "kv_transfer.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\nwrote {path}")
    if meta.get("skipped_layouts"):
        print(f"skipped (too few GPUs): {', '.join(meta['skipped_layouts'])}")
    _print_table(rows)


if __name__ == "__main__":
    main()
