"""Chaos drill per layout: `phalanx chaos --layout L` (the drills live in `chaos/`) with
faults at exact places of the code, again and again while the layout serves, and every
stream checked against the fault-free reference.

    python bench/chaos.py [--layouts dp2,tp2,dp2tp2,dp2-peer,disagg] [--duration 40]
                          [--every 8] [--seed 0]

Per layout, `phalanx serve` of the tiny model in a process of its own (CPU, local Ray);
every `--every` seconds a fault point of a random rank that passes it is armed, so its
process exits at its next pass: inside an MoE all-to-all (`moe_dispatch`: DP×EP groups and
the decode group), at a step (`step`: TP groups), before a KV send (`kv_send`: prefill
instances); and one more rank is killed while each re-formation runs (`at=recovery`).
The check (chaos/checker.py): every stream's token ids equal the reference's (lost,
duplicated, reordered or changed tokens fail). Prints a table last and writes JSON to
$OUT/chaos.json (or ./chaos.json); exit status 1 when a layout failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

POINTS = {"dp2": ["moe_dispatch"], "tp2": ["step"], "dp2tp2": ["moe_dispatch"],
          "dp2-peer": ["moe_dispatch"], "disagg": ["moe_dispatch", "kv_send"]}


def drill(layout: str, duration: float, every: float, seed: int, folder: Path) -> dict:
    """One `phalanx chaos` run of `layout`; its report's summary and faults."""
    faults = [f"fault-point:point={p}:every={every * len(POINTS[layout]):g}s"
              for p in POINTS[layout]] + ["kill-rank:at=recovery"]
    cmd = [sys.executable, "-m", "phalanx.cli", "chaos", "--layout", layout, "--duration",
           str(duration), "--seed", str(seed), "--report", str(folder)]
    cmd += [a for f in faults for a in ("--fault", f)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if not (folder / "report.json").exists():
        raise RuntimeError(f"{layout}: no report ({done.returncode}):\n{done.stderr[-3000:]}")
    body = json.loads((folder / "report.json").read_text())
    return {"layout": layout, "faults_given": faults, "exit": done.returncode,
            **body["summary"], "injected": [f["spec"] for f in body["faults"]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default=",".join(POINTS))
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of faults per layout")
    ap.add_argument("--every", type=float, default=8.0, help="seconds between fault points")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    names = args.layouts.split(",")
    unknown = [n for n in names if n not in POINTS]
    if unknown:
        ap.error(f"unknown layouts {unknown}; known: {', '.join(POINTS)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            rows.append(drill(name, args.duration, args.every, args.seed + i, Path(tmp) / name))
            print(f"  {rows[-1]}", flush=True)
    out = Path(os.environ.get("OUT", ".")) / "chaos.json"
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"\nwrote {out}")
    print("| layout | streams | verdicts | faults | re-formations seen | s | verdict |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['streams']} | {r['verdicts']} | {r['faults']} "
              f"| {r['recoveries_seen']} | {r['seconds']} | {'PASS' if r['passed'] else 'FAIL'} |")
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
