"""Decode and prefill throughput on one GPU, Qwen3-30B-A3B shape, against the roofline
and Hugging Face transformers in the same run.

    python bench/decode_gpu.py [--layers 48] [--batches 1,16,64,128] [--skip-hf]
                               [--quantization fp8] [--baselines nopdl,cublas]

Random bf16 weights (no download). The transformers model is built first; phalanx's
model shares its weight tensors (bench/decode_hf.py), so both fit on one H200. Floors: decode bytes (weights touched + KV read) over the
measured copy bandwidth; prefill FLOPs over the measured bf16 matmul rate. Prints a
table last and writes JSON to $OUT/decode_gpu.json (or ./decode_gpu.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

from phalanx.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from phalanx.engine.llm_engine import LLMEngine
from phalanx.engine.sampling_params import SamplingParams
from phalanx.kernels.batch_invariant import batch_invariant_on

from decode_hf import build_hf, hf_decode_tok_s, phalanx_model_from_hf  # bench/
from multi_gpu_model import QWEN3_30B_A3B


def measure_ceilings() -> dict[str, float]:
    """Device-to-device copy bandwidth (read + write) and bf16 matmul rate."""
    from triton.testing import do_bench
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    bw = 2 * src.numel() * 2 / (ms * 1e-3)
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return {"copy_bytes_per_s": bw, "matmul_flops_per_s": 2 * 8192 ** 3 / (ms * 1e-3)}


def decode_bytes(cfg: ModelConfig, batch: int, ctx: int) -> float:
    """Bytes one decode step must read: dense weights, the experts the batch touches
    (expected count under uniform routing), the LM head and the KV cache."""
    h, hd, e, k = cfg.hidden_size, cfg.head_dim, cfg.num_experts, cfg.num_experts_per_tok
    attn = h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd + cfg.num_attention_heads * hd * h
    expert = 3 * h * cfg.moe_intermediate_size
    touched = e * (1 - (1 - k / e) ** batch)
    per_layer = attn + e * h + touched * expert
    weights = cfg.num_hidden_layers * per_layer + cfg.vocab_size * h
    kv = batch * ctx * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * hd
    return 2.0 * (weights + kv)


def prefill_flops(cfg: ModelConfig, num_seqs: int, length: int) -> float:
    h, hd = cfg.hidden_size, cfg.head_dim
    attn_w = h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd + cfg.num_attention_heads * hd * h
    active = cfg.num_hidden_layers * (attn_w + cfg.num_experts * h
                                      + cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size)
    tokens = num_seqs * length
    # causal attention: QK^T and PV over on average length/2 keys
    attn = num_seqs * cfg.num_hidden_layers * 2 * 2 * cfg.num_attention_heads * hd * length * length / 2
    return 2.0 * active * tokens + attn + 2.0 * num_seqs * cfg.vocab_size * h


MAX_MODEL_LEN = 4096  # --max-model-len's default


def make_engine(cfg: ModelConfig, model, max_batch: int, max_model_len: int) -> LLMEngine:
    """A bf16-cache engine over `model`; its decode graphs' block tables are
    `max_model_len` positions wide (a server's: the model's context unless set)."""
    config = EngineConfig(
        model_path="<in-memory>", model=cfg, device="cuda",
        cache=CacheConfig(page_size=16, num_pages=0, gpu_memory_utilization=0.92,
                          enable_prefix_caching=False),  # repeated prompts recompute: same tokens
        scheduler=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=16384,
                                  max_model_len=max_model_len),
        cuda_graph_max_batch=max_batch, batch_invariant=batch_invariant_on())
    return LLMEngine(config, model=model)


def graph_breakdown(engine: LLMEngine, batch: int, profile: bool) -> dict:
    """GPU time of one decode step (graph replay alone) and, optionally, its kernels."""
    graphs = engine.runner.graphs
    size = next(s for s in graphs.sizes if s >= batch)
    graph = graphs.graphs[size, False]
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    out = {"graph_size": size, "replay_ms": (time.perf_counter() - t) / 20 * 1e3}
    if profile:
        from torch.profiler import ProfilerActivity, profile as prof
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
        kernels: dict[str, float] = {}
        for ev in p.key_averages():
            us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            if us:
                kernels[ev.key[:60]] = kernels.get(ev.key[:60], 0.0) + us / 5
        out["kernels_us"] = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:20])
    return out


def host_profile(engine: LLMEngine, steps: int) -> list[str]:
    """The host functions that take the most time over a few decode steps (cProfile)."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
    return [line for line in buf.getvalue().splitlines() if line.strip()][-13:]


