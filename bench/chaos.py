"""Chaos drill: kill ranks again and again while a layout serves, and check that nothing
was lost or changed.

    python bench/chaos.py [--layouts dp2,tp2,dp2tp2,disagg] [--kills 3] [--requests 24]
                          [--max-tokens 24] [--sampled 0.5] [--seed 0] [--deadline-s 5]

Per layout (tiny model, CPU, local Ray): `--requests` requests (random prompts of 1-120
tokens, `ignore_eos`; a `--sampled` fraction of them sampled at temperature 0.8, top-p
0.9 with a seed each, the rest greedy) go in at once; whenever the layout runs under a new epoch
(at the start and after each recovery) the drill arms one fault on a random rank of the
new group: the rank's process exits at a random pass through a fault point: inside an
MoE all-to-all (`moe_dispatch`, DP×EP groups and the decode group), at a step (`step`,
TP groups) or while streaming KV (`kv_send`, prefill instances). Up to `--kills` faults.
Checked for every request: it completes, its tokens equal the single-rank engine's
(the oracle: greedy, it equals transformers (tests/test_hf_oracle.py); sampled, the
draw of each position is seeded, so a resumed request must draw the same), and every output
index follows the previous one (each token reaches the caller exactly once).
Prints a table last and writes JSON to $OUT/chaos.json (or ./chaos.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import ray

from phalanx.engine.sampling_params import SamplingParams
from phalanx.llm import LLM
from phalanx.models.tiny import default_model_dir

# name -> (LLM keywords, fault points by side)
LAYOUTS = {
    "dp2": (dict(dp=2), {"group": "moe_dispatch"}),
    "tp2": (dict(tp=2), {"group": "step"}),
    "dp2tp2": (dict(dp=2, tp=2), {"group": "moe_dispatch"}),
    "dp2-peer": (dict(dp=2, ep_exchange="peer"), {"group": "moe_dispatch"}),
    "disagg": (dict(prefill_tp=1, decode_dp=2), {"decode": "moe_dispatch", "prefill": "kv_send"}),
}
ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=128, page_size=4, num_pages=400)


@dataclass
class DrillResult:
    layout: str
    requests: int
    sampled: int
    tokens: int
    faults_armed: int
    recoveries: int
    identical: int
    index_errors: int
    seconds: float
    faults: list = field(default_factory=list)  # (side, rank, point, after, epoch)


def make_prompts(n: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(vocab - 8) for _ in range(rng.randint(1, 120))] for _ in range(n)]


def make_params(n: int, max_tokens: int, sampled: float, rng: random.Random) -> list[SamplingParams]:
    """Greedy, or (a `sampled` fraction) seeded top-p sampling; all `ignore_eos`."""
    return [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=max_tokens, ignore_eos=True,
                           seed=rng.randrange(1 << 31))
            if rng.random() < sampled else
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            for _ in range(n)]


def oracle(model: str, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Tokens of the single-rank engine (no Ray)."""
    llm = LLM(model, **ENGINE)
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.close()


def _epoch(llm: LLM) -> tuple:
    g = llm.cluster
    if hasattr(g, "decode"):
        return (g.decode.epoch, *(p.epoch for p in g.prefill))
    return (g.epoch,)


def _recoveries(llm: LLM) -> int:
    g = llm.cluster
    return g.recoveries + getattr(g, "decode_recoveries", 0)


def _arm(llm: LLM, points: dict, rng: random.Random) -> tuple:
    """One fault on a random rank of a random side: (side, rank, point, after)."""
    g = llm.cluster
    side = rng.choice(sorted(points))
    if side == "group":
        actors = g.supervisor.actors
    elif side == "decode":
        actors = g.decode.actors
    else:
        actors = [a for inst in g.prefill for a in inst.actors]
    rank = rng.randrange(len(actors))
    after = rng.randint(3, 30) if points[side] != "kv_send" else rng.randint(0, 6)
    ray.get(actors[rank].arm_fault.remote(points[side], after))
    return side, rank, points[side], after


def drill(model: str, name: str, kills: int, prompts: list[list[int]], expected: list[list[int]],
          params: list[SamplingParams], seed: int, deadline_s: float) -> DrillResult:
    kwargs, points = LAYOUTS[name]
    rng = random.Random(seed)
    llm = LLM(model, **kwargs, **ENGINE, collective_timeout_s=deadline_s)
    faults, seen_epoch = [], None
    got: dict[str, list[int]] = {}
    index_errors = 0
    t0 = time.monotonic()
    try:
        rids = llm._submit([list(p) for p in prompts], list(params))
        pending = set(rids)
        while pending:
            epoch = _epoch(llm)
            if epoch != seen_epoch and len(faults) < kills:
                faults.append((*_arm(llm, points, rng), epoch))
            seen_epoch = epoch
            for out in llm._poll():
                tokens = got.setdefault(out.request_id, [])
                if out.index != len(tokens):
                    index_errors += 1
                tokens.extend(out.new_token_ids)
                if out.finished:
                    pending.discard(out.request_id)
        seconds = time.monotonic() - t0
        identical = sum(got[rid] == want for rid, want in zip(rids, expected))
        return DrillResult(name, len(prompts), sum(not p.greedy for p in params),
                           sum(map(len, got.values())), len(faults),
                           _recoveries(llm), identical, index_errors, seconds, faults)
    finally:
        llm.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--sampled", type=float, default=0.5,
                    help="fraction of requests sampled with a seed (the rest greedy)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline-s", type=float, default=5.0)
    args = ap.parse_args()
    names = args.layouts.split(",")
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}")
    model = str(default_model_dir())
    from phalanx.models.loader import read_model_config
    vocab = read_model_config(model).vocab_size
    rng = random.Random(args.seed)
    prompts = make_prompts(args.requests, vocab, rng)
    params = make_params(args.requests, args.max_tokens, args.sampled, rng)
    expected = oracle(model, prompts, params)
    rows = []
    for i, name in enumerate(names):
        r = drill(model, name, args.kills, prompts, expected, params, args.seed + i, args.deadline_s)
        rows.append(r)
        print(f"  {asdict(r)}", flush=True)
    out = os.path.join(os.environ.get("OUT", "."), "chaos.json")
    with open(out, "w") as f:
        json.dump({"meta": {"python": platform.python_version(), "args": vars(args)},
                   "rows": [asdict(r) for r in rows]}, f, indent=1)
    print(f"\nwrote {out}")
    print("| layout | requests (sampled) | tokens | faults | recoveries | identical | index errors | s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.layout} | {r.requests} ({r.sampled}) | {r.tokens} | {r.faults_armed} | {r.recoveries} "
              f"| {r.identical}/{r.requests} | {r.index_errors} | {r.seconds:.1f} |")
    ok = all(r.identical == r.requests and r.index_errors == 0 for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
