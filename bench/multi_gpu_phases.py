"""The process entry points of `bench/multi_gpu.py`'s phases: `rank_main` (one rank of
the N-process group: decode and moe in DPN x EPN, TP prefill on the first `prefill_tp`
ranks, the token check in DPN x EPN) and `single_main` (the same weights in one process:
baselines and reference tokens), and the check's attempts with their fallback to the
torch reference kernels."""

from __future__ import annotations

import time
import traceback
from functools import partial

import torch

import multi_gpu_model as mm
from multi_gpu_moe import moe_bench
from multi_gpu_procs import file_barrier, free_memory, log, rendezvous, setup_device, sync
from multi_gpu_workloads import check_prompts, decode_bench, generate, prefill_bench


# ----------------------------------------------------------------------- check

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
                log(opts, f"check {dtype} ({mode}) failed: "
                          f"{traceback.format_exc().strip().splitlines()[-1][:300]}")
            finally:
                free_memory(dev)
    log(opts, "check done")
    return out


# ----------------------------------------------------------------------- ranks

def _rank_layout(rank: int, dev: torch.device, opts: dict, comm, tp: int, epoch: int,
                 init: str, cfg, dtype: str, batch: int, pages: int) -> mm.Stepper:
    """This rank's engine in `comm`'s group with TP=`tp` (DP = group size / tp), driven
    in lockstep; DP > 1 places the experts over all the group's ranks (EP)."""
    from phalanx.engine.llm_engine import LLMEngine
    from phalanx.actors.rank.spec import RankSpec, shard_for
    from phalanx.comm.dispatch import EPDispatcher
    from phalanx.models.parallel import ExpertParallel

    def config(eager: bool):
        return mm.engine_config(cfg, opts["device"], dtype, batch, pages, eager=eager,
                                ep_exchange=opts["ep_exchange"])

    # the engine runs eager; the rank captures the group's decode steps where it can
    # (peer exchange, tp 1, GPU: `Lockstep.use_graphs`) unless --group-eager
    spec = RankSpec(rank, tp, comm.world_size // tp, epoch, init, comm.deadline_s,
                    config(opts["group_eager"]))
    shard, placement = shard_for(spec, cfg.num_experts)
    ep = None
    if placement is not None:
        ep = ExpertParallel(EPDispatcher(comm, cfg.num_experts, placement[0], placement[1]))
    model = mm.build_model(cfg, shard, dev, mm.DTYPES[dtype], opts["seed"], comm, ep)
    engine = LLMEngine(config(True), shard, comm, ep, model=model)
    return mm.Stepper.for_rank(spec, comm, engine, ep)


def _rank_dp_ep(rank: int, world: int, opts: dict, dev: torch.device, layout) -> dict:
    """Phases decode and moe in DPN x EPN, N = world (one group for both)."""
    from phalanx.comm.group_comm import GroupComm

    phases, out = opts["phases"], {}
    init = rendezvous(opts, "dp_ep")
    comm = GroupComm.init(rank, world, 1, init, 1, opts["deadline_s"], device=opts["device"])
    cfg = mm.model_config(opts["tiny"], opts["layers"], "bfloat16")
    b = max(opts["batches"])
    st = layout(comm, 1, 1, init, cfg, "bfloat16", b,
                mm.pages_for(b, opts["ctx"] + opts["warm"] + opts["steps"] + 8))
    mm.randomize_kv(st.engine, opts["seed"])
    sync(dev)
    if rank == 0:
        log(opts, f"DP{world}xEP{world} model built ({cfg.num_hidden_layers} layers, "
                  f"{len(st.engine.model.shard.local_experts(cfg))} experts/rank, "
                  f"{sum(p.numel() for p in st.engine.model.parameters()) / 1e9:.2f} B params/rank)")
    with torch.inference_mode():
        if "decode" in phases:
            out["decode"] = decode_bench(st, opts, dev)
        if "moe" in phases:
            out["moe"] = moe_bench(comm, st.engine.model, opts, dev)
    del st
    free_memory(dev)
    comm.destroy()
    return out


def _rank_prefill(rank: int, opts: dict, dev: torch.device, layout) -> list[dict]:
    """Phase prefill in TP=`prefill_tp` on ranks 0 .. prefill_tp - 1."""
    from phalanx.comm.group_comm import GroupComm

    tp = opts["prefill_tp"]
    init = rendezvous(opts, "prefill")
    comm = GroupComm.init(rank, tp, tp, init, 2, opts["deadline_s"], device=opts["device"])
    cfg = mm.model_config(opts["tiny"], opts["layers"], "bfloat16")
    longest = max(n * L for n, L in opts["prefill"])
    st = layout(comm, tp, 2, init, cfg, "bfloat16", 64,
                mm.pages_for(1, longest) + 2 * mm.pages_for(64, 1))
    if rank == 0:
        log(opts, f"TP{tp} model built")
    with torch.inference_mode():
        rows = prefill_bench(st, opts, dev)
    del st
    free_memory(dev)
    comm.destroy()
    return rows


