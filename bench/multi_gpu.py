"""Two-GPU layouts on the Qwen3-30B-A3B shape: decode DP=2 x EP=2, prefill TP=2, MoE
dispatch/combine against plain NCCL all-to-all, and greedy tokens against one GPU.

    python bench/multi_gpu.py [--layers 48] [--batches 16,64,128] [--ctx 1024]
    python bench/multi_gpu.py --device cpu --tiny          # same code paths, gloo, < 60 s

Phases (`--phases`, default all), each in spawned processes, one GPU each:
1. ranks (2 processes, `GroupComm.init(rank, 2, tp, tcp://..., device=)`; NCCL for CUDA
   tensors through its deadline wait loop, gloo for plans), eager:
   - check: a `--check-layers` model per `--check-dtypes` in the DP2 x EP2 layout
     (each rank full attention, half the experts, `EPDispatcher` all-to-alls);
     prompts split round-robin over the two DP ranks, greedy, `--max-new` tokens;
   - decode: DP2 x EP2, `--batches` sequences per rank admitted as already prefilled
     with `--ctx` tokens (pages reserved and `admit_prefilled`, as a disaggregated
     decode rank does; the KV pool holds random normal data), `--warm` steps, then
     `--steps` timed steps of `RankEngine._step` (DP agreement included) on both ranks;
   - moe: per-layer MoE of layer 0 at the same per-rank token counts: `EPDispatcher.moe`
     with the experts, with an identity expert (dispatch + combine only), its four
     all-to-alls through `GroupComm` (counts, rows, metadata, return rows; splits
     known), the same four through `torch.distributed.all_to_all_single` directly
     (NCCL, gloo on CPU; no deadline loop: synced once per call, once after each
     all-to-all, and back-to-back with one sync per `--moe-iters` calls), and the
     local expert compute alone. Medians of host wall time per call.
   - prefill: TP=2 (experts split over the two ranks, all-reduce combine), leader rank 0
     schedules and broadcasts plans; `--prefill` shapes, one warm run then one timed.
2. single (1 process, GPU 0): the same weights on one GPU: the check's reference tokens
   (eager), decode at the same per-GPU batches eager and with CUDA graphs, the same
   prefill shapes, and the copy bandwidth / matmul rate behind the floors.

Weights: random, a deterministic function of (seed, parameter, expert) built directly on
the device (bench/multi_gpu_model.py), so every layout holds slices of one model.
Floors: decode bytes per GPU (dense weights + LM head + its experts touched by the
group's tokens + its KV; all-to-all bytes not counted) over the measured copy
bandwidth; prefill FLOPs (split over the GPUs) over the measured matmul rate.
Prints a table last; writes JSON to $OUT/multi_gpu.json (or ./multi_gpu.json).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import time
import traceback

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1",
               "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}.items():
    os.environ.setdefault(_k, _v)  # multicast stays off on the GPU machine

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import multi_gpu_model as mm  # noqa: E402

WORLD = 2
PHASES = ("check", "decode", "moe", "prefill", "single")


# ----------------------------------------------------------------------- processes

def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _entry(fn, rank, world, opts, q) -> None:
    try:
        q.put((rank, "ok", fn(rank, world, opts)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put((rank, "error", traceback.format_exc()))


def run_procs(fn, world: int, opts: dict, timeout_s: float) -> tuple[dict, dict]:
    """Run `fn(rank, world, opts)` in `world` spawned processes; (results, errors)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, opts, q), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    end = time.monotonic() + timeout_s
    try:
        while time.monotonic() < end and len(results) + len(errors) < world:
            try:
                rank, status, val = q.get(timeout=0.5)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break
                continue
            (results if status == "ok" else errors)[rank] = val
            if status != "ok":
                break  # the peers would wait on the dead rank until their deadline
        for p in procs:
            p.join(timeout=max(0.1, min(10.0, end - time.monotonic())))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    for r in range(world):
        if r not in results and r not in errors:
            errors[r] = f"no result within {timeout_s:.0f} s (exit code {procs[r].exitcode})"
    return results, errors


def _setup(rank: int, opts: dict) -> torch.device:
    if opts["device"] == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    torch.set_num_threads(1)
    return torch.device("cpu")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _log(opts: dict, msg: str) -> None:
    who = f" {opts['who']}" if opts.get("who") else ""
    print(f"[{time.monotonic() - opts['t0']:6.1f}s{who}] {msg}", flush=True)


def _free(dev: torch.device) -> None:
    import gc
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------- workloads

