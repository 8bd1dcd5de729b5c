"""Router placement on a synthetic multi-turn chat trace: decision speed, prefix hit rate
and load spread of prefix_aware against round_robin and least_loaded, in the same run.

    python bench/router.py [--conversations 600] [--groups 4] [--kv-pages 2048]
                           [--page-size 16] [--threshold 2048] [--seed 0]
                           [--long-conversations 150] [--long-kv-pages 16384] [--json PATH]

The trace (`phalanx.router.trace`): conversations that each pick one of 3 shared system
prompts (512 tokens) and run 3-8 turns (user 32-256 tokens, answer 64-384); a turn's
prompt is the system prompt plus every earlier turn plus the new user message; turns
arrive after the previous answer plus a think time. Each policy replays the same trace
(`phalanx.router.replay`) through a fresh `Router` over `--groups` DP groups, each with a
simulated prefix cache of `--kv-pages` pages (LRU) that the router's tree is refreshed
from every 64 arrivals; a request holds its group through its prefill (uncached tokens at
20k tokens/s) and its answer (20 ms per token). Requests reach the router as the cluster
driver hands them over: a `RequestRecord`, whose prompt pages are hashed once at admission
(`Router.prepare`), to `route`, then `prefill_done` and `finish`.

Columns:
- decisions/s, p50/p99 us: `Router.route` wall time per request with the prompt's page
  hashes already on the record (tree match, policy, tree insert and eviction,
  accounting), this process, one thread. Hashing is NOT in these columns;
- hash p50/p99: `Router.prepare` wall time per request (hashing the prompt's pages with
  the memoizing `PageHasher`), measured just before each `route`; `both`: the sum per
  request, p50/p99 and per second (what one core does per request: hash + decide);
- hit rate: prompt tokens found in the chosen group's simulated cache (the ground truth;
  `est` is the router's own tree estimate);
- spread mean/max: max - min over groups of the router's load
  (queued tokens + 256 per running request) after each decision;
- work max/min, max-min: prompt tokens each group had to compute (misses), over the run.

Decision speed by prompt length: the same decisions, bucketed by prompt tokens, plus a
second, long-context trace (`--long-conversations` conversations of 10-16 turns: prompts up
to ~10k tokens, over caches of `--long-kv-pages` pages a group; 0 conversations skips it)
for the longer buckets. Beside each bucket: the goals (p99 <=
100 us, >= 20,000 decisions/s), checked for the decision alone and for hash + decision,
and, as a baseline measured in this process on the same prompts, the p50 cost of hashing
every page of a prompt (`page_hashes`: blake2b per page, no memo). Prints the tables last and writes JSON to --json (default $OUT/router.json or
./router.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from phalanx.policies import PrefixAwareConfig
from phalanx.router import Router, page_hash, page_hashes
from phalanx.router.replay import replay
from phalanx.router.trace import TraceSpec, multi_turn_trace

POLICIES = ("prefix_aware", "round_robin", "least_loaded")
BUCKETS = (("<1k", 0, 1024), ("1-4k", 1024, 4096), ("4-8k", 4096, 8192), (">=8k", 8192, 1 << 62))
GOAL_P99_US = 100.0
GOAL_PER_S = 20_000.0
LONG_TURNS = (10, 16)


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=600)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--kv-pages", type=int, default=2048, help="simulated cache per group")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--threshold", type=int, default=2048,
                    help="prefix_aware balance_abs_tokens (balance_ratio 1.0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long-conversations", type=int, default=150,
                    help="conversations of the long-context trace (0: none)")
    ap.add_argument("--long-kv-pages", type=int, default=16384,
                    help="simulated cache per group for the long-context trace")
    ap.add_argument("--json", default=None, help="output path (default $OUT/router.json)")
    return ap.parse_args()


def _percentile(sorted_ns: list[int], q: float) -> float:
    return sorted_ns[min(len(sorted_ns) - 1, int(q * len(sorted_ns)))] / 1e3


def _buckets(ns: list[int], tokens: list[int]) -> dict[str, dict]:
    """p50/p99 (us) and per second of the times `ns` per prompt-length bucket (empty
    ones left out)."""
    out = {}
    for label, lo, hi in BUCKETS:
        sel = sorted(t for t, n in zip(ns, tokens) if lo <= n < hi)
        if sel:
            out[label] = dict(decisions=len(sel), p50_us=_percentile(sel, 0.5),
                              p99_us=_percentile(sel, 0.99),
                              decisions_per_s=len(sel) / (sum(sel) / 1e9))
    return out


def _hash_baseline(trace, page_size: int) -> dict[str, float]:
    """p50 (us) per bucket of hashing every page of each prompt of `trace` (reference)."""
    ns, tokens = [], []
    clock = time.perf_counter_ns
    for req in trace:
        t0 = clock()
        page_hashes(req.prompt, page_size)
        ns.append(clock() - t0)
        tokens.append(len(req.prompt))
    return {k: v["p50_us"] for k, v in _buckets(ns, tokens).items()}


def _run_policy(name: str, trace, args, cfg: PrefixAwareConfig, kv_pages: int) -> dict:
    router = Router(page_size=args.page_size, policy=name,
                    policy_config=cfg if name == "prefix_aware" else None,
                    capacity_pages=kv_pages, groups=range(args.groups))
    t = time.perf_counter()
    res = replay(router, trace, kv_pages=kv_pages, refresh_every=64,
                 running_cost_tokens=cfg.running_cost_tokens)
    row = res.summary()
    row["replay_s"] = time.perf_counter() - t
    row["load_overrides"] = getattr(router.decode.policy, "load_overrides", None)
    row["buckets"] = _buckets(res.decision_ns, res.decision_tokens)
    row["hash_buckets"] = _buckets(res.hash_ns, res.decision_tokens)
    row["both_buckets"] = _buckets([a + b for a, b in zip(res.decision_ns, res.hash_ns)],
                                   res.decision_tokens)
    hasher = router.decode.tree.hasher
    row["pages_hashed"], row["pages_remembered"] = hasher.hashed, hasher.reused
    return row


def _print_table(rows: list[dict], meta: dict, out: str) -> None:
    print(f"\n{meta['requests']} requests ({meta['prompt_tokens']} prompt tokens) of "
          f"{meta['conversations']} conversations over {meta['groups']} DP groups, "
          f"{meta['kv_pages']} cached pages of {meta['page_size']} tokens per group, "
          f"threshold {meta['threshold']} tokens; total {meta['total_s']:.1f} s; JSON: {out}")
    print("page hashing: " + ("C (router/_page_hash.c)" if meta["page_hash_native"] else
                              "Python fallback (router/_page_hash.c not built)"))
    print("decision = Router.route with the page hashes given (no hashing); hash = "
          "Router.prepare (hashing the prompt's pages at admission); both = their sum")
    print(f"{'policy':13} {'decisions/s':>11} {'p50 us':>7} {'p99 us':>7} "
          f"{'hash p50':>8} {'p99':>6} {'both p50':>8} {'p99':>6} {'both/s':>7} "
          f"{'hit rate':>8} {'(est)':>6} {'spread mean':>11} {'spread max':>10} "
          f"{'work max/min':>12} {'work max-min':>12}")
    for r in rows:
        print(f"{r['policy']:13} {r['decisions_per_s']:11.0f} {r['p50_decision_us']:7.1f} "
              f"{r['p99_decision_us']:7.1f} {r['p50_hash_us']:8.1f} {r['p99_hash_us']:6.1f} "
              f"{r['p50_hash_and_decision_us']:8.1f} {r['p99_hash_and_decision_us']:6.1f} "
              f"{r['hash_and_decisions_per_s']:7.0f} {r['hit_rate']:8.3f} "
              f"{r['router_estimated_hit_rate']:6.3f} {r['mean_load_spread']:11.0f} "
              f"{r['max_load_spread']:10d} {r['work_max_over_min']:12.2f} "
              f"{r['work_max_minus_min']:12d}")
    pa, rr = rows[0], next(r for r in rows if r["policy"] == "round_robin")
    if rr["hit_rate"]:
        print(f"prefix_aware hit rate = {pa['hit_rate'] / rr['hit_rate']:.2f} x round_robin's; "
              f"load overrides: {pa['load_overrides']}")


def _goals(b: dict) -> str:
    return ("p" if b["p99_us"] <= GOAL_P99_US else "-") + \
        ("r" if b["decisions_per_s"] >= GOAL_PER_S else "-")


def _print_speed(runs: dict[str, list[dict]], baselines: dict[str, dict[str, float]]) -> None:
    print(f"\nspeed by prompt length (goals: p99 <= {GOAL_P99_US:.0f} us, "
          f">= {GOAL_PER_S:.0f} decisions/s; decision: route with hashes given; hash: "
          f"prepare; both: hash + decision; blake: p50 of blake2b over every page, no memo)")
    print(f"{'trace':6} {'policy':13} {'prompt':6} {'n':>5} | {'decision p50':>12} "
          f"{'p99':>6} {'/s':>6} {'goals':>5} | {'hash p50':>8} {'p99':>6} | {'both p50':>8} "
          f"{'p99':>6} {'/s':>6} {'goals':>5} | {'blake':>6}")
    for trace_name, rows in runs.items():
        for r in rows:
            for label, b in r["buckets"].items():
                h, t = r["hash_buckets"][label], r["both_buckets"][label]
                print(f"{trace_name:6} {r['policy']:13} {label:6} {b['decisions']:5d} | "
                      f"{b['p50_us']:12.1f} {b['p99_us']:6.1f} {b['decisions_per_s']:6.0f} "
                      f"{_goals(b):>5} | {h['p50_us']:8.1f} {h['p99_us']:6.1f} | "
                      f"{t['p50_us']:8.1f} {t['p99_us']:6.1f} {t['decisions_per_s']:6.0f} "
                      f"{_goals(t):>5} | {baselines[trace_name].get(label, 0.0):6.1f}")
    print("goals: p = p99 met, r = rate met, - = missed")


def main() -> None:
    args = _parse_args()
    spec = TraceSpec(conversations=args.conversations, seed=args.seed)
    cfg = PrefixAwareConfig(balance_abs_tokens=args.threshold, balance_ratio=1.0)
    t0 = time.perf_counter()
    traces = {"chat": multi_turn_trace(spec)}
    if args.long_conversations:
        long_spec = TraceSpec(conversations=args.long_conversations, turns=LONG_TURNS,
                              seed=args.seed + 1)
        traces["long"] = multi_turn_trace(long_spec)
    kv = {"chat": args.kv_pages, "long": args.long_kv_pages}
    runs = {name: [_run_policy(p, tr, args, cfg, kv[name]) for p in POLICIES]
            for name, tr in traces.items()}
    baselines = {name: _hash_baseline(tr, args.page_size) for name, tr in traces.items()}
    trace = traces["chat"]
    meta = dict(conversations=args.conversations, groups=args.groups, kv_pages=args.kv_pages,
                page_size=args.page_size, threshold=args.threshold, seed=args.seed,
                requests=len(trace), prompt_tokens=sum(len(r.prompt) for r in trace),
                trace_spec={k: getattr(spec, k) for k in spec.__slots__},
                prefix_aware_config={k: getattr(cfg, k) for k in cfg.__slots__},
                long_conversations=args.long_conversations, long_turns=LONG_TURNS,
                long_kv_pages=args.long_kv_pages,
                goals=dict(p99_us=GOAL_P99_US, decisions_per_s=GOAL_PER_S),
                total_s=time.perf_counter() - t0, python=platform.python_version(),
                cpus=os.cpu_count(), page_hash_native=page_hash.NATIVE)
    out = args.json or os.path.join(os.environ.get("OUT", "."), "router.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"meta": meta, "rows": runs["chat"], "long_rows": runs.get("long", []),
                   "hash_baseline_p50_us": baselines}, f, indent=1)
    _print_table(runs["chat"], meta, out)
    _print_speed(runs, baselines)


if __name__ == "__main__":
    main()
