"""A name registry for pluggable policies: `kind` (e.g. "routing") -> `name` -> factory.

Contract:
- `register(kind, name)` is a class/function decorator; registering a name twice under
  one kind raises ValueError (two plugins silently shadowing each other is a bug).
- `get(kind, name)` returns the registered object; an unknown kind or name raises
  ValueError whose message lists the known ones, so a typo in a flag or a config file
  fails loudly with the fix in sight.
- `names(kind)` lists the names of one kind, sorted (empty for an unknown kind).

The registry is process-global and only ever grows at import time; lookups never mutate.
"""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")

_REGISTRY: dict[str, dict[str, object]] = {}


def _check_name(what: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"policy {what} must be a non-empty string, got {value!r}")
    return value


def register(kind: str, name: str) -> Callable[[T], T]:
    """Decorator: registers the decorated object as policy `name` of `kind`."""
    _check_name("kind", kind)
    _check_name("name", name)

    def deco(obj: T) -> T:
        table = _REGISTRY.setdefault(kind, {})
        if name in table and table[name] is not obj:
            raise ValueError(f"{kind} policy {name!r} is already registered "
                             f"(by {table[name]!r})")
        table[name] = obj
        return obj

    return deco


def get(kind: str, name: str) -> object:
    """The object registered as `name` of `kind`; ValueError listing the known ones."""
    table = _REGISTRY.get(kind)
    if table is None:
        raise ValueError(f"unknown policy kind {kind!r}; known kinds: {sorted(_REGISTRY)}")
    try:
        return table[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown {kind} policy {name!r}; known: {sorted(table)}") from None


def names(kind: str) -> list[str]:
    """Registered names of `kind`, sorted; [] when nothing of that kind is registered."""
    return sorted(_REGISTRY.get(kind, ()))


def kinds() -> list[str]:
    """Every kind with at least one registered name, sorted."""
    return sorted(_REGISTRY)