def check_prompts(opts: dict, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(opts["seed"] + 17)
    n = opts["check_prompts"]
    lengths = [16 + (48 * i) // max(1, n - 1) for i in range(n)]  # 16 .. 64
    return [torch.randint(0, vocab, (L,), generator=g).tolist() for L in lengths]


def generate(stepper: mm.Stepper, prompts: dict[int, list[int]], max_new: int) -> dict[int, list[int]]:
    """Greedy tokens of `prompts` (this rank's share; followers pass none)."""
    from phalanx.engine.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    eng = stepper.engine
    for i, p in prompts.items():
        eng.add_request(f"c{i}", p, params)
    stepper.drive(lambda: not eng.has_unfinished())
    return {i: stepper.tokens.get(f"c{i}", []) for i in prompts}


def decode_bench(stepper: mm.Stepper, opts: dict, dev: torch.device) -> list[dict]:
    eng, rows = stepper.engine, []
    warm, steps, ctx = opts["warm"], opts["steps"], opts["ctx"]
    for b in opts["batches"]:
        gen = torch.Generator().manual_seed(opts["seed"] + b)
        rids = [f"d{b}-{i}" for i in range(b)]
        mm.admit_decoding(eng, rids, ctx, warm + steps + 8, gen)
        for _ in range(warm):
            stepper.step()
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(steps):
            stepper.step()
        _sync(dev)
        dt = time.perf_counter() - t0
        for rid in rids:
            eng.abort_request(rid)
        stepper.tokens.clear()
        rows.append(dict(batch=b, ctx=ctx, steps=steps, step_ms=dt / steps * 1e3, tok_s=b * steps / dt))
        _log(opts, f"  decode batch {b}: {dt / steps * 1e3:.2f} ms/step, {b * steps / dt:.0f} tok/s")
    return rows


def prefill_bench(stepper: mm.Stepper, opts: dict, dev: torch.device) -> list[dict]:
    from phalanx.engine.sampling_params import SamplingParams
    eng, rows = stepper.engine, []
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    vocab = eng.config.model.vocab_size
    for n, length in opts["prefill"]:
        gen = torch.Generator().manual_seed(opts["seed"] + 7 * n + length)

        def once(tag: str) -> float:
            if stepper.leader:
                for i in range(n):
                    eng.add_request(f"p{tag}{n}x{length}-{i}",
                                    torch.randint(0, vocab, (length,), generator=gen).tolist(), params)
            _sync(dev)
            t0 = time.perf_counter()
            stepper.drive(lambda: not eng.has_unfinished())
            _sync(dev)
            return time.perf_counter() - t0

        once("w")
        dt = once("t")
        stepper.tokens.clear()
        rows.append(dict(num_seqs=n, length=length, seconds=dt, tok_s=n * length / dt))
        if stepper.leader:
            _log(opts, f"  prefill {n}x{length}: {dt * 1e3:.1f} ms, {n * length / dt:.0f} tok/s")
    return rows


def moe_bench(comm, model, opts: dict, dev: torch.device) -> list[dict]:
    """Per-layer MoE timings of layer 0 at each per-rank token count (see the docstring)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from phalanx.kernels.moe import route
    from phalanx.models.qwen3_moe import SparseMoE

    moe = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE))
    ep, disp = moe.ep, moe.ep.dispatcher
    cfg, world, rank = model.cfg, comm.world_size, comm.rank
    k, H = cfg.num_experts_per_tok, cfg.hidden_size
    dtype = moe.w13.dtype
    owner = torch.empty(cfg.num_experts, dtype=torch.int64)
    for r, experts in enumerate(disp.experts_of_rank):
        owner[experts] = r
    owner = owner.to(dev)
    iters, warm = opts["moe_iters"], 3
    rows = []

    def timed(fn) -> float:
        """Median of per-call wall times; calls are collective, ranks meet at a barrier."""
        for _ in range(warm):
            fn()
        _sync(dev)
        comm.barrier()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    def timed_stream(fn) -> float:
        """Back-to-back calls, one sync at the end (stream-ordered cost per call)."""
        for _ in range(warm):
            fn()
        _sync(dev)
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(dev)
        return (time.perf_counter() - t0) / iters * 1e6

    for b in opts["batches"]:
        g = torch.Generator(device=dev)
        g.manual_seed(opts["seed"] + 1000 * rank + b)
        x = torch.randn(b, H, generator=g, device=dev).to(dtype)
        weights, ids = route(F.linear(x, moe.gate), k, cfg.norm_topk_prob, dtype)
        got = {}

        def capture(rx, rids, rw):
            got.update(rx=rx.clone(), rids=rids.clone(), rw=rw.clone())
            return rx

        ep.moe(x, weights, ids, capture)
        dest = owner[ids.reshape(-1)]
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=world)
        recv_counts = torch.empty_like(send_counts)
        comm.all_to_all_single(recv_counts, send_counts)
        ss, rs = send_counts.tolist(), recv_counts.tolist()
        P, R = sum(ss), sum(rs)
        send_x = x[order // k].contiguous()
        recv_x = torch.empty((R, H), dtype=dtype, device=dev)
        send_meta = torch.zeros((P, 2), dtype=torch.int64, device=dev)
        recv_meta = torch.empty((R, 2), dtype=torch.int64, device=dev)
        back_send = got["rx"].contiguous()
        back_recv = torch.empty((P, H), dtype=dtype, device=dev)

        def a2a_with(op, sync_each: bool):
            def run():
                op(recv_counts, send_counts)
                if sync_each:
                    _sync(dev)
                op(recv_x, send_x, rs, ss)
                if sync_each:
                    _sync(dev)
                op(recv_meta, send_meta, rs, ss)
                if sync_each:
                    _sync(dev)
                op(back_recv, back_send, ss, rs)
            return run

        nccl = lambda out, inp, o=None, i=None: dist.all_to_all_single(out, inp, o, i)  # noqa: E731
        ours = lambda out, inp, o=None, i=None: comm.all_to_all_single(out, inp, o, i)  # noqa: E731
        row_bytes = H * x.element_size()
        to_peers, from_peers = P - ss[rank], R - rs[rank]  # rows to / from the other ranks
        row = dict(batch=b, pairs_sent=P, rows_received=R,
                   bytes_sent=P * (row_bytes + 16) + R * row_bytes + 8 * world,
                   bytes_to_peers=to_peers * (row_bytes + 16) + from_peers * row_bytes + 8 * (world - 1))
        row["moe_us"] = timed(lambda: ep.moe(x, weights, ids, moe._experts))
        row["dispatch_combine_us"] = timed(lambda: ep.moe(x, weights, ids, lambda rx, ri, rw: rx))
        row["a2a_groupcomm_us"] = timed(a2a_with(ours, False))
        row["a2a_nccl_sync_each_us"] = timed(a2a_with(nccl, True))
        row["a2a_nccl_us"] = timed(a2a_with(nccl, False))
        row["a2a_nccl_stream_us"] = timed_stream(a2a_with(nccl, False))
        row["experts_us"] = timed(lambda: moe._experts(got["rx"], got["rids"], got["rw"]))
        rows.append(row)
        _log(opts, f"  moe batch {b}: full {row['moe_us']:.0f} us, dispatch+combine "
                   f"{row['dispatch_combine_us']:.0f}, 4 a2a ours {row['a2a_groupcomm_us']:.0f} / "
                   f"nccl {row['a2a_nccl_us']:.0f} (stream {row['a2a_nccl_stream_us']:.0f}), "
                   f"experts {row['experts_us']:.0f}")
    return rows


# ----------------------------------------------------------------------- phases

def check_attempts(opts: dict, dtype: str) -> list[bool]:
    """Kernel modes to try for one check dtype: the device's own kernels, then (for the
    PASS dtype on CUDA, if the first attempt raised) the torch reference kernels."""
    fallback = opts["device"] == "cuda" and dtype == opts["check_pass_dtype"] and opts["check_fallback"]
    return [False, True] if fallback else [False]


def run_checks(opts: dict, dev: torch.device, attempt_fn) -> dict:
    """`attempt_fn(dtype, index, ref_kernels) -> tokens` per check dtype and attempt;
    an attempt that raises is recorded and, where allowed, retried on reference kernels."""
    from contextlib import nullcontext

    from phalanx.kernels.backend import force_triton
    out = {"tokens": {}, "kernels": {}, "errors": {}}
    for j, dtype in enumerate(opts["check_dtypes"]):
        for a, ref in enumerate(check_attempts(opts, dtype)):
            mode = "torch-ref" if ref or dev.type != "cuda" else "triton"
            try:
                with force_triton(False) if ref else nullcontext():
                    out["tokens"][dtype] = attempt_fn(dtype, 2 * j + a, ref)
                out["kernels"][dtype] = mode
                break
            except Exception:  # noqa: BLE001 - reported; the next attempt may still pass
                out["errors"][f"{dtype}/{mode}"] = traceback.format_exc()[-3000:]
                _log(opts, f"check {dtype} ({mode}) failed: "
                           f"{traceback.format_exc().strip().splitlines()[-1][:300]}")
            finally:
                _free(dev)
    _log(opts, "check done")
    return out


def rank_main(rank: int, world: int, opts: dict) -> dict:
    """One rank of the 2-process group: decode and moe in DP2 x EP2, TP2 prefill, then the
    token check in DP2 x EP2 (last: a kernel failure there cannot cost the figures)."""
    from phalanx.engine.llm_engine import LLMEngine
    from phalanx.engine.rank_engine import RankSpec, shard_for
    from phalanx.kernels.comm import CollectiveError, GroupComm
    from phalanx.kernels.dispatch import EPDispatcher
    from phalanx.models.parallel import ExpertParallel

    dev = _setup(rank, opts)
    opts = dict(opts, who=f"rank{rank}")
    phases, out = opts["phases"], {"rank": rank}
    devname = opts["device"]

    def layout(comm, tp: int, epoch: int, init: str, cfg, dtype: str, batch: int, pages: int):
        spec = RankSpec(rank, tp, world // tp, epoch, init, comm.deadline_s,
                        mm.engine_config(cfg, devname, dtype, batch, pages, eager=True))
        shard, placement = shard_for(spec, cfg.num_experts)
        ep = None
        if placement is not None:
            ep = ExpertParallel(EPDispatcher(comm, cfg.num_experts, placement[0], placement[1]))
        model = mm.build_model(cfg, shard, dev, mm.DTYPES[dtype], opts["seed"], comm, ep)
        engine = LLMEngine(spec.config, shard, comm, ep, model=model)
        return mm.Stepper.for_rank(spec, comm, engine)

    if {"decode", "moe"} & set(phases):
        init = f"tcp://127.0.0.1:{opts['ports'][0]}"
        comm = GroupComm.init(rank, world, 1, init, 1, opts["deadline_s"], device=devname)
        cfg = mm.model_config(opts["tiny"], opts["layers"], "bfloat16")
        b = max(opts["batches"])
        st = layout(comm, 1, 1, init, cfg, "bfloat16", b,
                    mm.pages_for(b, opts["ctx"] + opts["warm"] + opts["steps"] + 8))
        mm.randomize_kv(st.engine, opts["seed"])
        _sync(dev)
        if rank == 0:
            _log(opts, f"DP2xEP2 model built ({cfg.num_hidden_layers} layers, "
                       f"{sum(p.numel() for p in st.engine.model.parameters()) / 1e9:.2f} B params/rank)")
        with torch.inference_mode():
            if "decode" in phases:
                out["decode"] = decode_bench(st, opts, dev)
            if "moe" in phases:
                out["moe"] = moe_bench(comm, st.engine.model, opts, dev)
        del st
        _free(dev)
        comm.destroy()
    if "prefill" in phases:
        init = f"tcp://127.0.0.1:{opts['ports'][1]}"
        comm = GroupComm.init(rank, world, world, init, 2, opts["deadline_s"], device=devname)
        cfg = mm.model_config(opts["tiny"], opts["layers"], "bfloat16")
        longest = max(n * L for n, L in opts["prefill"])
        st = layout(comm, world, 2, init, cfg, "bfloat16", 64,
                    mm.pages_for(1, longest) + 2 * mm.pages_for(64, 1))
        if rank == 0:
            _log(opts, "TP2 model built")
        with torch.inference_mode():
            out["prefill"] = prefill_bench(st, opts, dev)
        del st
        _free(dev)
        comm.destroy()
    if "check" in phases:
        def attempt(dtype: str, index: int, ref: bool) -> dict:
            init = f"tcp://127.0.0.1:{opts['ports'][2 + index]}"
            comm = GroupComm.init(rank, world, 1, init, 3 + index, opts["check_deadline_s"],
                                  device=devname)
            try:
                cfg = mm.model_config(opts["tiny"], opts["check_layers"], "bfloat16")
                st = layout(comm, 1, 3 + index, init, cfg, dtype, 8, mm.pages_for(8, 160))
                prompts = check_prompts(opts, cfg.vocab_size)
                mine = {i: p for i, p in enumerate(prompts) if i % world == rank}
                with torch.inference_mode():
                    return generate(st, mine, opts["max_new"])
            except Exception as e:
                if comm.nccl and not isinstance(e, CollectiveError):
                    comm._abort_nccl()  # the peer may sit in a collective: destroy must not block
                raise
            finally:
                comm.destroy()

        out["check"] = run_checks(opts, dev, attempt)
    return out


def single_main(rank: int, world: int, opts: dict) -> dict:
    """The same weights on one GPU (or one CPU process): baselines, then reference tokens."""
    from phalanx.engine.llm_engine import LLMEngine
    from phalanx.models.shard import ModelShard

    dev = _setup(0, opts)
    opts = dict(opts, who="single")
    phases, out = opts["phases"], {}
    devname = opts["device"]
    shard = ModelShard()

    def engine(cfg, dtype: str, batch: int, pages: int, eager: bool, model=None):
        model = model or mm.build_model(cfg, shard, dev, mm.DTYPES[dtype], opts["seed"])
        return LLMEngine(mm.engine_config(cfg, devname, dtype, batch, pages, eager), model=model)

    if dev.type == "cuda":
        out["ceilings"] = mm.measure_ceilings(dev)
        out["device_name"] = torch.cuda.get_device_name(dev)
        _free(dev)
    if {"decode", "prefill"} & set(phases):
        cfg = mm.model_config(opts["tiny"], opts["layers"], "bfloat16")
        b = max(opts["batches"])
        pages = max(mm.pages_for(b, opts["ctx"] + opts["warm"] + opts["steps"] + 8),
                    mm.pages_for(1, max(n * L for n, L in opts["prefill"])) + 2 * mm.pages_for(64, 1))
        model = mm.build_model(cfg, shard, dev, torch.bfloat16, opts["seed"])
        _log(opts, f"full model built ({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params)")
        with torch.inference_mode():
            eng = engine(cfg, "bfloat16", b, pages, eager=True, model=model)
            mm.randomize_kv(eng, opts["seed"])
            st = mm.Stepper(eng)
            if "decode" in phases:
                out["decode_eager"] = decode_bench(st, opts, dev)
            if "prefill" in phases:
                out["prefill"] = prefill_bench(st, opts, dev)
            del st, eng
            _free(dev)
            if "decode" in phases and dev.type == "cuda" and opts["graphs"]:
                t0 = time.perf_counter()
                eng = engine(cfg, "bfloat16", b, pages, eager=False, model=model)
                out["graph_capture_s"] = time.perf_counter() - t0
                _log(opts, f"CUDA graphs captured in {out['graph_capture_s']:.1f} s")
                mm.randomize_kv(eng, opts["seed"])
                out["decode_graphs"] = decode_bench(mm.Stepper(eng), opts, dev)
                del eng
        del model
        _free(dev)
    if "check" in phases:
        def attempt(dtype: str, index: int, ref: bool) -> dict:
            cfg = mm.model_config(opts["tiny"], opts["check_layers"], "bfloat16")
            eng = engine(cfg, dtype, 8, mm.pages_for(8, 160), eager=True)
            prompts = dict(enumerate(check_prompts(opts, cfg.vocab_size)))
            with torch.inference_mode():
                return generate(mm.Stepper(eng), prompts, opts["max_new"])

        out["check"] = run_checks(opts, dev, attempt)
    return out


# ----------------------------------------------------------------------- report

def compare_tokens(ranks: dict, single: dict, opts: dict) -> dict:
    """Per dtype: the DP2 x EP2 tokens (both ranks' shares) vs the single-GPU ones."""
    report = {}
    for dtype in opts["check_dtypes"]:
        ref = {int(i): t for i, t in single.get("check", {}).get("tokens", {}).get(dtype, {}).items()}
        dp: dict[int, list[int]] = {}
        errors = {f"single {k}": v for k, v in single.get("check", {}).get("errors", {}).items()}
        kernels = {"single": single.get("check", {}).get("kernels", {}).get(dtype)}
        for r, res in sorted(ranks.items()):
            c = res.get("check", {})
            dp.update({int(i): t for i, t in c.get("tokens", {}).get(dtype, {}).items()})
            errors.update({f"rank{r} {k}": v for k, v in c.get("errors", {}).items() if k.startswith(dtype)})
            kernels[f"rank{r}"] = c.get("kernels", {}).get(dtype)
        errors = {k: v for k, v in errors.items() if k.split()[-1].startswith(dtype)}
        prompts = []
        for i in sorted(ref):
            a, b = ref[i], dp.get(i)
            same = 0
            if b is not None:
                while same < min(len(a), len(b)) and a[same] == b[same]:
                    same += 1
            prompts.append(dict(prompt=i, single=a, dp2ep2=b, equal=b == a, leading_equal=same))
        complete = bool(ref) and len(dp) == len(ref) == opts["check_prompts"]
        report[dtype] = dict(equal=complete and all(p["equal"] for p in prompts), complete=complete,
                             prompts=prompts, kernels=kernels, errors=errors)
    return report


def summarize(args, opts, ranks, single, errors, walls) -> dict:
    cfg = mm.model_config(opts["tiny"], opts["layers"], "bfloat16")
    ceil = single.get("ceilings")
    bw = ceil["copy_bytes_per_s"] if ceil else None
    mm_rate = ceil["matmul_flops_per_s"] if ceil else None
    by_b = lambda rows: {r["batch"]: r for r in rows or []}  # noqa: E731
    eager, graphs = by_b(single.get("decode_eager")), by_b(single.get("decode_graphs"))
    decode_rows = []
    rank_decode = [by_b(ranks[r].get("decode")) for r in sorted(ranks)]
    for b in opts["batches"]:
        per = [d[b] for d in rank_decode if b in d]
        if not per:
            continue
        tok = statistics.mean(p["tok_s"] for p in per)
        ctx = opts["ctx"] + opts["warm"] + opts["steps"] // 2
        row = dict(batch_per_rank=b, tok_s_per_gpu=tok, tok_s_total=sum(p["tok_s"] for p in per),
                   step_ms=max(p["step_ms"] for p in per), per_rank=per)
        if bw:
            floor = b / (mm.decode_bytes_per_gpu(cfg, b, ctx, WORLD) / bw)
            row.update(floor_tok_s_per_gpu=floor, of_floor=tok / floor,
                       single_floor_tok_s=b / (mm.decode_bytes_per_gpu(cfg, b, ctx, 1) / bw))
        if b in eager:
            row.update(single_eager_tok_s=eager[b]["tok_s"], vs_single_eager=tok / eager[b]["tok_s"])
        if b in graphs:
            row.update(single_graphs_tok_s=graphs[b]["tok_s"], vs_single_graphs=tok / graphs[b]["tok_s"])
        decode_rows.append(row)
    prefill_rows = []
    single_pf = {(r["num_seqs"], r["length"]): r for r in single.get("prefill") or []}
    for r in (ranks.get(0, {}).get("prefill") or []):
        key = (r["num_seqs"], r["length"])
        row = dict(shape=f"{key[0]}x{key[1]}", tok_s=r["tok_s"], tok_s_per_gpu=r["tok_s"] / WORLD)
        if mm_rate:
            floor = key[0] * key[1] / (mm.prefill_flops(cfg, *key) / WORLD / mm_rate)
            row.update(floor_tok_s=floor, of_floor=r["tok_s"] / floor)
        if key in single_pf:
            row.update(single_tok_s=single_pf[key]["tok_s"], vs_single=r["tok_s"] / single_pf[key]["tok_s"])
        prefill_rows.append(row)
    moe_rows = []
    rank_moe = [ranks[r].get("moe") or [] for r in sorted(ranks)]
    for i, b in enumerate(opts["batches"]):
        per = [m[i] for m in rank_moe if i < len(m)]
        if not per:
            continue
        keys = [k for k in per[0] if k.endswith("_us")]
        row = {"batch_per_rank": b, **{k: statistics.mean(p[k] for p in per) for k in keys},
               "bytes_sent_per_rank": statistics.mean(p["bytes_sent"] for p in per),
               "bytes_to_peers_per_rank": statistics.mean(p["bytes_to_peers"] for p in per)}
        row["groupcomm_vs_nccl"] = row["a2a_groupcomm_us"] / row["a2a_nccl_us"]
        step = next((d["step_ms"] for d in decode_rows if d["batch_per_rank"] == b), None)
        if step:
            row["dispatch_combine_share_of_step"] = (row["dispatch_combine_us"] * cfg.num_moe_layers
                                                     / (step * 1e3))
        moe_rows.append(row)
    return dict(args=vars(args), model=dict(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size,
                                            experts=cfg.num_experts, top_k=cfg.num_experts_per_tok),
                device=single.get("device_name") or opts["device"], ceilings=ceil,
                check=compare_tokens(ranks, single, opts) if "check" in opts["phases"] else None,
                decode=decode_rows, prefill=prefill_rows, moe=moe_rows,
                graph_capture_s=single.get("graph_capture_s"), errors=errors, wall_s=walls,
                raw=dict(ranks=ranks, single=single))


def _f(v, fmt: str, width: int) -> str:
    return format(v, fmt).rjust(width) if v is not None else "-".rjust(width)


def print_report(res: dict) -> bool:
    ok = True
    ceil = res["ceilings"]
    if ceil:
        print(f"device {res['device']}: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
              f"matmul {ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
    m = res["model"]
    print(f"model: {m['layers']} layers, hidden {m['hidden']}, {m['experts']} experts top-{m['top_k']}; "
          f"wall: " + ", ".join(f"{k} {v:.0f} s" for k, v in res["wall_s"].items()))
    for name, err in res["errors"].items():
        ok = False
        print(f"ERROR {name}: {err.strip().splitlines()[-1] if err.strip() else err}")
    if res["decode"]:
        print("\ndecode DP2xEP2 (eager, per GPU) vs one GPU with the same weights at the same per-GPU batch")
        print(f"{'batch/rank':>10} {'tok/s/GPU':>10} {'total':>8} {'step ms':>8} {'floor':>8} {'of fl':>6} "
              f"{'1GPU eager':>10} {'x':>5} {'1GPU graph':>10} {'x':>5} {'1GPU floor':>10}")
        for r in res["decode"]:
            print(f"{r['batch_per_rank']:10d} {r['tok_s_per_gpu']:10.0f} {r['tok_s_total']:8.0f} "
                  f"{r['step_ms']:8.2f} {_f(r.get('floor_tok_s_per_gpu'), '.0f', 8)} "
                  f"{_f(r.get('of_floor'), '.2f', 6)} {_f(r.get('single_eager_tok_s'), '.0f', 10)} "
                  f"{_f(r.get('vs_single_eager'), '.2f', 5)} {_f(r.get('single_graphs_tok_s'), '.0f', 10)} "
                  f"{_f(r.get('vs_single_graphs'), '.2f', 5)} {_f(r.get('single_floor_tok_s'), '.0f', 10)}")
        print("x: DP2xEP2 tok/s per GPU / one GPU's; floors: bytes per GPU / copy bandwidth "
              "(all-to-all traffic not counted)")
    if res["moe"]:
        print("\nMoE layer per rank, us (medians; 4 a2a = counts, rows, metadata, return rows)")
        print(f"{'batch':>5} {'MoE':>7} {'disp+comb':>9} {'experts':>7} {'4a2a ours':>9} {'4a2a nccl':>9} "
              f"{'nccl+sync':>9} {'nccl strm':>9} {'ours/nccl':>9} {'KiB wire':>8} {'d+c share':>9}")
        for r in res["moe"]:
            print(f"{r['batch_per_rank']:5d} {r['moe_us']:7.0f} {r['dispatch_combine_us']:9.0f} "
                  f"{r['experts_us']:7.0f} {r['a2a_groupcomm_us']:9.0f} {r['a2a_nccl_us']:9.0f} "
                  f"{r['a2a_nccl_sync_each_us']:9.0f} {r['a2a_nccl_stream_us']:9.0f} "
                  f"{r['groupcomm_vs_nccl']:9.2f} {r['bytes_to_peers_per_rank'] / 1024:8.0f} "
                  f"{_f(r.get('dispatch_combine_share_of_step'), '.2f', 9)}")
        print("ours: GroupComm (deadline poll, so a host sync, per a2a); nccl: dist.all_to_all_single, "
              "one sync per call; +sync: after each a2a; strm: back-to-back; KiB wire: to + from the "
              "peer; d+c share: disp+comb x MoE layers / decode step")
    if res["prefill"]:
        print("\nprefill TP2 (experts split, all-reduce) vs one GPU")
        print(f"{'shape':>8} {'tok/s':>9} {'per GPU':>9} {'floor':>9} {'of fl':>6} {'1GPU':>9} {'x':>5}")
        for r in res["prefill"]:
            print(f"{r['shape']:>8} {r['tok_s']:9.0f} {r['tok_s_per_gpu']:9.0f} "
                  f"{_f(r.get('floor_tok_s'), '.0f', 9)} {_f(r.get('of_floor'), '.2f', 6)} "
                  f"{_f(r.get('single_tok_s'), '.0f', 9)} {_f(r.get('vs_single'), '.2f', 5)}")
    if res["check"] is not None:
        print()
        strict = res["args"]["check_pass_dtype"]
        for dtype, c in res["check"].items():
            lead = [p["leading_equal"] for p in c["prompts"]]
            verdict = ("PASS" if c["equal"] else "FAIL") if dtype == strict else \
                ("equal" if c["equal"] else "differ (informational)")
            kern = ", ".join(f"{k} {v}" for k, v in c["kernels"].items())
            print(f"check {dtype}: greedy tokens DP2xEP2 vs single GPU, {res['args']['check_prompts']} "
                  f"prompts x {res['args']['max_new']} tokens: {verdict}; leading equal tokens per "
                  f"prompt {lead}; kernels: {kern}")
            for who, err in c["errors"].items():
                print(f"  error {who}: {err.strip().splitlines()[-1][:300]}")
        if not res["check"].get(strict, {}).get("equal"):
            ok = False
    return ok


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="toy dimensions (CPU debugging)")
    ap.add_argument("--layers", type=int, help="bench model layers (48; tiny 2)")
    ap.add_argument("--batches", help="decode sequences per rank (16,64,128; tiny 2,4)")
    ap.add_argument("--ctx", type=int, help="decode context (1024; tiny 32)")
    ap.add_argument("--steps", type=int, help="timed decode steps (24; tiny 4)")
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--prefill", help="prefill shapes NxLEN (4x2048,8x2048; tiny 2x64)")
    ap.add_argument("--moe-iters", type=int, help="timed calls per MoE case (30; tiny 5)")
    ap.add_argument("--check-layers", type=int, help="layers of the check model (4; tiny 2)")
    ap.add_argument("--check-dtypes", default="bfloat16,float32", help="run in this order")
    ap.add_argument("--check-pass-dtype", default="float32",
                    help="the dtype whose token equality decides PASS/FAIL (others: reported)")
    ap.add_argument("--no-check-fallback", action="store_true",
                    help="on CUDA, do not retry a failed PASS-dtype check on torch reference kernels")
    ap.add_argument("--check-deadline-s", type=float, default=30.0)
    ap.add_argument("--check-prompts", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--no-graphs", action="store_true", help="skip the single-GPU CUDA-graph baseline")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline-s", type=float, default=60.0)
    ap.add_argument("--timeout-s", type=float, default=540.0,
                    help="whole run (ranks get at most 2/3 of it), then give up")
    args = ap.parse_args(argv)
    tiny = args.tiny
    defaults = dict(layers=(2, 48), batches=("2,4", "16,64,128"), ctx=(32, 1024), steps=(4, 24),
                    prefill=("2x64", "4x2048,8x2048"), moe_iters=(5, 30), check_layers=(2, 4))
    for name, (t, g) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, t if tiny else g)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    two_gpu = not set(args.phases.split(",")) <= {"single"}
    if args.device == "cuda" and torch.cuda.device_count() < WORLD and two_gpu:
        raise SystemExit(f"--device cuda needs {WORLD} GPUs, found {torch.cuda.device_count()} "
                         f"(use --device cpu --tiny here)")
    phases = [p for p in args.phases.split(",") if p]
    bad = set(phases) - set(PHASES)
    if bad:
        raise SystemExit(f"unknown phases {sorted(bad)}; known {PHASES}")
    opts = dict(device=args.device, tiny=args.tiny, layers=args.layers,
                batches=[int(b) for b in args.batches.split(",")], ctx=args.ctx, steps=args.steps,
                warm=args.warm,
                prefill=[tuple(int(v) for v in s.split("x")) for s in args.prefill.split(",")],
                moe_iters=args.moe_iters, check_layers=args.check_layers,
                check_dtypes=args.check_dtypes.split(","), check_prompts=args.check_prompts,
                check_pass_dtype=args.check_pass_dtype, check_fallback=not args.no_check_fallback,
                check_deadline_s=args.check_deadline_s,
                max_new=args.max_new, phases=phases, graphs=not args.no_graphs, seed=args.seed,
                deadline_s=args.deadline_s, t0=time.monotonic(),
                ports=_free_ports(2 + 2 * len(args.check_dtypes.split(","))))
    t_end = time.monotonic() + args.timeout_s
    ranks, single, errors, walls = {}, {}, {}, {}
    if {"check", "decode", "moe", "prefill"} & set(phases):
        t = time.monotonic()
        # at most 2/3 of the run: the single-GPU phase still gets its turn after a hang
        ranks, errs = run_procs(rank_main, WORLD, opts, args.timeout_s * 2 / 3)
        errors.update({f"rank{r}": e for r, e in errs.items()})
        walls["ranks"] = time.monotonic() - t
    if "single" in phases and ({"check", "decode", "prefill"} & set(phases)):
        t = time.monotonic()
        res, errs = run_procs(single_main, 1, opts, max(30.0, t_end - time.monotonic()))
        single = res.get(0, {})
        errors.update({"single": e for e in errs.values()})
        walls["single"] = time.monotonic() - t
    result = summarize(args, opts, ranks, single, errors, walls)
    path = os.path.join(os.environ.get("OUT", "."), "multi_gpu.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print()
    ok = print_report(result)
    print(f"JSON: {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
