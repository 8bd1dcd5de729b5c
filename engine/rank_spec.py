"""Where a rank sits (`RankSpec`), how its loop failed (`RankFailure`), and its model
shard (`shard_for`): plain data shared by `RankEngine`, the actors and the benches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..config import EngineConfig
from ..kernels.dispatch import make_expert_placement
from ..models.shard import ModelShard

__all__ = ["RankFailure", "RankSpec", "shard_for"]


@dataclass(frozen=True, slots=True)
class RankSpec:
    """Where one rank sits in its group and how the group meets (per epoch)."""

    rank: int
    tp: int
    dp: int
    epoch: int
    init_method: str  # rendezvous of this epoch, e.g. tcp://127.0.0.1:PORT
    deadline_s: float
    config: EngineConfig

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp


class RankFailure(RuntimeError):
    """This rank's loop ended on an error (a dead peer, a deadline, a bug)."""

    def __init__(self, rank: int, epoch: int, message: str) -> None:
        super().__init__(f"rank {rank} (epoch {epoch}): {message}")
        self.rank, self.epoch, self.message = rank, epoch, message

    def __reduce__(self):  # crosses Ray: rebuild from the fields, not from args
        return (RankFailure, (self.rank, self.epoch, self.message))


def shard_for(spec: RankSpec, num_experts: int) -> tuple[ModelShard, Optional[tuple]]:
    """The rank's shard and, for DP×EP groups, the expert placement over all ranks."""
    if num_experts == 0:
        return ModelShard(spec.tp_rank, spec.tp), None
    if spec.dp == 1:  # TP group: experts split over the TP ranks, all-reduce combine
        _, _, experts = make_expert_placement(num_experts, spec.tp)
        return ModelShard(spec.tp_rank, spec.tp, tuple(experts[spec.tp_rank])), None
    placement = make_expert_placement(num_experts, spec.world_size)
    return ModelShard(spec.tp_rank, spec.tp, tuple(placement[2][spec.rank])), placement
