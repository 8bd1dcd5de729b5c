"""Where the time of one prefill goes (issue 31 item 3: 8x2048 at >= 0.60 of the matmul
floor; measured 0.52-0.54), on one GPU, Qwen3-30B-A3B shape, random bf16 weights.

    python bench/probes/prefill_profile.py [--layers 8] [--seqs 8] [--length 2048] [--reps 3]
                                           [--quantization fp8] [--batch-invariant]
    python bench/probes/prefill_profile.py --dry-run     # CPU, tiny dims: checks the code

Engine as bench/decode_gpu.py builds it (`make_engine`; random weights from
bench/multi_gpu_model.py's `build_model`). Times `--seqs` prompts of `--length` tokens like
decode_gpu's prefill row (one warm, `--reps` timed): tok/s, fraction of the floor
`prefill_flops / measured matmul rate`. Then one prefill under torch.profiler (CUDA
kernels; CPU ops with shapes tell the cuBLAS GEMMs apart): top kernels, groups with
their own FLOPs floors, kernel time vs wall time; and one under cProfile (host functions).
JSON to $OUT/prefill_profile.json (or ./prefill_profile.json).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import decode_gpu  # noqa: E402  (bench/)
import multi_gpu_model as mgm  # noqa: E402

from phalanx.config import ModelConfig  # noqa: E402
from phalanx.engine.llm_engine import LLMEngine  # noqa: E402
from phalanx.engine.sampling_params import SamplingParams  # noqa: E402
from phalanx.models.shard import ModelShard  # noqa: E402

MM_OPS = ("aten::mm", "aten::addmm", "aten::bmm")
NAME_GROUPS = [  # (group, exact names of the Triton kernels in it)
    ("moe gate_up", ("_gate_up_kernel", "_fp8_gate_up_kernel")),
    ("moe down", ("_down_kernel", "_fp8_down_kernel")),
    ("moe other", ("_count_kernel", "_align_kernel", "_combine_kernel", "_route_kernel")),
    ("gemm fp8", ("_fp8_linear_kernel",)), ("fp8 quant", ("_quant_kernel",)),
    ("attention prefill", ("_prefill_kernel", "_prefill_split_kernel", "_decode_reduce_kernel")),
    ("gemm invariant", ("_gemm_kernel",)), ("gemm skinny", ("_skinny_kernel", "_splitk_reduce_kernel")),
    ("norm/rope/act/kv", ("_rms_norm_kernel", "_rope_kernel", "_silu_and_mul_kernel", "_write_kv_kernel"))]
GEMM_HINTS = ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "aten::mm", "aten::addmm")


def group_of(name: str) -> str:
    for group, names in NAME_GROUPS:
        if name in names:
            return group
    return "gemm" if any(h in name.lower() for h in GEMM_HINTS) else "other"


def gemm_label(cfg: ModelConfig, shapes) -> str:
    """qkv / o / router / lm head from aten::mm's [[M, K], [K, N]] (or addmm's)."""
    mats = [s for s in shapes if isinstance(s, list) and len(s) == 2]
    k, n = mats[-1] if len(mats) >= 2 else (0, 0)
    h, hd = cfg.hidden_size, cfg.head_dim
    qh, kvh = cfg.num_attention_heads, cfg.num_key_value_heads
    labels = {(h, (qh + 2 * kvh) * hd): "gemm qkv", (qh * hd, h): "gemm o", (h, cfg.num_experts): "gemm router"}
    return "gemm lm head" if n == cfg.vocab_size else labels.get((k, n), f"gemm {k}x{n}" if k else "gemm ?")


def group_flops(cfg: ModelConfig, seqs: int, length: int) -> dict[str, float]:
    """FLOPs of each group's matmuls in one prefill; they sum to decode_gpu.prefill_flops."""
    L, T, h, hd = cfg.num_hidden_layers, seqs * length, cfg.hidden_size, cfg.head_dim
    qh, kvh, i = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.moe_intermediate_size
    pairs = T * cfg.num_experts_per_tok
    return {"moe gate_up": L * 4.0 * pairs * h * i, "moe down": L * 2.0 * pairs * i * h,
            "attention prefill": seqs * L * 2 * 2 * qh * hd * length * length / 2,
            "gemm qkv": L * 2.0 * T * h * (qh + 2 * kvh) * hd, "gemm o": L * 2.0 * T * qh * hd * h,
            "gemm router": L * 2.0 * T * h * cfg.num_experts,
            "gemm lm head": 2.0 * seqs * cfg.vocab_size * h}


