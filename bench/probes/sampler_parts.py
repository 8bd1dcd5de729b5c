"""Where the batched sampler's time goes on one device (a probe: parts timed alone)."""

from __future__ import annotations

import sys
import time

import torch

from phalanx.engine.logits_processors import RowHistory, process_logits
from phalanx.engine.sampler import _filter, position_seed, sample_batch
from phalanx.kernels.sampling import exponential_noise, exponential_race
from phalanx.engine.sampling_params import SamplingParams


def t(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    s = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - s) / reps * 1e3


def main() -> None:
    b, v = int(sys.argv[1]) if len(sys.argv) > 1 else 64, 151936
    sys.path.insert(0, "bench")
    from sampler import lm_like_logits
    x = lm_like_logits(b, v, "cuda")
    full = [SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=i, logprobs=5,
                           frequency_penalty=0.5, presence_penalty=0.2, repetition_penalty=1.1,
                           logit_bias={7: 1.0}, min_tokens=2) for i in range(b)]
    full_rows = [RowHistory(p, list(range(64)), list(range(32))) for p in full]
    ps = [SamplingParams(temperature=0.8, top_p=0.95, seed=i) for i in range(b)]
    plain = [SamplingParams(temperature=0.8, seed=i) for i in range(b)]
    rows = [RowHistory(p, list(range(64)), list(range(32))) for p in ps]
    seeds = torch.tensor([position_seed(i, 5) for i in range(b)], device="cuda")
    parts = {
        "position_seed+tensor": lambda: torch.tensor([position_seed(p.seed, 96) for p in ps],
                                                     device="cuda"),
        "process_logits(none)": lambda: process_logits(x.clone(), rows),
        "filter top_p": lambda: _filter(x, ps),
        "filter temp only": lambda: _filter(x, plain),
        "noise": lambda: exponential_noise(seeds, v),
        "softmax/noise argmax": lambda: torch.argmax(torch.softmax(x, 1) / exponential_noise(seeds, v), 1),
        "sort": lambda: torch.sort(x, dim=1, descending=True),
        "topk 1024": lambda: torch.topk(x, 1024, dim=1),
        "race (triton)": lambda: exponential_race(torch.softmax(x, 1), seeds),
        "sample_batch top_p": lambda: sample_batch(x, rows, [96] * b),
        "process_logits(full)": lambda: process_logits(x.clone(), full_rows, (2,)),
        "filter top_k+top_p": lambda: _filter(x, full),
        "sample_batch full": lambda: sample_batch(x, full_rows, [96] * b, (2,)),
        "sample_batch temp only": lambda: sample_batch(x, [RowHistory(p) for p in plain], [96] * b),
    }
    for name, fn in parts.items():
        print(f"{name:28s} {t(fn):8.3f} ms")


if __name__ == "__main__":
    main()
