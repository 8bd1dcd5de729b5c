"""A `phalanx serve` subprocess for tests: start it, wait for its ready line, stop it.

Its stdout and stderr go to files (a pipe nobody drains could block the server).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

READY = re.compile(r"phalanx: serving (\S+) at (http://\S+) \(OpenAI base URL (\S+)\)")
PLACEMENT = re.compile(r"phalanx: (decode|group|prefill instance \d+) rank (\d+) on node (\w+)")


class ServeProcess:
    """`python -m phalanx.cli serve ARGS` with its output captured under `folder`."""

    def __init__(self, args: Sequence[str], folder: Path) -> None:
        self.out_path, self.err_path = folder / "serve.out", folder / "serve.err"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "phalanx.cli", "serve", *args],
                                         stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                         env=env)
        self.url: Optional[str] = None
        self.model: Optional[str] = None

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_ready(self, limit_s: float = 600.0) -> str:
        """The base URL once the ready line is out; AssertionError (with the stderr tail)
        if the process exits first or `limit_s` passes."""
        end = time.monotonic() + limit_s
        while time.monotonic() < end:
            m = READY.search(self.stdout())
            if m:
                self.model, self.url = m.group(1), m.group(2)
                return self.url
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"serve not ready (rc={self.proc.poll()}):\n{self.stderr()[-4000:]}")

    def placement(self) -> list[tuple[str, int, str]]:
        """(side, rank, node id) of every rank, from the progress lines."""
        return [(m.group(1), int(m.group(2)), m.group(3))
                for m in PLACEMENT.finditer(self.stderr())]

    def interrupt(self, sig: int = signal.SIGINT, limit_s: float = 180.0) -> int:
        """Send `sig`, then the exit code (AssertionError if it does not exit in `limit_s`)."""
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(limit_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"serve did not exit on {signal.Signals(sig).name}:\n"
                                 f"{self.stderr()[-4000:]}") from None

    def kill(self) -> None:
        """Best-effort teardown: SIGINT, SIGTERM, then SIGKILL."""
        for sig, wait_s in ((signal.SIGINT, 60), (signal.SIGTERM, 20), (signal.SIGKILL, 20)):
            if self.proc.poll() is not None:
                return
            self.proc.send_signal(sig)
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
