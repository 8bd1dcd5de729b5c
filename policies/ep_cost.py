"""The cost model behind the EP-width decision: a decode step's time and a rank's memory
for a DP×EP group of a given width, predicted from tables measured on this machine.

Plain data (JSON in and out), no torch, no Ray. The tables come from the real ranks: a
calibration at start (`actors/ep_calibration.py`) or `bench/ep_width.py`, which writes
them to a file (`CostTables.to_json`). Never constants from a paper.

A decode step of a rank in a group of `width` ranks, each DP rank with `tokens` tokens
(the largest batch of the group: lockstep pads every rank to it) at mean context `ctx`:

    step = overhead(width) + attention(tokens, ctx) + experts(active, tokens * k)
           + exchange(width, tokens)            (width > 1: dispatch + combine)

where `active` is the expected number of distinct experts a rank computes per MoE layer
(seed 001: a wider group holds fewer experts per rank, so it reads fewer weight bytes per
step): E experts over `width` ranks, `tokens * width` tokens routed to k each, uniform:
``active = E * (1 - (1 - k / E) ** (tokens * width)) / width``. Each table is summed
over all layers of one step and given in microseconds.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any, Sequence

from .checks import is_int, is_real, require

__all__ = ["CostTables", "Grid", "ModelNumbers", "active_experts", "kv_tokens_per_rank",
           "weight_bytes_per_rank"]


@dataclass(frozen=True, slots=True)
class ModelNumbers:
    """What the decision needs of a model: experts (per MoE layer), experts per token,
    MoE layers, one expert's bytes in one layer, the bytes every DP rank holds whole
    (attention, norms, embeddings), and KV bytes per token (all layers, one DP rank)."""

    num_experts: int
    experts_per_token: int
    moe_layers: int
    expert_bytes: int
    dense_bytes: int
    kv_bytes_per_token: int

    def __post_init__(self) -> None:
        me = "ModelNumbers"
        for name in ("num_experts", "experts_per_token", "moe_layers", "expert_bytes",
                     "dense_bytes", "kv_bytes_per_token"):
            v = getattr(self, name)
            require(is_int(v) and v >= 0, me, name, f"must be an integer >= 0, got {v!r}")
        require(self.experts_per_token <= max(self.num_experts, 1), me, "experts_per_token",
                f"{self.experts_per_token} > num_experts {self.num_experts}")


def active_experts(model: ModelNumbers, width: int, tokens: float) -> float:
    """Expected distinct experts one rank of `width` computes per MoE layer when each of
    the group's ranks routes `tokens` tokens (uniform routing)."""
    e, k = model.num_experts, model.experts_per_token
    if e == 0 or tokens <= 0:
        return 0.0
    routed = tokens * width
    return e * (1.0 - (1.0 - k / e) ** routed) / width


def weight_bytes_per_rank(model: ModelNumbers, width: int, tp: int) -> int:
    """Bytes of weights one rank holds: its TP slice of the dense part and its share of
    the experts (the group's `width` ranks split them, remainder to the first ranks)."""
    experts = -(-model.num_experts // width) if model.num_experts else 0
    return model.dense_bytes // tp + model.moe_layers * experts * model.expert_bytes


@dataclass(frozen=True, slots=True)
class Grid:
    """Values measured on the grid `xs` × `ys` (`values[i][j]` at `xs[i]`, `ys[j]`);
    read between points piecewise linearly, beyond the last point along the line of the
    last two (a cost grows with tokens), never below zero. A 1-D table has `ys = (0,)`."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]
    values: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        require(len(self.xs) >= 1 and list(self.xs) == sorted(set(self.xs)), "Grid", "xs",
                f"must be strictly increasing and non-empty, got {self.xs}")
        require(len(self.ys) >= 1 and list(self.ys) == sorted(set(self.ys)), "Grid", "ys",
                f"must be strictly increasing and non-empty, got {self.ys}")
        require(len(self.values) == len(self.xs)
                and all(len(row) == len(self.ys) for row in self.values), "Grid", "values",
                f"must be {len(self.xs)} rows of {len(self.ys)}")
        require(all(is_real(v) and v >= 0 for row in self.values for v in row), "Grid",
                "values", "must be finite numbers >= 0")

    def at(self, x: float, y: float = 0.0) -> float:
        i0, i1, tx = _bracket(self.xs, x)
        j0, j1, ty = _bracket(self.ys, y)
        v = self.values
        low = v[i0][j0] + (v[i0][j1] - v[i0][j0]) * ty
        high = v[i1][j0] + (v[i1][j1] - v[i1][j0]) * ty
        return max(0.0, low + (high - low) * tx)

    def to_dict(self) -> dict:
        return {"xs": list(self.xs), "ys": list(self.ys), "values": [list(r) for r in self.values]}

    @classmethod
    def from_dict(cls, d: dict) -> "Grid":
        return cls(tuple(float(x) for x in d["xs"]), tuple(float(y) for y in d["ys"]),
                   tuple(tuple(float(v) for v in row) for row in d["values"]))


def _bracket(points: Sequence[float], p: float) -> tuple[int, int, float]:
    """Indices of the two points around `p` (the last two beyond the ends) and `p`'s
    position between them (outside [0, 1] when extrapolating; 0 on a single point)."""
    if len(points) == 1:
        return 0, 0, 0.0
    i = min(max(bisect_right(points, p) - 1, 0), len(points) - 2)
    if p < points[0]:
        return 0, 1, 0.0  # below the grid: the first value (costs do not go negative)
    return i, i + 1, (p - points[i]) / (points[i + 1] - points[i])


@dataclass(frozen=True, slots=True)
class CostTables:
    """Microseconds of one decode step's parts, measured on this machine:
    `exchange` (width, tokens per rank) → dispatch + combine; `experts` (distinct experts
    a rank computes per layer, rows it computes = tokens × k) → expert compute;
    `attention` (tokens per rank, mean context) → attention and the dense layers;
    `overhead` (width) → the rest of a step (plan, agreement, sampling, launch).
    `source` says where they were measured."""

    exchange: Grid
    experts: Grid
    attention: Grid
    overhead: Grid
    source: str = ""

    def step_us(self, model: ModelNumbers, width: int, tokens: float, context: float) -> float:
        """Predicted decode step of a rank of a `width`-rank group (see the module doc)."""
        if tokens <= 0:
            return self.overhead.at(width)
        active = active_experts(model, width, tokens)
        t = (self.overhead.at(width) + self.attention.at(tokens, context)
             + self.experts.at(active, tokens * model.experts_per_token))
        return t + (self.exchange.at(width, tokens) if width > 1 else 0.0)

    def to_json(self) -> str:
        return json.dumps({"source": self.source, **{
            name: getattr(self, name).to_dict()
            for name in ("exchange", "experts", "attention", "overhead")}}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "CostTables":
        d: dict[str, Any] = json.loads(text)
        missing = {"exchange", "experts", "attention", "overhead"} - set(d)
        if missing:
            raise ValueError(f"cost tables lack {sorted(missing)}")
        return cls(*(Grid.from_dict(d[n]) for n in ("exchange", "experts", "attention",
                                                     "overhead")), source=str(d.get("source", "")))


def kv_tokens_per_rank(model: ModelNumbers, memory_bytes: int, width: int, tp: int) -> int:
    """Tokens of KV one rank has room for after its weights (0 when they do not fit)."""
    room = memory_bytes - weight_bytes_per_rank(model, width, tp)
    per_token = max(1, math.ceil(model.kv_bytes_per_token / tp))
    return max(0, room // per_token)
