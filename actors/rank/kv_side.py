"""What the prefill and decode roles share: a rank's KV cache as the KV transport sees it
(ARCHITECTURE §4): its layout, and the thread that runs the process's KV senders and
receivers."""

from __future__ import annotations

from dataclasses import dataclass

from ...kv_transfer.planning.layout import KVLayout
from ...kv_transfer.transport import TransportThread

__all__ = ["KVSide", "TRANSFER_EPOCH", "kv_layout_of"]

TRANSFER_EPOCH = 1  # transport fencing is per transfer id (gated receivers), not per group


def kv_layout_of(engine, tp: int) -> KVLayout:
    """The KV layout of an engine's cache on a side of `tp` ranks."""
    k = engine.runner.caches[0][0]
    cfg = engine.config.model
    return KVLayout(tp=tp, num_kv_heads=cfg.num_key_value_heads, page_size=k.shape[2],
                    head_dim=k.shape[3], num_layers=len(engine.runner.caches),
                    dtype_bytes=k.element_size())


@dataclass(frozen=True, slots=True)
class KVSide:
    """One rank's KV layout and transport thread."""

    layout: KVLayout
    transport: TransportThread

    @classmethod
    def open(cls, engine, tp: int, rank: int) -> "KVSide":
        return cls(kv_layout_of(engine, tp), TransportThread(name=f"rank{rank}-kv"))
