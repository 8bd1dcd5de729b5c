"""A drill's report: `report.json` (every stream's verdict, the faults, the marks, the
series), a summary table on the terminal, and `timeline.png` (throughput and in-flight
streams over time, each fault, re-formation and recovery marked) when matplotlib is
installed (`pip install phalanx[bench]`)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Optional

from .runner import DrillResult

__all__ = ["series", "summary", "write_report"]


def series(result: DrillResult, bin_s: float = 1.0) -> dict:
    """Per `bin_s` from the drill's start: tokens/s and streams in flight."""
    n = max(1, int(result.seconds / bin_s) + 1)
    tokens, flight = [0.0] * n, [0] * n
    t0 = result.started
    for rec in result.records:
        for t, chunk in zip(rec.times, rec.chunks):
            tokens[min(n - 1, int((t - t0) / bin_s))] += len(chunk) / bin_s
        for b in range(int((rec.start - t0) / bin_s), min(n, int((rec.end - t0) / bin_s) + 1)):
            flight[b] += 1
    return {"bin_s": bin_s, "tokens_per_s": tokens, "in_flight": flight}


def summary(result: DrillResult) -> dict:
    kinds = Counter(v.kind for v in result.verdicts)
    return {"passed": result.passed, "seconds": round(result.seconds, 1),
            "streams": len(result.records), "verdicts": dict(kinds),
            "tokens": sum(r.tokens for r in result.records),
            "faults": len(result.injected), "skipped_faults": len(result.skipped),
            "fault_errors": len(result.fault_errors),
            "recoveries_seen": sum(m[1] == "recovered" for m in result.marks),
            "service_gave_up": result.service_gave_up}


def _table(s: dict, result: DrillResult) -> str:
    rows = [("streams checked", s["streams"]), ("tokens", s["tokens"])]
    rows += [(f"  {kind}", n) for kind, n in sorted(s["verdicts"].items())]
    rows += [("faults injected", s["faults"]), ("faults skipped (no victim)", s["skipped_faults"]),
             ("fault errors", s["fault_errors"]), ("recoveries seen", s["recoveries_seen"]),
             ("service gave up", s["service_gave_up"]),
             ("verdict", "PASS" if s["passed"] else "FAIL")]
    lines = ["| what | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    failing = [(r, v) for r, v in zip(result.records, result.verdicts) if not v.passed][:10]
    lines += [f"  request {r.request}: {v.kind} ({v.detail}; {v.received}/{v.expected} tokens)"
              for r, v in failing]
    return "\n".join(lines)


def write_report(result: DrillResult, folder: Optional[Path]) -> str:
    """Write the report under `folder` (if given); the summary table as text."""
    s = summary(result)
    table = _table(s, result)
    if folder is None:
        return table
    folder.mkdir(parents=True, exist_ok=True)
    body = {"summary": s, "config": {"duration_s": result.config.duration_s,
                                     "faults": [f.text for f in result.config.faults],
                                     "seed": result.config.seed,
                                     "requests": result.config.requests,
                                     "concurrency": result.config.concurrency},
            "started": result.started,
            "faults": [{"t": i.t - result.started, "spec": i.spec, "target": i.target,
                        "note": i.note} for i in result.injected],
            "skipped": [{"t": t - result.started, "spec": s_, "why": w}
                        for t, s_, w in result.skipped],
            "fault_errors": [{"t": t - result.started, "spec": s_, "error": e}
                             for t, s_, e in result.fault_errors],
            "marks": [{"t": t - result.started, "kind": k, "note": n} for t, k, n in result.marks],
            "streams": [{"request": r.request, "start": r.start - result.started,
                         "end": r.end - result.started, "tokens": r.tokens, "cut_off": r.cut_off,
                         "error": r.error, "verdict": v.kind, "detail": v.detail}
                        for r, v in zip(result.records, result.verdicts)],
            "series": series(result)}
    (folder / "report.json").write_text(json.dumps(body, indent=1))
    png = _plot(result, body["series"], folder / "timeline.png")
    (folder / "summary.md").write_text(table + "\n")
    return table + (f"\nreport: {folder / 'report.json'}" +
                    (f", {png}" if png else " (no timeline.png: matplotlib is not installed)"))


def _plot(result: DrillResult, s: dict, path: Path) -> Optional[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    t = [i * s["bin_s"] for i in range(len(s["tokens_per_s"]))]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    ax.plot(t, s["tokens_per_s"], color="tab:blue", label="tokens/s")
    ax.set_xlabel("seconds into the drill")
    ax.set_ylabel("tokens/s")
    ax2 = ax.twinx()
    ax2.plot(t, s["in_flight"], color="tab:gray", alpha=0.6, label="streams in flight")
    ax2.set_ylabel("streams in flight")
    colors = {"re-forming": "tab:orange", "recovered": "tab:green", "width": "tab:purple"}
    for inj in result.injected:
        ax.axvline(inj.t - result.started, color="tab:red", lw=1.2)
    for when, kind, _ in result.marks:
        ax.axvline(when - result.started, color=colors.get(kind, "k"), lw=0.9, ls="--")
    handles = [plt.Line2D([], [], color="tab:red", label="fault"),
               plt.Line2D([], [], color="tab:orange", ls="--", label="new ranks (re-forming)"),
               plt.Line2D([], [], color="tab:green", ls="--", label="recovery done"),
               plt.Line2D([], [], color="tab:purple", ls="--", label="DP width changed")]
    ax.legend(handles=ax.get_legend_handles_labels()[0] and
              [*ax.get_legend_handles_labels()[0], *handles], loc="upper left", fontsize=8)
    verdict = "PASS" if result.passed else "FAIL"
    ax.set_title(f"chaos drill: {', '.join(f.text for f in result.config.faults) or 'no faults'}"
                 f" — {verdict}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
