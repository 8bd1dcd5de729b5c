"""What `phalanx serve` prints while it serves, at the default log level: one access line
per HTTP request (aiohttp's access logger, on stderr) and, every `every_s` seconds with
traffic, a throughput line in the manner of vLLM's:

    phalanx: 12.0 req/s, prompt 1534.0 tok/s, generation 3071.9 tok/s; running 16,
    waiting 0, KV 23.4% (window 10 s)

`--quiet` turns both off. The numbers are the server's own metrics (`ServerMetrics`)
and the backend's stats over the window.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Callable, Mapping, Optional

from .metrics import ServerMetrics

__all__ = ["access_logger", "ACCESS_FORMAT", "throughput_line", "report_throughput"]

ACCESS_FORMAT = '%a "%r" %s %Tf s %{X-Request-Id}o'


def access_logger() -> logging.Logger:
    """A logger writing aiohttp's access lines to stderr as `phalanx: ...` lines."""
    logger = logging.getLogger("phalanx.access")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("phalanx: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def throughput_line(before: Mapping[str, float], after: Mapping[str, float],
                    stats: Mapping[str, float], seconds: float) -> Optional[str]:
    """The line for a window between two `ServerMetrics.totals()`, or None when
    nothing happened in it (an idle server prints nothing)."""
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    if not any(delta.values()) and not stats.get("num_running"):
        return None
    rate = {k: v / seconds for k, v in delta.items()}
    return (f"{rate['requests']:.1f} req/s, prompt {rate['prompt_tokens']:.1f} tok/s, "
            f"generation {rate['generation_tokens']:.1f} tok/s; running "
            f"{int(stats.get('num_running', 0))}, waiting {int(stats.get('num_waiting', 0))}, "
            f"KV {100 * float(stats.get('kv_usage', 0.0)):.1f}% (window {seconds:g} s)")


async def report_throughput(metrics: ServerMetrics, stats: Callable[[], Mapping[str, float]],
                            say: Callable[[str], None], every_s: float = 10.0) -> None:
    """Print `throughput_line` every `every_s` seconds until cancelled."""
    before = metrics.totals()
    while True:
        await asyncio.sleep(every_s)
        after = metrics.totals()
        line = throughput_line(before, after, stats(), every_s)
        if line is not None:
            say(line)
        before = after
