"""Where a rank sits (`RankSpec`), how its loop failed (`RankFailure`), and its model
shard (`shard_for`): plain data shared by `Rank`, the supervisors and the benches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...config import EngineConfig
from ...comm.dispatch import make_expert_placement
from ...models.shard import ModelShard

__all__ = ["RankFailure", "RankSpec", "shard_for", "tensor_channel_bytes"]

# The most bytes per rank a shared-memory tensor channel carries in one collective; a
# larger tensor goes over gloo (each rank's file holds 4x this: two rounds, 8-byte words
# carrying 4 bytes each).
TENSOR_CHANNEL_MAX = 8 << 20


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


def tensor_channel_bytes(spec: RankSpec) -> tuple[int, int]:
    """(TP, world) capacities of a CPU rank's shared-memory tensor channels: the largest
    step's hidden states or sampled rows' logits slice (TP sums and gathers), and its
    dispatched rows, one per (token, expert) pair with 16 bytes of routing metadata
    (DP×EP all-to-alls); (0, 0) on GPU, whose tensors go over NCCL."""
    c = spec.config
    if c.device != "cpu":
        return 0, 0
    m, sch = c.model, c.scheduler
    item = 2 if c.torch_dtype_name in ("bfloat16", "float16") else 4
    tokens = sch.max_num_batched_tokens
    tp = tokens * m.hidden_size * item
    tp = max(tp, sch.max_num_seqs * -(-m.vocab_size // spec.tp) * 4) if spec.tp > 1 else 0
    world = tokens * max(1, m.num_experts_per_tok) * (m.hidden_size * item + 16)
    world = world if spec.dp > 1 and m.num_experts else 0
    return min(tp, TENSOR_CHANNEL_MAX), min(world, TENSOR_CHANNEL_MAX)
