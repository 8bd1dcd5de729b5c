"""`phalanx chaos`: a drill against a running server (`--url`, its Ray cluster at
`--address`) or against a layout it starts itself (`--layout`), with a verdict and a
report. Exit status 0 when every stream passed the check, 1 when one did not.

    phalanx chaos --url http://127.0.0.1:8000 --api-key K --address auto --duration 120 \\
        --fault kill-rank:every=15s --fault pause-rank:every=40s:for=5s --seed 1 --report DIR
    phalanx chaos --layout disagg --duration 60 --fault kill-rank:every=15s
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from .faults import parse_fault

__all__ = ["add_chaos", "run_chaos"]

LAYOUTS = {"disagg": dict(prefill_tp=1, decode_dp=2), "dp2": dict(tp=1, dp=2),
           "tp2": dict(tp=2, dp=1), "dp2tp2": dict(tp=2, dp=2),
           "dp2-peer": dict(tp=1, dp=2, ep_exchange="peer")}
READY = re.compile(r"serving \S+ at (http://\S+)")
RAY_LINE = re.compile(r"Ray cluster at (\S+)")


def add_chaos(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chaos", help="drill a server with faults from outside; check every "
                                     "stream against a fault-free run",
                       description=__doc__.split("\n\n")[0])
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running `phalanx serve` (http://HOST:PORT)")
    target.add_argument("--layout", choices=sorted(LAYOUTS),
                        help="start this layout of the tiny (or --model) model here and drill it")
    p.add_argument("--api-key", default=None, help="the server's API key")
    p.add_argument("--address", default="auto",
                   help="the server's Ray cluster, as `phalanx serve` prints it (\"Ray "
                        "cluster at ...\"; with --url; default: auto, the newest cluster "
                        "of this machine: give it where several run)")
    p.add_argument("--model", default=None, help="with --layout: a model folder (default: tiny)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of faulted load")
    p.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help="KIND[:every=15s|rate=0.1|at=10s,recovery][:for=5s][:role=R]"
                        "[:point=P]; kinds: kill-rank, kill-actor, pause-rank, fault-point, "
                        "kv-delay, kv-drop, remove-node (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="schedule, victims and workload")
    p.add_argument("--requests", type=int, default=48, help="distinct requests (cycled)")
    p.add_argument("--concurrency", type=int, default=8, help="streams at once")
    p.add_argument("--max-recoveries", type=int, default=50,
                   help="with --layout: the server's restart intensity")
    p.add_argument("--report", default=None, help="folder for report.json, summary.md, "
                                                  "timeline.png")


def run_chaos(args: argparse.Namespace) -> int:
    from .runner import DrillConfig
    faults = tuple(parse_fault(f) for f in args.fault)
    config = DrillConfig(duration_s=args.duration, faults=faults, seed=args.seed,
                         requests=args.requests, concurrency=args.concurrency)
    with contextlib.ExitStack() as stack:
        if args.layout:
            url = stack.enter_context(_own_server(args))
        else:
            url = args.url
            if faults:
                _join_ray(args.address)
        result, table = asyncio.run(_drill(url, args.api_key, config,
                                           Path(args.report) if args.report else None))
    print(table)
    return 0 if result.passed else 1


@contextlib.contextmanager
def _own_server(args):
    """`phalanx serve` of the layout as a process of its own (faults come from outside:
    this process only joins its Ray cluster); yields its URL, stops it at exit."""
    cmd = [sys.executable, "-m", "phalanx.cli", "serve", "--port", "0",
           "--max-num-seqs", "16", "--page-size", "4", "--num-pages", "1024",
           "--max-num-batched-tokens", "256", "--collective-timeout", "10",
           "--max-recoveries", str(args.max_recoveries)]
    cmd += [a for k, v in LAYOUTS[args.layout].items() for a in (f"--{k.replace('_', '-')}", str(v))]
    if args.model:
        cmd += ["--model", args.model]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        url = _ready_url(proc, log)
        log.seek(0)
        address = RAY_LINE.search(log.read())
        if address is None:
            raise RuntimeError("phalanx serve did not say which Ray cluster it runs on")
        print(f"phalanx chaos: {args.layout} serving at {url} (pid {proc.pid}, Ray cluster "
              f"{address.group(1)})", flush=True)
        _join_ray(address.group(1))
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()


def _ready_url(proc: subprocess.Popen, log) -> str:
    """The URL of `phalanx serve`'s ready line (RuntimeError with its log if it exits)."""
    for line in proc.stdout:
        match = READY.search(line)
        if match:
            return match.group(1)
    proc.wait()
    log.seek(0)
    raise RuntimeError(f"phalanx serve exited ({proc.returncode}) before serving:\n"
                       f"{log.read()[-3000:]}")


def _join_ray(address: str) -> None:
    """Connect this process to the server's Ray cluster as a driver. A local cluster of
    Ray 2.5x+ wants its token (~/.ray/auth_token, written when it started): token
    authentication is switched on here when that file exists and the mode is unset."""
    if "RAY_AUTH_MODE" not in os.environ and (Path.home() / ".ray" / "auth_token").exists():
        os.environ["RAY_AUTH_MODE"] = "token"
    import ray
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)


async def _drill(url: str, api_key: Optional[str], config, report: Optional[Path]):
    from ..sdk import AsyncClient
    from .report import write_report
    from .runner import Drill
    say = lambda line: print(line, flush=True)  # noqa: E731
    async with AsyncClient(url, api_key, max_retries=0, timeout=120.0) as client:
        drill = Drill(client, config, stats=lambda: metrics_stats(url, api_key), progress=say)
        say(f"phalanx chaos: reference pass ({config.requests} requests, no faults)")
        references = await drill.reference()
        say(f"phalanx chaos: {config.duration_s:g} s with "
            f"{', '.join(f.text for f in config.faults) or 'no faults'} (seed {config.seed})")
        result = await drill.run(references)
    return result, write_report(result, report)


async def metrics_stats(url: str, api_key: Optional[str]) -> dict:
    """The serving stats a drill watches, from the server's `/metrics`."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families
    names = {"phalanx_recoveries": "recoveries", "phalanx_backend_healthy": "healthy",
             "phalanx_dp_width": "width"}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        async with session.get(url.rstrip("/") + "/metrics", headers=headers) as resp:
            text = await resp.text()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                out[names[sample.name]] = sample.value
    return out


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="phalanx")
    add_chaos(parser.add_subparsers(dest="command", required=True))
    sys.exit(run_chaos(parser.parse_args()))
