"""The batched sampler's cost per step against the arg-max of the same logits (the
baseline every engine pays) and the floor of reading the logits once.

    python bench/sampler.py [--device cuda] [--vocab 151936] [--batches 1,16,64,128]

Cases: `greedy` (the arg-max path), `temp` (temperature only: the OpenAI default),
`sampled` (temperature + top-p + seeded counter-hash draws), `full` (penalties, bias,
min_tokens, top-k, top-p, logprobs 5). The logits are shaped like a language model's
(Zipf-like: logit = -1.2 ln(rank) + noise, ranks shuffled per row): top-p 0.95 then
keeps a few hundred tokens, as it does on real text. Prints a table, writes
`$OUT/sampler.json` (or ./sampler.json).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from phalanx.engine.logits_processors import RowHistory
from phalanx.engine.sampler import sample_batch
from phalanx.engine.sampling_params import SamplingParams

CASES = {
    "greedy": lambda i: SamplingParams(temperature=0.0),
    "temp": lambda i: SamplingParams(temperature=1.0, seed=i),
    "sampled": lambda i: SamplingParams(temperature=0.8, top_p=0.95, seed=i),
    "full": lambda i: SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=i, logprobs=5,
                                     frequency_penalty=0.5, presence_penalty=0.2,
                                     repetition_penalty=1.1, logit_bias={7: 1.0}, min_tokens=2),
}


def lm_like_logits(b: int, vocab: int, device: str) -> torch.Tensor:
    ranks = torch.arange(1, vocab + 1, device=device, dtype=torch.float32)
    base = -1.2 * torch.log(ranks)
    rows = [base[torch.randperm(vocab, device=device)] for _ in range(b)]
    return torch.stack(rows) + 0.1 * torch.randn(b, vocab, device=device)


def _time(fn, device: str, reps: int) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batches", default="1,16,64,128")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--bandwidth-gbs", type=float, default=4200.0,
                    help="memory bandwidth for the floor (H200: ~4.2 TB/s measured)")
    args = ap.parse_args(argv)
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        logits = lm_like_logits(b, args.vocab, args.device)
        argmax_s = _time(lambda: torch.argmax(logits, dim=-1).tolist(), args.device, args.reps)
        floor_s = b * args.vocab * 4 / (args.bandwidth_gbs * 1e9)
        for name, make in CASES.items():
            hist = [RowHistory(make(i), list(range(i, i + 64)), list(range(200, 200 + 32)))
                    for i in range(b)]
            positions = [96] * b
            s = _time(lambda: sample_batch(logits, hist, positions, (2,)), args.device, args.reps)
            rows.append({"batch": b, "case": name, "ms": s * 1e3, "argmax_ms": argmax_s * 1e3,
                         "vs_argmax": s / argmax_s, "floor_ms": floor_s * 1e3})
    print(f"| batch | case | ms | arg-max ms | x arg-max | read floor ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['case']} | {r['ms']:.3f} | {r['argmax_ms']:.3f} | "
              f"{r['vs_argmax']:.1f} | {r['floor_ms']:.4f} |")
    out = Path(os.environ.get("OUT", ".")) / "sampler.json"
    out.write_text(json.dumps({"device": args.device, "vocab": args.vocab, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
