"""What the HTTP routing bench (`bench/router_http.py`) reports: one row per (load,
router, run) from the client's outcomes and the workers' ground truth, the summary per
(load, router) with ratios against round-robin of the same run, the table, and the PNG
of hit rate and p99 latency against load."""

from __future__ import annotations

import statistics
from typing import Optional

from router_http_load import LoadResult

BASELINE = "phalanx round_robin"


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_row(router: str, load: str, rate: float, run: int, result: LoadResult,
            truths: list[dict], proxy_stats: Optional[dict]) -> dict:
    """One run's figures: ground-truth hit rate (the workers' caches), latencies, the
    share of requests the busiest worker took, and the router's decision counters."""
    ok = [o for o in result.outcomes if o.ok]
    lat = [o.latency_s for o in ok]
    prompt = sum(t["prompt_tokens"] for t in truths)
    reqs = [t["requests"] for t in truths]
    row = dict(router=router, load=load, rate=rate, run=run, requests=len(ok),
               failed=len(result.outcomes) - len(ok), wall_s=result.wall_s,
               throughput=len(ok) / result.wall_s if result.wall_s else 0.0,
               hit_rate=sum(t["hit_tokens"] for t in truths) / prompt if prompt else 0.0,
               p50_s=_quantile(lat, 0.5), p99_s=_quantile(lat, 0.99),
               mean_s=statistics.fmean(lat) if lat else float("nan"),
               worker_requests=reqs,
               busiest_share=max(reqs) / sum(reqs) if sum(reqs) else 0.0,
               # mean share of the run's wall time each worker's prefill lane was busy
               prefill_busy=(sum(t.get("prefill_busy_s", 0.0) for t in truths)
                             / (len(truths) * result.wall_s)) if result.wall_s else 0.0,
               evicted_pages=sum(t.get("evictions", 0) for t in truths))
    if proxy_stats:
        decisions = proxy_stats.get("decisions") or 0
        row["load_overrides"] = proxy_stats.get("load_overrides")
        row["cost_overrides"] = proxy_stats.get("cost_overrides")
        overrides = (row["load_overrides"] or 0) + (row["cost_overrides"] or 0)
        row["override_share"] = overrides / decisions if decisions else None
        sat = proxy_stats.get("saturated")
        row["saturated_share"] = sat / decisions if decisions and sat is not None else None
        placed = proxy_stats.get("held_placed") or 0
        if proxy_stats.get("held_picks"):  # admission held requests at the router
            row["held_wait_mean_s"] = proxy_stats["held_wait_s"] / placed if placed else None
            row["held_pick_mean_ms"] = 1e3 * proxy_stats["held_pick_s"] / proxy_stats["held_picks"]
    return row


def add_ratios(rows: list[dict]) -> None:
    """Each row gets `hit_vs_rr` and `p99_vs_rr`: its figure over round-robin's in the
    same (load, run)."""
    base = {(r["load"], r["run"]): r for r in rows if r["router"] == BASELINE}
    for r in rows:
        b = base.get((r["load"], r["run"]))
        r["hit_vs_rr"] = r["hit_rate"] / b["hit_rate"] if b and b["hit_rate"] else None
        r["p99_vs_rr"] = r["p99_s"] / b["p99_s"] if b and b["p99_s"] else None


def add_common_hits(rows: list[dict], outcomes: dict) -> None:
    """Each router's hit rate over the turns that it and SMG of the same (load, run) both
    answered (`hit_common`, and SMG's over the same turns, `smg_hit_common`): a turn's
    prompt is the same whichever router placed it, so this compares placement on equal
    work; the plain hit rate also weighs which turns a router got to answer (a slower
    one answers fewer late turns, whose long prompts hit less). `outcomes` maps
    (load, run, router) to that run's client outcomes."""
    def answered(key) -> dict:
        return {(o.conversation, o.turn): o for o in outcomes.get(key, ()) if o.ok}

    for r in rows:
        smg = next((k for k in outcomes if k[:2] == (r["load"], r["run"])
                    and k[2].startswith("smg")), None)
        if smg is None:
            continue
        mine, theirs = answered((r["load"], r["run"], r["router"])), answered(smg)
        both = mine.keys() & theirs.keys()
        prompt = sum(mine[t].prompt_tokens for t in both)
        r["common_turns"] = len(both)
        r["hit_common"] = sum(mine[t].cached_tokens for t in both) / prompt if prompt else None
        r["smg_hit_common"] = (sum(theirs[t].cached_tokens for t in both) / prompt
                               if prompt else None)


