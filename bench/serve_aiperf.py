"""phalanx under NVIDIA AIPerf: what AIPerf measures, beside what the server measured of
the same requests.

    python bench/serve_aiperf.py                               # tiny model, CPU
    python bench/serve_aiperf.py --concurrency 1,16,64 --isl 512 --osl 256 --device cuda \\
        --model DIR
    python bench/serve_aiperf.py --url http://127.0.0.1:8000 --model NAME --tokenizer DIR

It starts `phalanx serve MODEL --tp 1 --dp 1` (or measures the server at `--url`) and runs
`aiperf profile` (its own venv, `bench/aiperf_client.py`) per concurrency level: streamed
chat requests of `--isl` prompt tokens asking for `--osl` (EOS ignored). Per level:
AIPerf's output tok/s, TTFT and ITL; and the server's own TTFT and inter-token histograms
over the same window, which AIPerf scraped from `/metrics` (the baseline: the ratio
AIPerf / server is what the HTTP path and the client add). A table last, JSON under $OUT
(or .).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from aiperf_client import Run, Scenario, aiperf_python, profile  # noqa: E402
from serve import Server  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None,
                    help="model folder (default: the tiny model); with --url, the served name")
    ap.add_argument("--tokenizer", default=None, help="with --url: the model's folder")
    ap.add_argument("--url", default=None, help="measure this server instead of starting one")
    ap.add_argument("--api-key", default=None, help="with --url: the server's key")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--isl", type=int, default=64)
    ap.add_argument("--osl", type=int, default=32)
    ap.add_argument("--requests", type=int, default=0, help="per level (default: 4 x level, >= 8)")
    ap.add_argument("--max-num-seqs", type=int, default=0, help="default: the largest level")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=900.0, help="server start-up limit")
    args = ap.parse_args(argv)
    if args.url and not (args.model and args.tokenizer):
        ap.error("--url needs --model (the served name) and --tokenizer (a folder)")
    return args


def _server_stats(run: Run, name: str) -> dict:
    """A server histogram's stats over AIPerf's run (seconds), {} if it was not scraped."""
    metric = run.server_metrics.get(f"phalanx:{name}")
    return metric["series"][0]["stats"] if metric and metric.get("series") else {}


def level_row(run: Run) -> dict:
    s = run.summary
    ttft, itl = s.get("time_to_first_token", {}), s.get("inter_token_latency", {})
    srv_ttft, srv_itl = _server_stats(run, "time_to_first_token_seconds"), \
        _server_stats(run, "inter_token_latency_seconds")
    row = dict(level=run.scenario.name, requests=s["request_count"]["avg"],
               errors=len(s.get("error_summary") or []),
               out_tok_s=s["output_token_throughput"]["avg"],
               ttft_p50_ms=ttft.get("p50"), ttft_p99_ms=ttft.get("p99"), ttft_avg_ms=ttft.get("avg"),
               itl_p50_ms=itl.get("p50"), itl_avg_ms=itl.get("avg"),
               server_ttft_avg_ms=1e3 * srv_ttft["avg"] if srv_ttft.get("count") else None,
               server_itl_avg_ms=1e3 * srv_itl["avg"] if srv_itl.get("count") else None)
    for key in ("ttft", "itl"):
        mine, theirs = row[f"{key}_avg_ms"], row[f"server_{key}_avg_ms"]
        row[f"{key}_vs_server"] = mine / theirs if mine and theirs else None
    return row


def table(rows: list[dict]) -> list[str]:
    def f(v, spec=".1f"):
        return "-" if v is None else format(v, spec)

    out = ["| level | requests | errors | out tok/s | TTFT p50 / p99 ms | ITL p50 ms | "
           "TTFT avg: AIPerf / server | ITL avg: AIPerf / server |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['level']} | {r['requests']:.0f} | {r['errors']} | {f(r['out_tok_s'])} | "
                   f"{f(r['ttft_p50_ms'])} / {f(r['ttft_p99_ms'])} | {f(r['itl_p50_ms'], '.2f')} | "
                   f"{f(r['ttft_avg_ms'])} / {f(r['server_ttft_avg_ms'])} = {f(r['ttft_vs_server'], '.3f')} | "
                   f"{f(r['itl_avg_ms'], '.2f')} / {f(r['server_itl_avg_ms'], '.2f')} = "
                   f"{f(r['itl_vs_server'], '.3f')} |")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = Path(os.environ.get("OUT", "."))
    levels = [int(c) for c in args.concurrency.split(",")]
    python = aiperf_python()
    server = None
    if args.url is None:
        from phalanx.models.tiny import default_model_dir
        folder = args.model or str(default_model_dir())
        opts = argparse.Namespace(concurrency=args.concurrency, device=args.device,
                                  max_num_seqs=args.max_num_seqs, max_model_len=0,
                                  load_format=None, cuda_graph_max_prefill=None)
        server = Server.started(folder, opts, out_dir, args.timeout_s)
        url, model, tokenizer = server.url, server.model, folder
    else:
        url, model, tokenizer = args.url.rstrip("/"), args.model, args.tokenizer
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="aiperf_") as tmp:
            for c in levels:
                scenario = Scenario(f"c{c}", "chat", streaming=True,
                                    requests=args.requests or max(8, 4 * c), concurrency=c,
                                    isl=args.isl, osl=args.osl, extra_inputs=("ignore_eos:true",))
                rows.append(level_row(profile(python, url, model, tokenizer, scenario, Path(tmp),
                                              seed=args.seed, api_key=args.api_key)))
                print(f"{scenario.name}: {rows[-1]['out_tok_s']:.1f} tok/s", flush=True)
    finally:
        if server is not None:
            server.stop()
    (out_dir / "serve_aiperf.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"\nJSON: {out_dir / 'serve_aiperf.json'}")
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