def phalanx_decode(engine: LLMEngine, batch: int, ctx: int, steps: int,
                   profile: bool = True) -> tuple[float, dict]:
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    rids = [f"d{batch}-{i}" for i in range(batch)]
    for rid in rids:
        engine.add_request(rid, torch.randint(0, 150000, (ctx,), generator=g).tolist(), params)
    while True:
        gone = [r for r in rids if r not in engine.sequences]
        if gone:
            raise RuntimeError(f"{len(gone)} of {batch} requests left an engine of "
                               f"{engine.num_pages} KV pages before their first token")
        if all(engine.sequences[r].output_token_ids for r in rids):
            break
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    detail = graph_breakdown(engine, batch, profile=profile and batch in (1, 64))
    if profile and batch in (1, 64):
        detail["host_profile"] = host_profile(engine, steps=10)
    detail["step_ms"] = dt / steps * 1e3
    # Greedy tokens of every request (prompts are seeded by batch): runs of the same
    # batch size, overlapped or not, must produce the same ones.
    detail["tokens"] = [list(engine.sequences[rid].output_token_ids) for rid in rids]
    for rid in rids:
        engine.abort_request(rid)
    return batch * steps / dt, detail


PREFILL_SEQS, PREFILL_LEN = 8, 2048  # the prefill row: 8 prompts of 2048 tokens in one step


def engine_seqs(batches: list[int], prefill: bool) -> int:
    """max_num_seqs for an engine that runs `batches` (and the prefill row): an engine sized
    for batch 1 alone would prefill the 8 prompts one at a time (0.32 of the floor, not 0.63)."""
    return max(max(batches), PREFILL_SEQS if prefill else 1)


def phalanx_prefill(engine: LLMEngine, num_seqs: int, length: int, reps: int = 3) -> float:
    """Tokens per second of prefilling `num_seqs` fresh prompts: one warm run, the median of
    `reps` timed ones."""
    assert engine.config.scheduler.max_num_seqs >= num_seqs, "the prompts would not share a step"
    g = torch.Generator().manual_seed(7)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def once(tag: str) -> float:
        for i in range(num_seqs):
            engine.add_request(f"p{tag}{i}", torch.randint(0, 150000, (length,), generator=g).tolist(), params)
        torch.cuda.synchronize()
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    once("warm")
    times = sorted(once(f"timed{i}") for i in range(reps))
    return num_seqs * length / times[len(times) // 2]


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--batches", default="1,16,64,128")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN,
                    help="the engine's (the block tables' width in the decode graphs); the "
                         "model's own, 40960 for Qwen3-30B-A3B, is what `phalanx serve` takes unset")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--compare-overlap", action="store_true",
                    help="also run batch 1 and 64 with overlapped steps off (rows 'decode-serial')")
    ap.add_argument("--no-prefill", action="store_true", help="skip the 8x2048 prefill row")
    ap.add_argument("--baselines", default="",
                    help="comma list of bench/decode_baselines.py's rows (nopdl, cublas, routefold, "
                         "...; one part switched); with --quantization fp8 also the FP8 rows again "
                         "with one FP8 part switched: fp8linear (the FP8 linear where the one-row "
                         "GEMV takes FP8 codes), fp8gemv16 (batches <= 4: the FP8 GEMVs' 64 KiB-"
                         "tile rows), fp8gemvdeq (batches <= 4: the FP8 GEMVs dequantizing "
                         "each code), fp8dequant (the experts dequantizing each code "
                         "instead of dotting the codes in float16), fp8tritonlin (the linears "
                         "past 16 rows by the Triton kernel, not cuBLAS; the prefill row too)")
    ap.add_argument("--quantization", choices=("none", "fp8"), default="none",
                    help="fp8: the bf16 rows run the FP8 weights' dequantized twin, then rows "
                         "'decode-fp8' / 'prefill-fp8' the FP8 weights (bench/decode_fp8.py)")
    return ap.parse_args()