def summarize(rows: list[dict]) -> list[dict]:
    """Per (load, router): means over runs (medians for latencies), and per run wins
    of each router against SMG on hit rate and p99."""
    out = []
    keys = list(dict.fromkeys((r["load"], r["router"]) for r in rows))
    smg = {(r["load"], r["run"]): r for r in rows if r["router"].startswith("smg")}
    for load, router in keys:
        rs = [r for r in rows if r["load"] == load and r["router"] == router]
        vs = [(r, smg.get((load, r["run"]))) for r in rs]
        vs = [(r, s) for r, s in vs if s is not None and s is not r]

        def med(k):
            xs = [r[k] for r in rs if r.get(k) is not None]
            return statistics.median(xs) if xs else None
        out.append(dict(
            load=load, router=router, rate=rs[0]["rate"], runs=len(rs),
            requests=sum(r["requests"] for r in rs), failed=sum(r["failed"] for r in rs),
            hit_rate=statistics.fmean(r["hit_rate"] for r in rs),
            hit_rate_min=min(r["hit_rate"] for r in rs),
            hit_rate_max=max(r["hit_rate"] for r in rs),
            p50_s=med("p50_s"), p99_s=med("p99_s"),
            p99_s_min=min(r["p99_s"] for r in rs), p99_s_max=max(r["p99_s"] for r in rs),
            throughput=statistics.fmean(r["throughput"] for r in rs),
            busiest_share=statistics.fmean(r["busiest_share"] for r in rs),
            prefill_busy=statistics.fmean(r.get("prefill_busy", 0.0) for r in rs),
            evicted_pages=statistics.fmean(r.get("evicted_pages", 0) for r in rs),
            override_share=med("override_share"), saturated_share=med("saturated_share"),
            hit_vs_rr=med("hit_vs_rr"), p99_vs_rr=med("p99_vs_rr"),
            runs_beating_smg_hit=sum(r["hit_rate"] > s["hit_rate"] for r, s in vs) if vs else None,
            runs_beating_smg_p99=sum(r["p99_s"] < s["p99_s"] for r, s in vs) if vs else None,
            hit_common=_mean(r.get("hit_common") for r in rs),
            smg_hit_common=_mean(r.get("smg_hit_common") for r in rs),
            runs_beating_smg_hit_common=sum(r["hit_common"] > r["smg_hit_common"] for r in rs
                                            if r.get("hit_common") is not None)
            if vs else None))
    return out


