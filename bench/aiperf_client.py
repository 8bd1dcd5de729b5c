"""NVIDIA AIPerf, a load generator nobody here wrote, run against a phalanx server.

AIPerf (`aiperf profile`) lives in its own virtual environment, `.aiperf-<version>/` at
the checkout's root (git ignores it), made on first use: its ~80 dependencies (pandas,
pyzmq, a transformers of its own choosing, ...) stay out of the project's venv, whose
transformers is the numerics oracle. It is run as `python -m aiperf`, so the folder may
be renamed into place once complete.

A `Scenario` is one `aiperf profile` run; `profile` runs it and reads back what AIPerf
exported with `--export-level raw`: its summary (`profile_export_aiperf.json`), one raw
record per request (the request's payload, HTTP status, and the response: SSE packets or
a JSON body) and what it scraped from the server's `/metrics` during the run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

__all__ = ["AIPERF_VERSION", "Run", "Scenario", "aiperf_python", "profile", "response_text",
           "response_usage"]

AIPERF_VERSION = "0.13.0"
ROOT = Path(__file__).resolve().parent.parent


def aiperf_python(root: Path = ROOT, install_timeout_s: float = 900.0) -> Path:
    """The python of the AIPerf venv under `root`, made (and AIPerf installed) if missing.
    RuntimeError with pip's output if the install fails."""
    venv = root / f".aiperf-{AIPERF_VERSION}"
    python = venv / "bin" / "python"
    if python.exists():
        return python
    partial = Path(tempfile.mkdtemp(prefix=f".aiperf-{AIPERF_VERSION}.partial-", dir=root))
    try:
        subprocess.run([sys.executable, "-m", "venv", str(partial)], check=True,
                       capture_output=True, timeout=120)
        done = subprocess.run([str(partial / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile",
                               f"aiperf=={AIPERF_VERSION}"], capture_output=True, text=True,
                              timeout=install_timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"pip could not install aiperf=={AIPERF_VERSION} "
                               f"(rc {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
        try:
            partial.rename(venv)
        except OSError:  # another run finished first: keep its venv
            if not python.exists():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return python


ENDPOINTS = ("chat", "completions", "responses")


@dataclass(frozen=True, slots=True)
class Scenario:
    """One `aiperf profile` run: `requests` requests to the `endpoint` ("chat",
    "completions" or "responses"), `concurrency` at a time (0: at `rate` requests/s instead), synthetic
    prompts of exactly `isl` tokens asking for exactly `osl`; `conversations` > 0 makes
    that many chat sessions of `turns` turns instead of `requests` (AIPerf resends each
    session's history). `extra_inputs` are merged into every request body. With
    `server_token_count` AIPerf takes output token counts (its ITL's denominator) from the
    server's `usage`: re-tokenizing a random model's text does not give its tokens back."""

    name: str
    endpoint: str = "chat"
    streaming: bool = True
    requests: int = 8
    concurrency: int = 4
    rate: float = 0.0
    isl: int = 32
    osl: int = 12
    conversations: int = 0
    turns: int = 1
    extra_inputs: tuple[str, ...] = ("ignore_eos:true", "temperature:0")
    server_token_count: bool = True  # AIPerf counts tokens from `usage`, not by re-tokenizing

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint: one of {ENDPOINTS}, not {self.endpoint!r}")
        if self.requests < 1 or self.isl < 1 or self.osl < 1:
            raise ValueError("requests, isl and osl must be >= 1")
        if (self.concurrency > 0) == (self.rate > 0):
            raise ValueError("give a concurrency or a rate (one of them)")
        if self.conversations and (self.endpoint != "chat" or self.turns < 1):
            raise ValueError("conversations are chat sessions of >= 1 turns")

    @property
    def expected_requests(self) -> int:
        return self.conversations * self.turns if self.conversations else self.requests

    def args(self) -> list[str]:
        out = ["--endpoint-type", self.endpoint, "--request-count", str(self.expected_requests),
               "--synthetic-input-tokens-mean", str(self.isl), "--synthetic-input-tokens-stddev", "0",
               "--output-tokens-mean", str(self.osl), "--output-tokens-stddev", "0"]
        out += ["--concurrency", str(self.concurrency)] if self.concurrency else \
            ["--request-rate", str(self.rate)]
        if self.streaming:
            out.append("--streaming")
        if self.server_token_count:
            out.append("--use-server-token-count")
        if self.conversations:
            out += ["--conversation-num", str(self.conversations),
                    "--conversation-turn-mean", str(self.turns), "--conversation-turn-stddev", "0"]
        for item in self.extra_inputs:
            out += ["--extra-inputs", item]
        return out


@dataclass(slots=True)
class Run:
    """What one `profile` call read back."""

    scenario: Scenario
    summary: dict
    records: list[dict]
    server_metrics: dict = field(default_factory=dict)
    wall_s: float = 0.0


def profile(python: Path, url: str, model: str, tokenizer: str, scenario: Scenario,
            out_dir: Path, seed: int = 0, timeout_s: float = 600.0,
            api_key: Optional[str] = None) -> Run:
    """Run `scenario` against the server at `url` (its base, without /v1); RuntimeError
    with AIPerf's output tail if it fails."""
    art = out_dir / scenario.name
    cmd = [str(python), "-m", "aiperf", "profile", "--model", model, "--url", url,
           "--tokenizer", tokenizer, "--random-seed", str(seed), "--export-level", "raw",
           "--ui", "none", "--artifact-dir", str(art), *scenario.args()]
    if api_key:
        cmd += ["--api-key", api_key]
    # AIPerf's venv, not the project's paths; and not HF_HUB_OFFLINE, under which AIPerf
    # 0.13.0's record processors take a tokenizer folder for a hub id and fail
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    # its dataset's memory-mapped files in the run's folder, not one more /tmp/aiperf_mmap_*
    # per run, and no cache of them under ~/.cache/aiperf
    env.update(NO_COLOR="1", AIPERF_DATASET_MMAP_BASE_PATH=str(art),
               AIPERF_DATASET_MMAP_CACHE_ENABLED="false")
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    # cwd: out_dir, so that `-m aiperf` cannot find a module of that name where it runs
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env,
                          stdin=subprocess.DEVNULL, cwd=out_dir)
    wall = time.monotonic() - start
    summary_path = art / "profile_export_aiperf.json"
    if done.returncode != 0 or not summary_path.exists():
        raise RuntimeError(f"aiperf {scenario.name} failed (rc {done.returncode}):\n"
                           f"{(done.stdout + done.stderr)[-4000:]}")
    records = [json.loads(line) for line in
               (art / "profile_export_raw.jsonl").read_text().splitlines() if line.strip()]
    metrics_path = art / "server_metrics_export.json"
    server = json.loads(metrics_path.read_text()).get("metrics", {}) if metrics_path.exists() else {}
    return Run(scenario, json.loads(summary_path.read_text()), records, server, wall)


def _bodies(record: dict) -> list[dict]:
    """The JSON objects of a raw record's response: each SSE `data:` packet but [DONE],
    or the one body of a non-streamed answer."""
    out = []
    for resp in record.get("responses", []):
        if "packets" in resp:
            out += [json.loads(p["value"]) for p in resp["packets"]
                    if p.get("name") == "data" and p.get("value") not in (None, "[DONE]")]
        elif resp.get("text"):
            out.append(json.loads(resp["text"]))
    return out


def response_text(record: dict) -> str:
    """The text a request received: streamed deltas joined, or the body's choice (a
    Responses API body: its `output_text.delta` events, or its message's text)."""
    parts = []
    for body in _bodies(record):
        if body.get("type") == "response.output_text.delta":
            parts.append(body["delta"])
        elif body.get("object") == "response":
            parts += [c["text"] for item in body["output"] for c in item["content"]]
        for choice in body.get("choices") or []:
            if "delta" in choice:
                parts.append(choice["delta"].get("content") or "")
            elif "message" in choice:
                parts.append(choice["message"].get("content") or "")
            else:
                parts.append(choice.get("text") or "")
    return "".join(parts)


def response_usage(record: dict) -> Optional[dict]:
    """The `usage` object the server sent (the last one), None if it sent none; the
    Responses API's (`input_tokens`, `output_tokens`) named as the other routes'."""
    bodies = [b.get("response", b) for b in _bodies(record)]
    usage = [b["usage"] for b in bodies if b.get("usage")]
    if not usage:
        return None
    last = usage[-1]
    if "input_tokens" in last:
        return {"prompt_tokens": last["input_tokens"], "completion_tokens": last["output_tokens"],
                "total_tokens": last["total_tokens"]}
    return last
