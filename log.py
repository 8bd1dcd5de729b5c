"""Structured logging: `get_logger(__name__).info("event", request_id=..., epoch=...)`.

Configured once, on first use, from `PHALANX_LOG_LEVEL` (via `envs`); key-value lines
on stderr so request ids and epochs can be grepped.
"""

from __future__ import annotations

import logging
import sys

import structlog

from .envs import envs

_configured = False


def _configure() -> None:
    global _configured
    level = logging.getLevelName(envs().log_level)
    structlog.configure(
        processors=[structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.KeyValueRenderer(key_order=["timestamp", "level", "event"])],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    _configured = True


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    if not _configured:
        _configure()
    return structlog.get_logger(name).bind(logger=name)