def _mean(xs) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def print_table(summary: list[dict], meta: dict) -> None:
    print(f"\n{meta['workers']} workers x {meta['slots']} slots, {meta['duration_s']} s of "
          f"new turns per run, {meta['runs']} runs per (load, router), routers alternating; "
          f"JSON: {meta['json']}" + (f"; PNG: {meta['png']}" if meta.get("png") else ""))
    print(f"{'load':6} {'rate':>5} {'router':26} {'reqs':>5} {'fail':>4} {'req/s':>5} {'hit':>6} "
          f"{'(min-max)':>13} {'p50 s':>6} {'p99 s':>6} {'(min-max)':>13} {'busiest':>7} "
          f"{'busy':>5} {'evicted':>7} "
          f"{'overr.':>6} {'hit/rr':>6} {'p99/rr':>6} {'>smg hit':>8} {'>smg p99':>8} "
          f"{'hit common (smg)':>16} {'>smg':>4}")
    for s in summary:
        print(f"{s['load']:6} {s['rate']:5.1f} {s['router']:26} {s['requests']:5d} "
              f"{s['failed']:4d} {s['throughput']:5.2f} {s['hit_rate']:6.3f} "
              f"{s['hit_rate_min']:6.3f}-{s['hit_rate_max']:6.3f} {s['p50_s']:6.3f} "
              f"{s['p99_s']:6.3f} {s['p99_s_min']:6.3f}-{s['p99_s_max']:6.3f} "
              f"{s['busiest_share']:7.2f} {s['prefill_busy']:5.2f} {s['evicted_pages']:7.0f} "
              f"{_f(s['override_share'], '6.3f'):>6} "
              f"{_f(s['hit_vs_rr'], '6.2f'):>6} {_f(s['p99_vs_rr'], '6.2f'):>6} "
              f"{_f(s['runs_beating_smg_hit'], 'd'):>8} {_f(s['runs_beating_smg_p99'], 'd'):>8} "
              f"{_f(s.get('hit_common'), '.3f'):>7} ({_f(s.get('smg_hit_common'), '.3f')}) "
              f"{_f(s.get('runs_beating_smg_hit_common'), 'd'):>4}")


def plot(summary: list[dict], path: str, title: Optional[str] = None) -> None:
    """Hit rate and p99 latency against the request rate, one line per router, the
    load names under the rates; p99 whiskers span the runs' min-max."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_hit, ax_p99) = plt.subplots(1, 2, figsize=(10, 4), dpi=80)
    for router in dict.fromkeys(s["router"] for s in summary):
        ss = sorted((s for s in summary if s["router"] == router), key=lambda s: s["rate"])
        rates = [s["rate"] for s in ss]
        hit = [s["hit_rate"] for s in ss]
        ax_hit.errorbar(rates, hit, yerr=[[h - s["hit_rate_min"] for h, s in zip(hit, ss)],
                                          [s["hit_rate_max"] - h for h, s in zip(hit, ss)]],
                        marker="o", capsize=3, label=router)
        p99 = [s["p99_s"] for s in ss]
        ax_p99.errorbar(rates, p99, yerr=[[p - s["p99_s_min"] for p, s in zip(p99, ss)],
                                          [s["p99_s_max"] - p for p, s in zip(p99, ss)]],
                        marker="o", capsize=3, label=router)
    ticks = {s["rate"]: f"{s['load']}\n{s['rate']:g}" for s in summary}
    for ax in (ax_hit, ax_p99):
        ax.set_xticks(sorted(ticks), [ticks[r] for r in sorted(ticks)])
        ax.grid(alpha=0.3)
    ax_hit.set(xlabel="offered load (req/s)", ylabel="prefix hit rate (workers' caches)")
    ax_p99.set(xlabel="offered load (req/s)", ylabel="p99 latency (s, log scale)")
    ax_p99.set_yscale("log")
    ax_hit.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def title_of(meta: dict) -> str:
    """The figure's title: workers, cache size, runs."""
    e = meta.get("engine") or {}
    return (f"{meta.get('workers')} simulated workers, {e.get('capacity_pages')} cached pages "
            f"of {e.get('page_size')} tokens each, {meta.get('runs')} runs per point "
            f"(median p99, mean hit; bars: min-max)")


def main(argv=None) -> None:
    """`python bench/router_http_report.py BENCH.json [PNG]`: the table again, and the
    PNG redrawn (default: next to the JSON)."""
    import json
    import os
    import sys
    args = sys.argv[1:] if argv is None else argv
    with open(args[0]) as f:
        data = json.load(f)
    png = args[1] if len(args) > 1 else os.path.splitext(args[0])[0] + ".png"
    plot(data["summary"], png, title_of(data["meta"]))
    print_table(data["summary"], {**data["meta"], "png": png})


__all__ = ["BASELINE", "add_common_hits", "add_ratios", "plot", "print_table", "run_row", "summarize", "title_of"]


if __name__ == "__main__":
    main()
