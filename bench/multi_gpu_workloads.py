"""Engine workloads of `bench/multi_gpu.py`, the same in every layout: the check's greedy
generation, timed decode steps of admitted sequences, timed prefill shapes."""

from __future__ import annotations

import time

import torch

import multi_gpu_model as mm
from multi_gpu_procs import log, sync


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
        sync(dev)
        replays = stepper.graph_replays()
        t0 = time.perf_counter()
        for _ in range(steps):
            stepper.step()
        sync(dev)
        dt = time.perf_counter() - t0
        graphed = stepper.graph_replays() - replays
        for rid in rids:
            eng.abort_request(rid)
        stepper.tokens.clear()
        rows.append(dict(batch=b, ctx=ctx, steps=steps, step_ms=dt / steps * 1e3, tok_s=b * steps / dt,
                         graphed_steps=graphed))
        mode = "" if stepper.lockstep is None else f" ({graphed} of {steps} group steps as graphs)"
        log(opts, f"  decode batch {b}: {dt / steps * 1e3:.2f} ms/step, {b * steps / dt:.0f} tok/s"
                  f"{mode}")
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
            sync(dev)
            t0 = time.perf_counter()
            stepper.drive(lambda: not eng.has_unfinished())
            sync(dev)
            return time.perf_counter() - t0

        once("w")
        dt = once("t")
        stepper.tokens.clear()
        rows.append(dict(num_seqs=n, length=length, seconds=dt, tok_s=n * length / dt))
        if stepper.leader:
            log(opts, f"  prefill {n}x{length}: {dt * 1e3:.1f} ms, {n * length / dt:.0f} tok/s")
    return rows