def build(args):
    dev, dtype = ("cpu", torch.float32) if args.dry_run else ("cuda", torch.bfloat16)
    cfg = ModelConfig.from_hf(dict(mgm.TINY if args.dry_run else decode_gpu.QWEN3_30B_A3B,
                                   num_hidden_layers=args.layers, dtype=str(dtype).split(".")[1]))
    model = mgm.build_model(cfg, ModelShard(), torch.device(dev), dtype, 0)
    if args.quantization == "fp8":
        from decode_fp8 import quantize_in_place
        quantize_in_place(model)
    if not args.dry_run:
        from phalanx.kernels.batch_invariant import batch_invariant
        batch_invariant(args.batch_invariant)  # make_engine takes the process's mode
        return cfg, decode_gpu.make_engine(cfg, model, args.seqs, decode_gpu.MAX_MODEL_LEN)
    conf = mgm.engine_config(cfg, "cpu", "float32", args.seqs, mgm.pages_for(args.seqs, args.length), True)
    return cfg, LLMEngine(conf, model=model)


def prefill_once(engine, cfg, args, g, tag: str, cuda: bool, host=None) -> float:
    """decode_gpu.phalanx_prefill's `once`: seconds to prefill `seqs` fresh prompts
    (`host`: a cProfile.Profile enabled around the steps)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i in range(args.seqs):
        ids = torch.randint(0, min(150000, cfg.vocab_size), (args.length,), generator=g)
        engine.add_request(f"p{tag}{i}", ids.tolist(), params)
    torch.cuda.synchronize() if cuda else None
    t = time.perf_counter()
    host.enable() if host else None
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize() if cuda else None
    host.disable() if host else None
    return time.perf_counter() - t


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3, help="timed prefills after the warm one")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny dims (2 layers unless --layers)")
    ap.add_argument("--quantization", choices=("none", "fp8"), default="none",
                    help="fp8: the projections and experts as block-scaled FP8 (bench/decode_fp8.py); "
                         "groups' floors stay at the bf16 matmul rate")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="the batch-invariant mode's kernels (kernels/batch_invariant.py; GPU only)")
    args = ap.parse_args()
    if args.dry_run:  # tiny defaults: 2 layers, 2x64
        args.layers, args.seqs, args.length = [int(getattr(args, a)) if f"--{a}" in sys.argv else d
                                               for a, d in (("layers", 2), ("seqs", 2), ("length", 64))]
    return args


def kernel_records(evs, cuda: bool) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every device kernel / memcpy / memset; in a dry
    run the CPU ops' self time stands in for kernels."""
    from torch.autograd import DeviceType
    if cuda:
        return [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in evs
                if e.device_type == DeviceType.CUDA]
    return [(e.name, e.time_range.start, e.self_cpu_time_total) for e in evs
            if e.device_type == DeviceType.CPU and e.self_cpu_time_total > 0]


def busy_and_span(recs) -> tuple[float, float]:
    """The union of the kernels' intervals (us) and first start to last end (us)."""
    busy_us, end = 0.0, -1.0
    for _, s, d in sorted(recs, key=lambda r: r[1]):
        busy_us += max(0.0, s + d - max(s, end))
        end = max(end, s + d)
    return busy_us, max(s + d for _, s, d in recs) - min(s for _, s, _ in recs)


def group_times(recs, evs, cfg, cuda: bool) -> tuple[dict, dict]:
    """({kernel name: [calls, us]}, {group: us}), cuBLAS GEMMs split by the launching
    op's shapes."""
    from torch.autograd import DeviceType
    by_name: dict[str, list] = {}
    groups: dict[str, float] = {}
    for name, _, d in recs:
        c = by_name.setdefault(name, [0, 0.0])
        c[0], c[1] = c[0] + 1, c[1] + d
        groups[group_of(name)] = groups.get(group_of(name), 0.0) + d
    split: dict[str, float] = {}
    for e in (e for e in evs if e.device_type == DeviceType.CPU and e.name in MM_OPS):
        lab = gemm_label(cfg, e.input_shapes)
        us = sum(k.duration for k in e.kernels if group_of(k.name) == "gemm") if cuda else e.self_cpu_time_total
        split[lab] = split.get(lab, 0.0) + us
    if "gemm" in groups:
        rest = groups.pop("gemm") - sum(split.values())
        groups.update(split)
        groups.update({"gemm unmapped": rest} if rest > 1.0 else {})
    return by_name, groups


