"""N-GPU layouts on the Qwen3-30B-A3B shape: decode DP=N x EP=N, prefill TP=min(N, 4),
MoE dispatch/combine against plain NCCL all-to-all, and greedy tokens against one GPU.

    python bench/multi_gpu.py [--world N] [--prefill-tp T] [--layers 48] [--batches 16,64,128]
    python bench/multi_gpu.py --device cpu --tiny [--world 4]  # same code paths, gloo, < 60 s

`--world` (default: every visible GPU; 2 on CPU) ranks, one GPU each. Prefill TP
(`--prefill-tp`, default min(N, 4)) runs on ranks 0 .. T-1 while the others wait; the
model has 4 KV heads, so TP 8 holds each KV head on 2 ranks (allowed; the table says so).
Phases (`--phases`, default all), each in spawned processes, one GPU each:
1. ranks (N processes, `GroupComm.init(rank, N, tp, file://..., device=)`; NCCL for CUDA
   tensors through its deadline wait loop, gloo for plans), eager:
   - check: a `--check-layers` model per `--check-dtypes` in the DPN x EPN layout
     (each rank full attention, 1/N of the experts, `EPDispatcher` all-to-alls);
     `--check-prompts` (default max(4, N)) prompts split round-robin over the N DP
     ranks, greedy, `--max-new` tokens;
   - decode: DPN x EPN, `--batches` sequences per rank admitted as already prefilled
     with `--ctx` tokens (pages reserved and `admit_prefilled`, as a disaggregated
     decode rank does; the KV pool holds random normal data), `--warm` steps, then
     `--steps` timed steps of `Lockstep.step` (DP agreement included) on every rank;
   - moe: per-layer MoE of layer 0 at the same per-rank token counts: `EPDispatcher.moe`
     with the experts, with an identity expert (dispatch + combine only), its four
     all-to-alls through `GroupComm` (counts, rows, metadata, return rows; splits
     known), the same four through `torch.distributed.all_to_all_single` directly
     (NCCL, gloo on CPU; no deadline loop: synced once per call, once after each
     all-to-all, and back-to-back with one sync per `--moe-iters` calls), and the
     local expert compute alone. Medians of host wall time per call; bytes per peer.
   - prefill: TP=T (experts split over the T ranks, all-reduce combine), leader rank 0
     schedules and broadcasts plans; `--prefill` shapes, one warm run then one timed.
2. single (1 process, GPU 0): the same weights on one GPU: the check's reference tokens
   (eager), decode at the same per-GPU batches eager and with CUDA graphs, the same
   prefill shapes, and the copy bandwidth / matmul rate behind the floors.

Weights: random, a deterministic function of (seed, parameter, expert) built directly on
the device (bench/multi_gpu_model.py), so every layout holds slices of one model.
Floors: decode bytes per GPU (dense weights + LM head + its experts touched by the
group's tokens + its KV; all-to-all bytes not counted) over the measured copy
bandwidth; prefill FLOPs (split over the T GPUs) over the measured matmul rate.
Prints a table last; writes JSON to $OUT/multi_gpu.json (or ./multi_gpu.json).
Code: this file parses and runs the phases; the process entry points are in
multi_gpu_phases.py (workloads in multi_gpu_workloads.py, the MoE layer in
multi_gpu_moe.py), spawning and device plumbing in multi_gpu_procs.py, the summary and
tables in multi_gpu_report.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1",
               "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}.items():
    os.environ.setdefault(_k, _v)  # multicast stays off on the GPU machine

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multi_gpu_phases import rank_main, single_main  # noqa: E402
from multi_gpu_procs import CPU_WORLD, run_procs  # noqa: E402
from multi_gpu_report import print_report, summarize  # noqa: E402

PHASES = ("check", "decode", "moe", "prefill", "single")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="toy dimensions (CPU debugging)")
    ap.add_argument("--world", type=int, help="ranks N: decode DPN x EPN (all GPUs; CPU 2)")
    ap.add_argument("--prefill-tp", type=int, help="prefill TP on ranks 0..T-1 (min(N, 4))")
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
    ap.add_argument("--check-prompts", type=int, help="prompts of the check (max(4, N))")
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--no-graphs", action="store_true", help="skip the single-GPU CUDA-graph baseline")
    ap.add_argument("--ep-exchange", choices=("exact", "padded", "peer"), default="exact",
                    help="MoE all-to-all of the DPN x EPN ranks (ParallelConfig.ep_exchange)")
    ap.add_argument("--group-eager", action="store_true",
                    help="peer exchange: launch the group's decode steps eagerly, not as "
                         "CUDA graphs")
    ap.add_argument("--share-gpus", action="store_true",
                    help="let --world exceed the GPUs: rank r uses GPU r %% count (a smoke "
                         "run: ranks sharing a GPU time-slice it, timings mean little)")
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
    if args.world is None:
        args.world = torch.cuda.device_count() if args.device == "cuda" else CPU_WORLD
    if args.prefill_tp is None:
        args.prefill_tp = min(args.world, 4)
    if args.check_prompts is None:
        args.check_prompts = max(4, args.world)
    return args


def check_layout(args, phases: list[str]) -> None:
    """Exit with a message when the machine or the model cannot hold the layouts."""
    from multi_gpu_model import model_config
    from phalanx.models.shard import ModelShard

    n, tp = args.world, args.prefill_tp
    bad = set(phases) - set(PHASES)
    if bad:
        raise SystemExit(f"unknown phases {sorted(bad)}; known {PHASES}")
    if n < 2 or not 2 <= tp <= n:
        raise SystemExit(f"need --world >= 2 and 2 <= --prefill-tp <= --world, got {n}, {tp}")
    found = torch.cuda.device_count()
    if (args.device == "cuda" and found < n and not args.share_gpus
            and not set(phases) <= {"single"}):
        raise SystemExit(f"--device cuda --world {n} needs {n} GPUs, found {found} "
                         f"(use --device cpu --tiny here)")
    cfg = model_config(args.tiny, args.layers, "bfloat16")
    if cfg.num_experts < n:
        raise SystemExit(f"DP{n}xEP{n} needs >= {n} experts, the model has {cfg.num_experts}")
    try:
        ModelShard(0, tp).validate(cfg)
    except ValueError as e:
        raise SystemExit(f"--prefill-tp {tp}: {e}") from None


def make_opts(args, phases: list[str], rdv_dir: str) -> dict:
    return dict(device=args.device, tiny=args.tiny, layers=args.layers,
                world=args.world, prefill_tp=args.prefill_tp,
                batches=[int(b) for b in args.batches.split(",")], ctx=args.ctx, steps=args.steps,
                warm=args.warm,
                prefill=[tuple(int(v) for v in s.split("x")) for s in args.prefill.split(",")],
                moe_iters=args.moe_iters, check_layers=args.check_layers,
                check_dtypes=args.check_dtypes.split(","), check_prompts=args.check_prompts,
                check_pass_dtype=args.check_pass_dtype, check_fallback=not args.no_check_fallback,
                check_deadline_s=args.check_deadline_s,
                max_new=args.max_new, phases=phases, graphs=not args.no_graphs, seed=args.seed,
                deadline_s=args.deadline_s, t0=time.monotonic(), ep_exchange=args.ep_exchange,
                group_eager=args.group_eager,
                rank_timeout_s=args.timeout_s * 2 / 3, rdv_dir=rdv_dir)


def run_phases(args, opts: dict) -> tuple[dict, dict, dict, dict]:
    """The ranks' processes, then the single process; (ranks, single, errors, walls)."""
    phases = set(opts["phases"])
    t_end = time.monotonic() + args.timeout_s
    ranks, single, errors, walls = {}, {}, {}, {}
    if {"check", "decode", "moe", "prefill"} & phases:
        t = time.monotonic()
        # at most 2/3 of the run: the single-GPU phase still gets its turn after a hang
        ranks, errs = run_procs(rank_main, args.world, opts, opts["rank_timeout_s"])
        errors.update({f"rank{r}": e for r, e in errs.items()})
        walls["ranks"] = time.monotonic() - t
    if "single" in phases and ({"check", "decode", "prefill"} & phases):
        t = time.monotonic()
        res, errs = run_procs(single_main, 1, opts, max(30.0, t_end - time.monotonic()))
        single = res.get(0, {})
        errors.update({"single": e for e in errs.values()})
        walls["single"] = time.monotonic() - t
    return ranks, single, errors, walls


def main(argv=None) -> int:
    args = parse_args(argv)
    phases = [p for p in args.phases.split(",") if p]
    check_layout(args, phases)
    if args.device == "cpu" and args.ep_exchange == "peer":  # its kernels, on CPU tensors
        os.environ.setdefault("TRITON_INTERPRET", "1")  # (inherited by the rank processes)
    rdv_dir = tempfile.mkdtemp(prefix="multi_gpu_rdv_")  # file rendezvous of every group
    try:
        opts = make_opts(args, phases, rdv_dir)
        ranks, single, errors, walls = run_phases(args, opts)
    finally:
        shutil.rmtree(rdv_dir, ignore_errors=True)
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
