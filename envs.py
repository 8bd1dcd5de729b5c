"""Typed registry of the environment variables phalanx reads.

This module is the only place in phalanx that reads ``os.environ``. Every
variable is declared once in ``_REGISTRY`` with its parser and default;
``envs()`` reads them at call time (no caching), so tests can monkeypatch the
environment and see the change immediately.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "NOTSET")


@dataclass(frozen=True, slots=True)
class Envs:
    """Snapshot of phalanx's environment configuration.

    cache_dir: PHALANX_CACHE_DIR, default ``~/.cache/phalanx`` (``~`` expanded).
    log_level: PHALANX_LOG_LEVEL, default ``"WARNING"``; upper-cased, must be a
        standard ``logging`` level name.
    triton_cache_dir: TRITON_CACHE_DIR when the user set it (Triton's own variable,
        read here so it stays the one place), else None: phalanx then keeps Triton's
        compiled kernels under ``cache_dir / "triton"`` (`triton_cache_path`).
    """

    cache_dir: Path
    log_level: str
    triton_cache_dir: Path | None = None

    @property
    def triton_cache_path(self) -> Path:
        """Where Triton keeps compiled kernels: a restart loads them instead of compiling."""
        return self.triton_cache_dir or self.cache_dir / "triton"


def _parse_cache_dir(raw: str | None) -> Path:
    if raw is None or raw.strip() == "":
        return Path.home() / ".cache" / "phalanx"
    return Path(raw).expanduser()


def _parse_log_level(raw: str | None) -> str:
    if raw is None or raw.strip() == "":
        return logging.getLevelName(logging.WARNING)
    level = raw.strip().upper()
    if level not in _LOG_LEVELS:
        raise ValueError(f"PHALANX_LOG_LEVEL={raw!r} is not one of {', '.join(_LOG_LEVELS)}")
    return level


# field name -> (environment variable, parser of the raw value or None)
_REGISTRY: dict[str, tuple[str, Callable[[str | None], object]]] = {
    "cache_dir": ("PHALANX_CACHE_DIR", _parse_cache_dir),
    "log_level": ("PHALANX_LOG_LEVEL", _parse_log_level),
    "triton_cache_dir": ("TRITON_CACHE_DIR",
                         lambda raw: Path(raw).expanduser() if raw and raw.strip() else None),
}


def envs() -> Envs:
    """Read every registered variable from ``os.environ`` now and return them.

    Raises ValueError naming the variable when a value cannot be parsed.
    """
    values = {field: parse(os.environ.get(var)) for field, (var, parse) in _REGISTRY.items()}
    return Envs(**values)
