"""The processes of one HTTP routing bench run (`bench/router_http.py`): the simulated
workers, and the router in front of them (the phalanx proxy or SMG), each started fresh
and stopped by its own pid, so no run inherits another's caches."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Optional, Sequence

from router_http_engine import EngineConfig

HERE = os.path.dirname(os.path.abspath(__file__))
SMG_ROUTER = "smg cache_aware"


@dataclass(frozen=True, slots=True)
class Ports:
    """The ports of one run: the router's and one per worker."""

    router: int
    workers: tuple[int, ...]

    @property
    def worker_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.workers]

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router}"


def _get(url: str, timeout: float = 2.0) -> Optional[bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read() if r.status == 200 else None
    except (urllib.error.URLError, OSError, ValueError):
        return None


def get_json(url: str) -> Optional[dict]:
    body = _get(url)
    return json.loads(body) if body else None


class Proc:
    """A child process with its output in a log file; `stop` ends it by its pid."""

    def __init__(self, name: str, argv: Sequence[str], log_path: str,
                 stop_signal: int = signal.SIGTERM) -> None:
        self.name, self.stop_signal = name, stop_signal
        self._log = open(log_path, "wb")
        self.popen = subprocess.Popen(list(argv), cwd=HERE, stdout=self._log,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_ready(self, check, timeout_s: float = 30.0) -> None:
        """Polls `check()` until true; RuntimeError if the process exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode} "
                                   f"(log: {self._log.name})")
            if check():
                return
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready after {timeout_s} s (log: {self._log.name})")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(self.stop_signal)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()


def start_workers(ports: Ports, cfg: EngineConfig, log_path: str) -> Proc:
    argv = [sys.executable, "router_http_worker.py",
            "--ports", ",".join(map(str, ports.workers)), "--slots", str(cfg.slots),
            "--page-size", str(cfg.page_size), "--capacity-pages", str(cfg.capacity_pages),
            "--prefill-fixed-s", repr(cfg.prefill_fixed_s),
            "--prefill-s-per-token", repr(cfg.prefill_s_per_token),
            "--decode-s-per-token", repr(cfg.decode_s_per_token)]
    proc = Proc("workers", argv, log_path)
    proc.wait_ready(lambda: all(_get(u + "/health") for u in ports.worker_urls))
    return proc


def start_phalanx(ports: Ports, policy: str, policy_config: Optional[dict],
                  cfg: EngineConfig, log_path: str) -> Proc:
    argv = [sys.executable, "router_http_proxy.py", "--port", str(ports.router),
            "--workers", ",".join(ports.worker_urls), "--policy", policy,
            "--page-size", str(cfg.page_size), "--capacity-pages", str(cfg.capacity_pages)]
    if policy_config:
        argv += ["--policy-config", json.dumps(policy_config)]
    proc = Proc(f"phalanx {policy}", argv, log_path)
    proc.wait_ready(lambda: _get(ports.router_url + "/health") is not None, timeout_s=60)
    return proc


def _smg_ready(ports: Ports) -> bool:
    models = get_json(ports.router_url + "/v1/models")
    workers = get_json(ports.router_url + "/workers")
    if not models or not models.get("data") or not workers:
        return False
    listed = workers.get("workers", workers) if isinstance(workers, dict) else workers
    return isinstance(listed, list) and len(listed) == len(ports.workers)


def start_smg(smg: str, ports: Ports, metrics_port: int, log_path: str,
              extra: Sequence[str] = ()) -> Proc:
    """SMG with `--policy cache_aware` over the workers (SIGINT stops it cleanly)."""
    argv = [smg, "launch", "--host", "127.0.0.1", "--port", str(ports.router),
            "--worker-urls", *ports.worker_urls, "--policy", "cache_aware",
            "--log-level", "warn", "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(metrics_port), *extra]
    proc = Proc(SMG_ROUTER, argv, log_path, stop_signal=signal.SIGINT)
    proc.wait_ready(lambda: _smg_ready(ports), timeout_s=60)
    return proc


__all__ = ["Ports", "Proc", "SMG_ROUTER", "get_json", "start_phalanx", "start_smg",
           "start_workers"]
