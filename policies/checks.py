"""Validation shared by the policies' frozen configs and inputs: every bad value raises
ValueError naming the class, the field and what was expected."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Mapping

__all__ = ["Configured", "NoSettings", "is_int", "is_real", "require", "resolve_config"]


def require(cond: bool, owner: str, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{owner}.{name}: {msg}")


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def resolve_config(cls: type, config: Any) -> Any:
    """`config` as an instance of `cls`: itself, built from a mapping, or the defaults."""
    if config is None:
        return cls()
    if isinstance(config, cls):
        return config
    if isinstance(config, Mapping):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**config)
    raise TypeError(f"expected a {cls.__name__}, a mapping or None, got {type(config).__name__}")


@dataclasses.dataclass(frozen=True, slots=True)
class NoSettings:
    """The config of a policy that has no settings."""


class Configured:
    """A policy with frozen settings: `Config` is its settings class; the constructor
    takes one, a mapping of its fields, or None (the defaults)."""

    Config: ClassVar[type] = NoSettings

    def __init__(self, config: Any = None) -> None:
        self.config = resolve_config(self.Config, config)