def _rank_check_attempt(rank: int, world: int, opts: dict, layout, dtype: str, index: int,
                        ref: bool) -> dict:
    """One check attempt in DPN x EPN: this rank's share of the prompts, greedy."""
    from phalanx.comm.group_comm import CollectiveError, GroupComm

    init = rendezvous(opts, f"check{index}")
    comm = GroupComm.init(rank, world, 1, init, 3 + index, opts["check_deadline_s"],
                          device=opts["device"])
    try:
        cfg = mm.model_config(opts["tiny"], opts["check_layers"], "bfloat16")
        st = layout(comm, 1, 3 + index, init, cfg, dtype, 8, mm.pages_for(8, 160))
        prompts = check_prompts(opts, cfg.vocab_size)
        mine = {i: p for i, p in enumerate(prompts) if i % world == rank}
        with torch.inference_mode():
            tokens = generate(st, mine, opts["max_new"])
        log(opts, f"check {dtype}: {st.graph_replays()} group steps replayed as graphs")
        return tokens
    except Exception as e:
        if comm.nccl and not isinstance(e, CollectiveError):
            comm._abort_nccl()  # the peer may sit in a collective: destroy must not block
        raise
    finally:
        comm.destroy()


def rank_main(rank: int, world: int, opts: dict) -> dict:
    """One rank of the N-process group: decode and moe in DPN x EPN, TP prefill (ranks past
    `prefill_tp` wait at a barrier), then the token check in DPN x EPN (last: a kernel
    failure there cannot cost the figures)."""
    dev = setup_device(rank, opts)
    opts = dict(opts, who=f"rank{rank}")
    phases, out = opts["phases"], {"rank": rank}
    layout = partial(_rank_layout, rank, dev, opts)
    if {"decode", "moe"} & set(phases):
        out.update(_rank_dp_ep(rank, world, opts, dev, layout))
    if "prefill" in phases:
        if rank < opts["prefill_tp"]:
            out["prefill"] = _rank_prefill(rank, opts, dev, layout)
        if opts["prefill_tp"] < world and "check" in phases:
            file_barrier(opts, "prefill_done", rank, world, opts["rank_timeout_s"])
    if "check" in phases:
        out["check"] = run_checks(opts, dev, partial(_rank_check_attempt, rank, world, opts, layout))
    return out


# ----------------------------------------------------------------------- single

def _single_engine(opts: dict, dev: torch.device, shard, cfg, dtype: str, batch: int, pages: int,
                   eager: bool, model=None):
    from phalanx.engine.llm_engine import LLMEngine

    model = model or mm.build_model(cfg, shard, dev, mm.DTYPES[dtype], opts["seed"])
    return LLMEngine(mm.engine_config(cfg, opts["device"], dtype, batch, pages, eager), model=model)


def _single_figures(opts: dict, dev: torch.device, shard, engine) -> dict:
    """Phases decode (eager, then with CUDA graphs) and prefill on the full model."""
    phases, out = opts["phases"], {}
    cfg = mm.model_config(opts["tiny"], opts["layers"], "bfloat16")
    b = max(opts["batches"])
    pages = max(mm.pages_for(b, opts["ctx"] + opts["warm"] + opts["steps"] + 8),
                mm.pages_for(1, max(n * L for n, L in opts["prefill"])) + 2 * mm.pages_for(64, 1))
    model = mm.build_model(cfg, shard, dev, torch.bfloat16, opts["seed"])
    log(opts, f"full model built ({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params)")
    with torch.inference_mode():
        eng = engine(cfg, "bfloat16", b, pages, eager=True, model=model)
        mm.randomize_kv(eng, opts["seed"])
        st = mm.Stepper(eng)
        if "decode" in phases:
            out["decode_eager"] = decode_bench(st, opts, dev)
        if "prefill" in phases:
            out["prefill"] = prefill_bench(st, opts, dev)
        del st, eng
        free_memory(dev)
        if "decode" in phases and dev.type == "cuda" and opts["graphs"]:
            t0 = time.perf_counter()
            eng = engine(cfg, "bfloat16", b, pages, eager=False, model=model)
            out["graph_capture_s"] = time.perf_counter() - t0
            log(opts, f"CUDA graphs captured in {out['graph_capture_s']:.1f} s")
            mm.randomize_kv(eng, opts["seed"])
            out["decode_graphs"] = decode_bench(mm.Stepper(eng), opts, dev)
            del eng
    del model
    free_memory(dev)
    return out


def _single_check_attempt(opts: dict, engine, dtype: str, index: int, ref: bool) -> dict:
    """One check attempt on the full model: every prompt, greedy (the reference tokens)."""
    cfg = mm.model_config(opts["tiny"], opts["check_layers"], "bfloat16")
    eng = engine(cfg, dtype, 8, mm.pages_for(8, 160), eager=True)
    prompts = dict(enumerate(check_prompts(opts, cfg.vocab_size)))
    with torch.inference_mode():
        return generate(mm.Stepper(eng), prompts, opts["max_new"])


def single_main(rank: int, world: int, opts: dict) -> dict:
    """The same weights on one GPU (or one CPU process): baselines, then reference tokens."""
    from phalanx.models.shard import ModelShard

    dev = setup_device(0, opts)
    opts = dict(opts, who="single")
    phases, out = opts["phases"], {}
    shard = ModelShard()
    engine = partial(_single_engine, opts, dev, shard)
    if dev.type == "cuda":
        out["ceilings"] = mm.measure_ceilings(dev)
        out["device_name"] = torch.cuda.get_device_name(dev)
        free_memory(dev)
    if {"decode", "prefill"} & set(phases):
        out.update(_single_figures(opts, dev, shard, engine))
    if "check" in phases:
        out["check"] = run_checks(opts, dev, partial(_single_check_attempt, opts, engine))
    return out
