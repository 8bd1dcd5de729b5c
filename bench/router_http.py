"""Placement quality over real HTTP: routers side by side in front of simulated workers,
placement showing up as latency, not only as a hit rate.

    python bench/router_http.py [--loads light=8,heavy=28] [--duration 45] [--runs 3]
        [--routers smg,prefix_aware,round_robin] [--smg PATH]
        [--workers 4] [--slots 4] [--capacity-pages 1024] [--json PATH] [--png PATH]
        [--outcomes]

Each (run, load, router) starts fresh processes: `--workers` simulated workers
(`router_http_worker.py`: a prefix cache with LRU eviction, a prefill lane costing
`--prefill-s-per-token` per uncached token, a decode costing `--decode-s-per-token` per
output token, `--slots` concurrent requests) and the router in front of them: the
phalanx proxy (`router_http_proxy.py`: `phalanx.router.Router` fed as
`server/cluster_driver.py` feeds it, load and held/evicted page reports included) with
a routing policy, or SMG (`smg launch --policy cache_aware`, its defaults otherwise; it
gets what an HTTP gateway gets: requests and the workers' `/loads`). This process then
drives the router with multi-turn conversations with shared system prompts
(`router_http_load.py`) at each load's request rate for `--duration` seconds, and
reads each worker's ground truth (prompt tokens found in its cache when the prefill
started). The routers alternate: each run rotates their order.

Router names for --routers: `smg`, a phalanx routing policy name, or
`LABEL=POLICY:JSON` (a policy with a config, e.g. `old=prefix_aware:{"load_weight":0.5}`).
Columns: hit = workers' cached prompt tokens / prompt tokens (mean over runs, min-max);
p50/p99 = client latency per request, end to end (median over runs, min-max);
busiest = share of requests the busiest worker took; busy = share of the run each
worker's prefill lane was busy (mean over workers and runs; how near saturation);
evicted = pages the workers' caches evicted per run (mean); overr. = share of phalanx
decisions the policy took by load or expected cost instead of its score; hit/rr,
p99/rr = against phalanx round_robin in the same run (median); >smg = runs where the
router beat SMG of the same run; hit common (smg) = hit rate over the turns that both this
router and SMG of the same run answered (SMG's over the same turns beside it; the same turn
is the same prompt under any router, so this compares placement on equal work), and the
runs in which it is the higher.
Prints a table last; writes JSON (--json) and a PNG of hit rate and p99 against load.
Every process shares this machine's cores: a busy client or router slows them all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import time
from dataclasses import asdict

from router_http_engine import EngineConfig
from router_http_load import LoadSpec, run_load
from router_http_procs import (SMG_ROUTER, Ports, get_json, start_phalanx, start_smg,
                               start_workers)
from router_http_report import (add_common_hits, add_ratios, plot, print_table, run_row,
                                 summarize, title_of)


def _parse_args(argv=None) -> argparse.Namespace:
    d = EngineConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loads", default="light=8,heavy=28", help="NAME=requests/s,...")
    ap.add_argument("--duration", type=float, default=45.0, help="seconds of new turns")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--routers", default="smg,prefix_aware,round_robin")
    ap.add_argument("--smg", default=os.environ.get("SMG") or shutil.which("smg")
                    or "/tmp/smgvenv/bin/smg", help="the smg CLI (skipped if missing)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--slots", type=int, default=d.slots)
    ap.add_argument("--page-size", type=int, default=d.page_size)
    ap.add_argument("--capacity-pages", type=int, default=d.capacity_pages)
    ap.add_argument("--prefill-fixed-s", type=float, default=d.prefill_fixed_s)
    ap.add_argument("--prefill-s-per-token", type=float, default=d.prefill_s_per_token)
    ap.add_argument("--decode-s-per-token", type=float, default=d.decode_s_per_token)
    ap.add_argument("--think", default="0.5,2.0", help="think time range, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base-port", type=int, default=19000)
    ap.add_argument("--json", default=None, help="default $OUT/router_http.json")
    ap.add_argument("--png", default=None, help="default next to the JSON; 'none': no plot")
    ap.add_argument("--logs", default=None, help="process logs (default: next to the JSON)")
    ap.add_argument("--outcomes", action="store_true",
                    help="also write each run's requests (conversation, turn, worker, cached "
                         "tokens, latency) to outcomes-*.json in the logs folder")
    return ap.parse_args(argv)


def _split_top(spec: str) -> list[str]:
    """`spec` split at the commas outside braces (a JSON config may hold commas)."""
    items, depth, cur = [], 0, []
    for ch in spec:
        depth += (ch == "{") - (ch == "}")
        if ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    items.append("".join(cur))
    return items


def parse_routers(spec: str, smg_available: bool) -> list[tuple[str, str, dict | None]]:
    """(label, policy or 'smg', policy config) per --routers entry."""
    out = []
    for item in filter(None, (s.strip() for s in _split_top(spec))):
        if item == "smg":
            if smg_available:
                out.append((SMG_ROUTER, "smg", None))
            continue
        label, _, rest = item.partition("=") if "=" in item else (item, "", item)
        policy, _, cfg = rest.partition(":")
        out.append((f"phalanx {label}", policy, json.loads(cfg) if cfg else None))
    return out


def _one_run(args, cfg: EngineConfig, router: tuple, load: tuple, run: int, slot: int,
             logs: str) -> dict:
    label, policy, policy_config = router
    name, rate = load
    base = args.base_port + 10 * (slot % 100)
    ports = Ports(base, tuple(base + 1 + i for i in range(args.workers)))
    tag = f"{name}-{run}-{label.replace(' ', '_')}"
    workers = start_workers(ports, cfg, os.path.join(logs, f"workers-{tag}.log"))
    front = None
    try:
        if policy == "smg":
            front = start_smg(args.smg, ports, base + 9, os.path.join(logs, f"smg-{tag}.log"))
        else:
            front = start_phalanx(ports, policy, policy_config, cfg,
                                  os.path.join(logs, f"proxy-{tag}.log"))
        lo, hi = (float(x) for x in args.think.split(","))
        spec = LoadSpec(rate=rate, duration_s=args.duration, think_s=(lo, hi), seed=args.seed)
        result = asyncio.run(run_load(ports.router_url, spec))
        truths = [get_json(u + "/sim/truth") for u in ports.worker_urls]
        stats = get_json(ports.router_url + "/proxy/stats") if policy != "smg" else None
    finally:
        if front is not None:
            front.stop()
        workers.stop()
    if args.outcomes:
        with open(os.path.join(logs, f"outcomes-{tag}.json"), "w") as f:
            json.dump([asdict(o) for o in result.outcomes], f)
    row = run_row(label, name, rate, run, result, truths, stats)
    row["_outcomes"] = result.outcomes
    print(f"  {name:6} run {run} {label:26} hit {row['hit_rate']:.3f} p50 {row['p50_s']:.3f} "
          f"p99 {row['p99_s']:.3f} reqs {row['requests']} failed {row['failed']} "
          f"busiest {row['busiest_share']:.2f} busy {row['prefill_busy']:.2f} "
          f"evicted {row['evicted_pages']}", flush=True)
    return row


def main(argv=None) -> None:
    args = _parse_args(argv)
    cfg = EngineConfig(slots=args.slots, page_size=args.page_size,
                       capacity_pages=args.capacity_pages,
                       prefill_fixed_s=args.prefill_fixed_s,
                       prefill_s_per_token=args.prefill_s_per_token,
                       decode_s_per_token=args.decode_s_per_token)
    smg_ok = bool(args.smg) and os.path.exists(args.smg)
    routers = parse_routers(args.routers, smg_ok)
    if not smg_ok and "smg" in args.routers:
        print(f"SMG not found at {args.smg!r}: running without it", flush=True)
    loads = [(n, float(r)) for n, r in (x.split("=") for x in args.loads.split(","))]
    out = args.json or os.path.join(os.environ.get("OUT", "."), "router_http.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    png = None if args.png == "none" else (args.png or os.path.splitext(out)[0] + ".png")
    logs = args.logs or os.path.splitext(out)[0] + "_logs"
    os.makedirs(logs, exist_ok=True)
    t0 = time.perf_counter()
    rows, slot = [], 0
    for run in range(args.runs):
        order = routers[run % len(routers):] + routers[:run % len(routers)]
        for load in loads:
            for router in order:
                rows.append(_one_run(args, cfg, router, load, run, slot, logs))
                slot += 1
    outcomes = {(r["load"], r["run"], r["router"]): r.pop("_outcomes") for r in rows}
    add_ratios(rows)
    add_common_hits(rows, outcomes)
    summary = summarize(rows)
    meta = dict(workers=args.workers, slots=args.slots, duration_s=args.duration,
                runs=args.runs, loads=dict(loads), routers=[r[0] for r in routers],
                router_configs={r[0]: r[2] for r in routers}, engine=asdict(cfg),
                think_s=args.think, seed=args.seed, smg=args.smg if smg_ok else None,
                total_s=time.perf_counter() - t0, python=platform.python_version(),
                cpus=os.cpu_count(), json=out, png=png)
    with open(out, "w") as f:
        json.dump({"meta": meta, "summary": summary, "rows": rows}, f, indent=1)
    if png:
        plot(summary, png, title_of(meta))
    print_table(summary, meta)


if __name__ == "__main__":
    main()