def print_report(result: dict, host_top: list[str], out: str) -> None:
    r, rate, flops = result, result["matmul_flops_per_s"], result["prefill_flops"]
    walls, wall, target_ms = r["walls_ms"], r["wall_ms"], r["target_ms_at_060"]
    print(f"\n{r['device']}: matmul {rate / 1e12:.1f} TFLOP/s; {r['layers']} layers, "
          f"{r['seqs']}x{r['length']}; prefill {flops / 1e12:.2f} TFLOP (groups sum "
          f"{r['group_flops_sum'] / 1e12:.2f}), floor {r['floor_ms']:.2f} ms\nprefill wall ms "
          f"{', '.join(f'{w:.2f}' for w in walls)} -> median {wall:.2f}: "
          f"{r['tok_s']:.0f} tok/s, {r['frac']:.3f} of the matmul floor "
          f"(0.60 needs {target_ms:.2f} ms: cut {wall - target_ms:.2f} ms)")
    print(f"profiled prefill: wall {r['profiled_wall_ms']:.2f} ms, kernels sum "
          f"{r['kernel_sum_ms']:.2f} ms, GPU busy {r['gpu_busy_ms']:.2f} ms, first->last kernel "
          f"{r['kernel_span_ms']:.2f} ms; unprofiled wall - busy = {wall - r['gpu_busy_ms']:.2f} ms")
    print(f"\nhost functions of one prefill under cProfile (wall {r['host_wall_ms']:.2f} ms): top 12 "
          f"by self time, then top 12 by cumulative\n{'self ms':>8} {'cum ms':>8} {'calls':>6}  function")
    print("\n".join(host_top))
    print(f"\n{'kernel':52} {'calls':>5} {'ms':>8} {'share':>6}  group")
    for k in r["top_kernels"]:
        print(f"{k['name'][:52]:52} {k['calls']:5d} {k['ms']:8.3f} {k['share']:6.1%}  {k['group']}")
    print(f"\n{'group':20} {'ms':>8} {'share':>6} {'TFLOP':>7} {'floor ms':>9} {'achieved':>8}")
    for g in r["groups"]:
        fl = f"{g['flops'] / 1e12:7.3f} {g['floor_ms']:9.3f} {g['achieved']:8.2f}" if g["flops"] else ""
        print(f"{g['group']:20} {g['ms']:8.3f} {g['share']:6.1%} {fl}")
    print(f"wrote {out}")


def main() -> None:
    args = parse_args()
    cuda = not args.dry_run
    from torch.profiler import ProfilerActivity, profile
    rate = decode_gpu.measure_ceilings()["matmul_flops_per_s"] if cuda else 1e11  # dry: nominal
    cfg, engine = build(args)
    flops = decode_gpu.prefill_flops(cfg, args.seqs, args.length)
    floor_s, target_ms = flops / rate, flops / rate / 0.60 * 1e3
    g = torch.Generator().manual_seed(7)
    prefill_once(engine, cfg, args, g, "warm", cuda)
    walls = [prefill_once(engine, cfg, args, g, f"t{r}", cuda) for r in range(args.reps)]
    wall = sorted(walls)[len(walls) // 2]
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda, record_shapes=True) as prof:
        prof_wall = prefill_once(engine, cfg, args, g, "prof", cuda)
    evs, host = prof.events(), cProfile.Profile()
    host_wall, st = prefill_once(engine, cfg, args, g, "host", cuda, host), pstats.Stats(host).stats
    host_top = [f"{tt * 1e3:8.2f} {ct * 1e3:8.2f} {nc:6d}  {os.path.basename(f)}:{ln}({fn})" for key in (2, 3)
                for (f, ln, fn), (_, nc, tt, ct, _) in sorted(st.items(), key=lambda kv: -kv[1][key])[:12]]
    recs = kernel_records(evs, cuda)
    kernel_us = sum(r[2] for r in recs)
    busy_us, span_us = busy_and_span(recs)
    by_name, groups = group_times(recs, evs, cfg, cuda)
    gfl, rows = group_flops(cfg, args.seqs, args.length), []
    for grp, us in sorted(((k, v) for k, v in groups.items() if v > 0), key=lambda kv: -kv[1]):
        fl = gfl.get(grp)
        rows.append(dict(group=grp, ms=us / 1e3, share=us / kernel_us, flops=fl, floor_ms=fl / rate * 1e3
                         if fl else None, achieved=fl / rate / (us * 1e-6) if fl else None))
    top = [dict(name=n, calls=c, ms=us / 1e3, share=us / kernel_us, group=group_of(n))
           for n, (c, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]]
    result = dict(device=torch.cuda.get_device_name() if cuda else "cpu (dry run)", layers=args.layers,
                  quantization=args.quantization,
                  seqs=args.seqs, length=args.length, matmul_flops_per_s=rate, prefill_flops=flops,
                  floor_ms=floor_s * 1e3, walls_ms=[w * 1e3 for w in walls], wall_ms=wall * 1e3,
                  tok_s=args.seqs * args.length / wall, frac=floor_s / wall, target_ms_at_060=target_ms,
                  profiled_wall_ms=prof_wall * 1e3, kernel_sum_ms=kernel_us / 1e3,
                  gpu_busy_ms=busy_us / 1e3, kernel_span_ms=span_us / 1e3, groups=rows,
                  top_kernels=top, group_flops_sum=sum(gfl.values()), host_wall_ms=host_wall * 1e3,
                  host_top=host_top)
    out = os.path.join(os.environ.get("OUT", "."), "prefill_profile.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print_report(result, host_top, out)


if __name__ == "__main__":
    main()
