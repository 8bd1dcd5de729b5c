"""Which Triton kernels compile after an engine is ready (issue 31), and what a phase of
requests costs the first time against the second.

One GPU, `LLM(device="cuda")` (the engine in this process), a random-weight checkpoint of
the Qwen3-30B-A3B shape with `--layers` layers; a hook on Triton's JIT records every
in-memory compilation (a disk-cache hit included: it still loads a module) with the
phase it happened in. Phases: prompts one at a time over many lengths, the same prompts
again (prefix hits) and extended, batches of 16 and 64 fresh 512-token prompts with
staggered lengths (decode batches 64 -> 1), every sampling path; then all of them again.

    python bench/probes/compiles_after_ready.py --layers 2

Prints a table (phase: compiles, seconds, first time vs again); JSON to $OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH))

import torch  # noqa: E402

from disagg_checkpoint import write_checkpoint  # noqa: E402
from multi_gpu_model import QWEN3_30B_A3B  # noqa: E402

LENGTHS = [1, 2, 3, 7, 15, 16, 17, 31, 33, 63, 64, 65, 100, 127, 129, 255, 257, 511, 1000, 2000]


def watch_compiles(log: list, phase: list) -> None:
    import triton

    def hook(*_, **kw):
        fn = kw.get("fn")
        log.append((phase[0], getattr(fn, "name", str(fn))))
        return None

    triton.knobs.runtime.jit_post_compile_hook = hook


def phases(vocab: int, seed: int):
    from phalanx import SamplingParams
    g = torch.Generator().manual_seed(seed)

    def prompt(n):
        return torch.randint(3, vocab - 3, (n,), generator=g).tolist()

    greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)  # noqa: E731
    rng = torch.Generator().manual_seed(seed + 1)  # lengths other than the warm-up's
    lengths = LENGTHS if seed == 0 else sorted(
        torch.randint(1, 3000, (len(LENGTHS),), generator=rng).tolist())
    singles = [prompt(n) for n in lengths]
    yield "lengths", [[p] for p in singles], greedy(4)
    yield "hits", [[p] for p in singles], greedy(4)
    yield "extended", [[p + prompt(k)] for p, k in zip(singles, [1, 5, 16, 17, 40, 3, 90] * 3)],\
        greedy(4)
    yield "batch16", [[prompt(512) for _ in range(16)]], greedy(16)
    batch = [prompt(int(n)) for n in torch.randint(1, 1500, (64,), generator=rng)]
    yield "batch64", [batch], [SamplingParams(temperature=0.0, max_tokens=2 + i, ignore_eos=True)
                                for i in range(64)]
    sampled = [SamplingParams(temperature=0.8, max_tokens=8, seed=1, ignore_eos=True),
               SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=2, ignore_eos=True),
               SamplingParams(temperature=0.8, top_k=20, max_tokens=8, seed=3, ignore_eos=True),
               SamplingParams(temperature=0.8, min_p=0.1, max_tokens=8, seed=4, ignore_eos=True),
               SamplingParams(temperature=1.0, logprobs=5, max_tokens=8, seed=5, ignore_eos=True),
               SamplingParams(temperature=0.7, repetition_penalty=1.2, presence_penalty=0.5,
                              frequency_penalty=0.3, max_tokens=8, seed=6, ignore_eos=True),
               SamplingParams(temperature=0.0, prompt_logprobs=2, max_tokens=4, ignore_eos=True),
               SamplingParams(temperature=0.9, n=2, max_tokens=8, seed=7, ignore_eos=True)]
    yield "sampling", [[prompt(40 + 9 * i) for i in range(len(sampled))]], sampled


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1, help="0: the fixed lengths; else random ones")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    args = ap.parse_args(argv)
    out_dir = Path(os.environ.get("OUT", "."))
    cfg = dict(QWEN3_30B_A3B, num_hidden_layers=args.layers)
    log: list = []
    phase = ["load"]
    watch_compiles(log, phase)
    from phalanx import LLM
    rows = []
    with tempfile.TemporaryDirectory(prefix="compiles_") as folder:
        write_checkpoint(folder, cfg, args.seed, torch.device("cuda"))
        t = time.monotonic()
        llm = LLM(folder, device="cuda", max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=8192, max_model_len=4096)
        load_s = time.monotonic() - t
        t = time.monotonic()
        llm.decode([1])  # the offline API loads its tokenizer on first use (the server at start)
        print(f"tokenizer on first use: {time.monotonic() - t:.1f} s", flush=True)
        print(f"ready in {load_s:.1f} s, {len(log)} compiles while loading", flush=True)
        for rnd in ("first", "again"):
            for name, groups, params in phases(cfg["vocab_size"], args.seed):
                phase[0] = f"{rnd}:{name}"
                before = len(log)
                torch.cuda.synchronize()
                t = time.monotonic()
                each = []
                for prompts in groups:
                    t1 = time.monotonic()
                    llm.generate(prompt_token_ids=prompts, sampling_params=params)
                    each.append((len(prompts[0]), round(time.monotonic() - t1, 3)))
                torch.cuda.synchronize()
                if len(each) > 1:
                    print(f"  per group (first prompt's length, s): {each}", flush=True)
                kernels = Counter(k for _, k in log[before:])
                rows.append({"round": rnd, "phase": name, "seconds": time.monotonic() - t,
                             "compiles": len(log) - before, "kernels": dict(kernels)})
                print(f"{phase[0]}: {rows[-1]['seconds']:.2f} s, {rows[-1]['compiles']} compiles "
                      f"{dict(kernels)}", flush=True)
        llm.close()
    (out_dir / "compiles_after_ready.json").write_text(json.dumps(
        {"layers": args.layers, "load_s": load_s,
         "load_compiles": dict(Counter(k for p, k in log if p == "load")), "rows": rows},
        indent=1))
    print("| phase | first s | compiles | again s | compiles |")
    print("|---|---|---|---|---|")
    half = len(rows) // 2
    for a, b in zip(rows[:half], rows[half:]):
        print(f"| {a['phase']} | {a['seconds']:.2f} | {a['compiles']} | {b['seconds']:.2f} | "
              f"{b['compiles']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
