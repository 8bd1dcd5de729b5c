"""`warm_up`: requests an engine serves before it reports ready, so that no kernel
compiles after it does (issue 31: every kernel variant's first use cost a user seconds).

Triton compiles a kernel once per set of constexprs and per specialisation of its integer
and pointer arguments (a value of 1, a multiple of 16, anything else), and those follow
the step's shape: tokens, sequences, the longest query (the attention tile), a cached
prefix or none, the KV pages a row spans, eager decode sizes past the CUDA graphs, and
the sampling path. The plan covers those classes with synthetic requests through the
engine's own scheduler and runner (so it reaches exactly the paths real requests do):

- one prompt at a time over lengths around the tile bounds and residues mod 16, up to
  one chunk past `max_num_batched_tokens` (a chunked prompt);
- each again (a whole-prompt prefix hit: one token over a cached prefix) and extended
  by a few tokens (a short query over a long cached prefix);
- batches of several fresh prompts (several sequences; mixed prefill and decode steps;
  decode sizes past the largest graph);
- every sampling path (temperature, top-k/top-p/min-p, penalties, logprobs, prompt
  logprobs).

Afterwards the engine forgets them: no cached page, no hit counted, no request left.
Everything here is plain data and the engine's public calls; `tests/test_gpu.py` checks
on a GPU that a different random workload compiles nothing after ready.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from .sampling_params import SamplingParams

__all__ = ["WARMUP_PREFIX", "WarmupReport", "WarmupRound", "run_warmup", "warmup_rounds"]

WARMUP_PREFIX = "phalanx-warmup-"
LENGTHS = (1, 2, 3, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 255, 256, 257,
           511, 512, 513, 1000)
EXTENSIONS = (1, 2, 15, 16, 17, 40, 100)


@dataclass(frozen=True, slots=True)
class WarmupRound:
    """Requests submitted together and run to completion: (prompt, params) each."""

    name: str
    requests: tuple[tuple[tuple[int, ...], SamplingParams], ...]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _sampled() -> list[SamplingParams]:
    base = dict(max_tokens=3, ignore_eos=True)
    return [SamplingParams(temperature=0.8, seed=1, **base),
            SamplingParams(temperature=0.8, top_p=0.9, seed=2, **base),
            SamplingParams(temperature=0.8, top_k=20, seed=3, **base),
            SamplingParams(temperature=0.8, min_p=0.1, top_p=0.95, top_k=50, seed=4, **base),
            SamplingParams(temperature=1.0, logprobs=5, seed=5, **base),
            SamplingParams(temperature=0.7, repetition_penalty=1.2, presence_penalty=0.5,
                           frequency_penalty=0.3, seed=6, **base),
            SamplingParams(temperature=0.0, prompt_logprobs=2, logprobs=2, max_tokens=2,
                           ignore_eos=True)]


def warmup_rounds(vocab_size: int, max_model_len: int, max_num_seqs: int,
                  max_num_batched_tokens: int, graph_max_batch: int, kv_tokens: int,
                  seed: int = 0) -> list[WarmupRound]:
    """The plan for an engine of these limits (`graph_max_batch`: the largest captured
    decode batch, 0 without graphs; `kv_tokens`: the KV cache's capacity: a round never
    needs more than half of it). Token ids avoid the lowest and highest few (special
    tokens of real vocabularies); every request ignores EOS."""
    rng = random.Random(seed)
    longest = min(max_model_len, kv_tokens // 2) - 4
    chunk = max_num_batched_tokens  # the most tokens a step runs: the MoE's largest tiles
    lengths = sorted({n for n in (*LENGTHS, chunk // 2 + 1, chunk - 1, chunk, chunk + 17)
                      if 1 <= n <= longest})

    def prompt(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(8, vocab_size - 8) for _ in range(n))

    singles = [prompt(n) for n in lengths]
    rounds = [WarmupRound(f"alone-{len(p)}", ((p, _greedy(2)),)) for p in singles]
    rounds += [WarmupRound(f"hit-{len(p)}", ((p, _greedy(2)),)) for p in singles]
    rounds += [WarmupRound(f"extended-{len(p)}+{k}", ((p + prompt(k), _greedy(2)),))
               for p in singles for k in EXTENSIONS[:3 if len(p) < 64 else None]
               if len(p) + k <= longest]
    sizes = {2, 3, 16, 17, 64, 65, graph_max_batch + 1, graph_max_batch + 16, max_num_seqs}
    for n in sorted(s for s in sizes if 2 <= s <= max_num_seqs):
        length = min(33, longest, kv_tokens // (2 * n) - 8)
        if length < 1:
            continue
        rounds.append(WarmupRound(f"batch-{n}", tuple(
            (prompt(length), _greedy(2 + i % 3)) for i in range(n))))
    sampled = _sampled()
    rounds.append(WarmupRound("sampling", tuple(
        (prompt(min(20 + 7 * i, longest)), p) for i, p in enumerate(sampled))))
    rounds += [WarmupRound(f"sampling-alone-{i}", ((prompt(min(9, longest)), p),))
               for i, p in enumerate(sampled)]
    return rounds


@dataclass(frozen=True, slots=True)
class WarmupReport:
    rounds: int
    requests: int
    steps: int
    seconds: float


def run_warmup(engine, rounds: list[WarmupRound]) -> WarmupReport:
    """Serve `rounds` on `engine` (an idle `LLMEngine`), then make it forget them."""
    if engine.has_unfinished():
        raise RuntimeError("warm-up needs an idle engine")
    t0, steps, requests = time.monotonic(), 0, 0
    for rnd in rounds:
        for i, (tokens, params) in enumerate(rnd.requests):
            engine.add_request(f"{WARMUP_PREFIX}{rnd.name}-{i}", list(tokens), params)
            requests += 1
        while engine.has_unfinished():
            engine.step()
            steps += 1
    engine.forget_history()
    return WarmupReport(len(rounds), requests, steps, time.monotonic() - t0)
