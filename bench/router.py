"""Router placement on a synthetic multi-turn chat trace: decision speed, prefix hit rate
and load spread of prefix_aware against round_robin and least_loaded, in the same run.

    python bench/router.py [--conversations 600] [--groups 4] [--kv-pages 2048]
                           [--page-size 16] [--threshold 2048] [--seed 0] [--json PATH]

The trace (`phalanx.router.trace`): conversations that each pick one of 3 shared system
prompts (512 tokens) and run 3-8 turns (user 32-256 tokens, answer 64-384); a turn's
prompt is the system prompt plus every earlier turn plus the new user message; turns
arrive after the previous answer plus a think time. Each policy replays the same trace
(`phalanx.router.replay`) through a fresh `Router` over `--groups` DP groups, each with a
simulated prefix cache of `--kv-pages` pages (LRU) that the router's tree is refreshed
from every 64 arrivals; a request holds its group through its prefill (uncached tokens at
20k tokens/s) and its answer (20 ms per token).

Columns:
- decisions/s, p50/p99 us: `Router.route` wall time per request (hashing the prompt's
  pages, tree match, policy, tree insert, accounting), this process, one thread;
- hit rate: prompt tokens found in the chosen group's simulated cache (the ground truth;
  `est` is the router's own tree estimate);
- spread mean/max: max - min over groups of the router's load
  (queued tokens + 256 per running request) after each decision;
- work max/min, max-min: prompt tokens each group had to compute (misses), over the run.
Prints a table last and writes JSON to --json (default $OUT/router.json or ./router.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from phalanx.policies import PrefixAwareConfig
from phalanx.router import Router
from phalanx.router.replay import replay
from phalanx.router.trace import TraceSpec, multi_turn_trace

POLICIES = ("prefix_aware", "round_robin", "least_loaded")


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=600)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--kv-pages", type=int, default=2048, help="simulated cache per group")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--threshold", type=int, default=2048,
                    help="prefix_aware balance_abs_tokens (balance_ratio 1.0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="output path (default $OUT/router.json)")
    return ap.parse_args()


def _run_policy(name: str, trace, args, cfg: PrefixAwareConfig) -> dict:
    router = Router(page_size=args.page_size, policy=name,
                    policy_config=cfg if name == "prefix_aware" else None,
                    capacity_pages=args.kv_pages, groups=range(args.groups))
    t = time.perf_counter()
    res = replay(router, trace, kv_pages=args.kv_pages, refresh_every=64,
                 running_cost_tokens=cfg.running_cost_tokens)
    row = res.summary()
    row["replay_s"] = time.perf_counter() - t
    row["load_overrides"] = getattr(router.decode.policy, "load_overrides", None)
    return row


def _print_table(rows: list[dict], meta: dict, out: str) -> None:
    print(f"\n{meta['requests']} requests ({meta['prompt_tokens']} prompt tokens) of "
          f"{meta['conversations']} conversations over {meta['groups']} DP groups, "
          f"{meta['kv_pages']} cached pages of {meta['page_size']} tokens per group, "
          f"threshold {meta['threshold']} tokens; total {meta['total_s']:.1f} s; JSON: {out}")
    print(f"{'policy':13} {'decisions/s':>11} {'p50 us':>7} {'p99 us':>7} {'hit rate':>8} "
          f"{'(est)':>6} {'spread mean':>11} {'spread max':>10} {'work max/min':>12} "
          f"{'work max-min':>12}")
    for r in rows:
        print(f"{r['policy']:13} {r['decisions_per_s']:11.0f} {r['p50_decision_us']:7.1f} "
              f"{r['p99_decision_us']:7.1f} {r['hit_rate']:8.3f} "
              f"{r['router_estimated_hit_rate']:6.3f} {r['mean_load_spread']:11.0f} "
              f"{r['max_load_spread']:10d} {r['work_max_over_min']:12.2f} "
              f"{r['work_max_minus_min']:12d}")
    pa, rr = rows[0], next(r for r in rows if r["policy"] == "round_robin")
    if rr["hit_rate"]:
        print(f"prefix_aware hit rate = {pa['hit_rate'] / rr['hit_rate']:.2f} x round_robin's; "
              f"load overrides: {pa['load_overrides']}")


def main() -> None:
    args = _parse_args()
    spec = TraceSpec(conversations=args.conversations, seed=args.seed)
    cfg = PrefixAwareConfig(balance_abs_tokens=args.threshold, balance_ratio=1.0)
    t0 = time.perf_counter()
    trace = multi_turn_trace(spec)
    rows = [_run_policy(name, trace, args, cfg) for name in POLICIES]
    meta = dict(conversations=args.conversations, groups=args.groups, kv_pages=args.kv_pages,
                page_size=args.page_size, threshold=args.threshold, seed=args.seed,
                requests=len(trace), prompt_tokens=sum(len(r.prompt) for r in trace),
                trace_spec={k: getattr(spec, k) for k in spec.__slots__},
                prefix_aware_config={k: getattr(cfg, k) for k in cfg.__slots__},
                total_s=time.perf_counter() - t0, python=platform.python_version(),
                cpus=os.cpu_count())
    out = args.json or os.path.join(os.environ.get("OUT", "."), "router.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    _print_table(rows, meta, out)


if __name__ == "__main__":
    main()