def decode_rows(engine: LLMEngine, kind: str, batches: list[int], args, bytes_per_s: float,
                step_bytes, hf_rates: dict, profile: bool = True) -> list[dict]:
    """One row per batch: tok/s, its floor (`step_bytes(batch, ctx)` over the copy rate)."""
    rows = []
    for b in batches:
        tok_s, detail = phalanx_decode(engine, b, args.ctx, args.steps, profile=profile)
        floor_s = step_bytes(b, args.ctx + args.steps // 2) / bytes_per_s
        rows.append(dict(kind=kind, batch=b, tok_s=tok_s, floor_tok_s=b / floor_s,
                         frac=tok_s * floor_s / b, hf_tok_s=hf_rates.get(b),
                         vs_hf=tok_s / hf_rates[b] if b in hf_rates else None, **detail))
        print(f"{kind} batch {b}: {tok_s:.0f} tok/s, {rows[-1]['frac']:.3f} of its floor", flush=True)
    return rows


def compare_overlap(engine: LLMEngine, batches: list[int], args, ceil: dict, cfg: ModelConfig,
                    hf_rates: dict, rows: list[dict]) -> list[dict]:
    """Rows 'decode-serial' (batch 1 and 64, overlapped steps off), tokens checked."""
    engine.overlap = False
    serial = decode_rows(engine, "decode-serial", [b for b in batches if b in (1, 64)], args,
                         ceil["copy_bytes_per_s"], lambda b, c: decode_bytes(cfg, b, c), hf_rates,
                         profile=False)
    engine.overlap = True
    for r in serial:
        over = next(o for o in rows if o["kind"] == "decode" and o["batch"] == r["batch"])
        n = min(len(a) for a in r["tokens"] + over["tokens"])
        r["tokens_equal_overlapped"] = all(a[:n] == b[:n] for a, b in zip(r["tokens"], over["tokens"]))
        r["distinct_tokens"] = len({t for a in r["tokens"] for t in a})
        print(f"batch {r['batch']}: overlapped vs serial greedy tokens equal "
              f"(first {n}): {r['tokens_equal_overlapped']}; distinct tokens {r['distinct_tokens']}")
    return serial


def fp8_rows(hf, cfg: ModelConfig, batches: list[int], args, ceil: dict, bf16: list[dict],
             name: str = "fp8", prefill: bool = True) -> list[dict]:
    """The same batches and (with `prefill`) prefill over the FP8 weights, rows 'decode-<name>'
    and 'prefill-<name>'; tokens against the bf16 twin's."""
    from decode_fp8 import decode_bytes_fp8, prefill_seconds_fp8, quantize_in_place, token_agreement
    model = phalanx_model_from_hf(hf, cfg)
    quantize_in_place(model)
    prefill = prefill and not args.no_prefill
    kind = f"decode-{name}"
    engine = make_engine(cfg, model, engine_seqs(batches, prefill), args.max_model_len)
    rows = decode_rows(engine, kind, batches, args, ceil["copy_bytes_per_s"],
                       lambda b, c: decode_bytes_fp8(cfg, b, c), {})
    for r in rows:
        twin = next(o for o in bf16 if o["kind"] == "decode" and o["batch"] == r["batch"])
        r["vs_bf16"] = r["tok_s"] / twin["tok_s"]
        r["agreement"] = token_agreement(r["tokens"], twin["tokens"])
    if prefill:
        pf = phalanx_prefill(engine, PREFILL_SEQS, PREFILL_LEN)
        floor = PREFILL_SEQS * PREFILL_LEN / prefill_seconds_fp8(cfg, PREFILL_SEQS, PREFILL_LEN, ceil)
        rows.append(dict(kind=f"prefill-{name}", batch=8, tok_s=pf, floor_tok_s=floor, frac=pf / floor,
                         hf_tok_s=None, vs_hf=None,
                         vs_bf16=pf / next(o["tok_s"] for o in bf16 if o["kind"] == "prefill")))
    del engine, model
    gc.collect()
    torch.cuda.empty_cache()  # the next engine sizes its KV pool from the free memory
    return rows


def print_table(rows: list[dict], ceil: dict, args, num_pages: int) -> None:
    for r in rows:
        if "kernels_us" in r:
            print(f"{r['kind']} batch {r['batch']}: step {r['step_ms']:.2f} ms, graph replay "
                  f"{r['replay_ms']:.2f} ms; kernels (us/step): "
                  + ", ".join(f"{k}={v:.0f}" for k, v in r["kernels_us"].items()))
            print("\n".join(r.get("host_profile", [])))
        if "main_over_this" in r:
            print(f"{r['kind']} batch {r['batch']}: tokens vs the main rows {r.get('agreement', '-')}; "
                  f"main tok/s over this {r['main_over_this']:.3f}")
        elif "agreement" in r:
            print(f"{r['kind']} batch {r['batch']}: tokens vs the bf16 twin {r['agreement']}")
    fp8 = f", FP8 matmul {ceil['fp8_matmul_flops_per_s'] / 1e12:.0f}" if "fp8_matmul_flops_per_s" in ceil else ""
    print(f"copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul {ceil['matmul_flops_per_s'] / 1e12:.0f} "
          f"TFLOP/s{fp8}, {args.layers} layers, ctx {args.ctx}, max_model_len {args.max_model_len}, "
          f"{num_pages} KV pages (bf16 engine)")
    print(f"{'what':13} {'batch':>5} {'tok/s':>10} {'floor tok/s':>12} {'of floor':>9} {'HF tok/s':>9} "
          f"{'x HF':>6} {'x bf16':>6} {'step ms':>8} {'GPU ms':>7}")
    for r in rows:
        hf_s = f"{r['hf_tok_s']:9.0f}" if r["hf_tok_s"] else f"{'-':>9}"
        vs = f"{r['vs_hf']:6.1f}" if r["vs_hf"] else f"{'-':>6}"
        vb = f"{r['vs_bf16']:6.2f}" if r.get("vs_bf16") else f"{'-':>6}"
        step = f"{r['step_ms']:8.2f} {r['replay_ms']:7.2f}" if "step_ms" in r else ""
        print(f"{r['kind']:13} {r['batch']:5d} {r['tok_s']:10.0f} {r['floor_tok_s']:12.0f} "
              f"{r['frac']:9.2f} {hf_s} {vs} {vb} {step}")


def main() -> None:
    args = _parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    hf_cfg = dict(QWEN3_30B_A3B, num_hidden_layers=args.layers)
    cfg = ModelConfig.from_hf(hf_cfg)
    ceil = measure_ceilings()
    hf = build_hf(hf_cfg)
    if args.quantization == "fp8":
        from decode_fp8 import fp8_matmul_rate, make_twin_in_place
        make_twin_in_place(hf)
        ceil["fp8_matmul_flops_per_s"] = fp8_matmul_rate()
    hf_rates = {}
    if not args.skip_hf:
        for b in (1, 64):
            hf_rates[b] = hf_decode_tok_s(hf, b, args.ctx, steps=8)
        torch.cuda.empty_cache()
    engine = make_engine(cfg, phalanx_model_from_hf(hf, cfg), engine_seqs(batches, not args.no_prefill),
                         args.max_model_len)
    rows = decode_rows(engine, "decode", batches, args, ceil["copy_bytes_per_s"],
                       lambda b, c: decode_bytes(cfg, b, c), hf_rates)
    if args.compare_overlap:
        rows += compare_overlap(engine, batches, args, ceil, cfg, hf_rates, rows)
    def prefill_row(eng: LLMEngine, kind: str) -> dict:
        pf = phalanx_prefill(eng, PREFILL_SEQS, PREFILL_LEN)
        pf_floor = PREFILL_SEQS * PREFILL_LEN * ceil["matmul_flops_per_s"] / prefill_flops(cfg, PREFILL_SEQS, PREFILL_LEN)
        return dict(kind=kind, batch=8, tok_s=pf, floor_tok_s=pf_floor, frac=pf / pf_floor,
                    hf_tok_s=None, vs_hf=None)

    if not args.no_prefill:
        rows.append(prefill_row(engine, "prefill"))
    num_pages = engine.num_pages
    del engine  # the runs below build engines of their own
    gc.collect()
    torch.cuda.empty_cache()
    from decode_fp8 import FP8_BASELINES

    names = [n for n in args.baselines.split(",") if n]
    fp8_only = [n for n in names if n in FP8_BASELINES]
    if fp8_only and args.quantization != "fp8":
        raise SystemExit(f"--baselines {','.join(fp8_only)} needs --quantization fp8")
    names = [n for n in names if n not in fp8_only]
    if names:
        from decode_baselines import baseline_rows, baseline_width
        rows += baseline_rows(
            names,
            lambda: make_engine(cfg, phalanx_model_from_hf(hf, cfg, baseline_width()), max(batches),
                                args.max_model_len),
            lambda eng, kind, bs: decode_rows(eng, kind, bs, args, ceil["copy_bytes_per_s"],
                                              lambda b, c: decode_bytes(cfg, b, c), hf_rates),
            rows, batches, None if args.no_prefill else prefill_row)
    if args.quantization == "fp8":
        rows += fp8_rows(hf, cfg, batches, args, ceil, rows)
    for name in fp8_only:  # the FP8 rows again with one FP8 part switched
        switch, takes, prefill = FP8_BASELINES[name]
        switch(True)
        try:
            rows += fp8_rows(hf, cfg, [b for b in batches if takes(b)], args, ceil, rows,
                             name=name, prefill=prefill)
        finally:
            switch(False)
    result = dict(ceilings=ceil, layers=args.layers, ctx=args.ctx, max_model_len=args.max_model_len, num_pages=num_pages,
                  quantization=args.quantization, rows=rows, device=torch.cuda.get_device_name())
    out = os.path.join(os.environ.get("OUT", "."), "decode_gpu.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print_table(rows, ceil, args, num_pages)


if __name__ == "__main__":
    main()
