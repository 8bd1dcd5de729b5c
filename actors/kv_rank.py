"""`KVRank`: the part the prefill and decode roles share, a rank actor whose KV cache
is reachable over the KV transport (ARCHITECTURE §4)."""

from __future__ import annotations

from ..kv_transfer.layout import KVLayout
from ..kv_transfer.transport import TransportThread
from .rank_actor import RankActor

TRANSFER_EPOCH = 1  # transport fencing is per transfer id (gated receivers), not per group


def kv_layout_of(engine, tp: int) -> KVLayout:
    """The KV layout of an engine's cache on a side of `tp` ranks."""
    k = engine.runner.caches[0][0]
    cfg = engine.config.model
    return KVLayout(tp=tp, num_kv_heads=cfg.num_key_value_heads, page_size=k.shape[2],
                    head_dim=k.shape[3], num_layers=len(engine.runner.caches),
                    dtype_bytes=k.element_size())


class KVRank(RankActor):
    """After `start`: `layout` (this side's KV layout) and `_transport` (the thread that
    runs this process's KV senders and receivers)."""

    def __init__(self, spec=None) -> None:
        super().__init__(spec)
        self._transport = None
        self.layout = None

    def start(self) -> dict:
        info = super().start()
        self.layout = kv_layout_of(self.engine, self.spec.tp)
        self._transport = TransportThread(name=f"rank{self.spec.rank}-kv")
        return info
