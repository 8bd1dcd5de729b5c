"""Keep what start-up built out of Python's full collections.

`phalanx serve` holds a few hundred thousand objects once its backend is built (modules,
the tokenizer, the engine, the router), all of them live for the whole run. A full
(generation 2) collection walks every tracked object: measured on a 2-core VM, 65 ms with
the serve stack imported, a stall of the event loop and of the engine thread (GIL) that a
streaming client sees as one long inter-token gap. Collecting once and then freezing
(`gc.freeze`: the survivors move to a permanent generation no collection visits, as vLLM
does after start-up) leaves later full collections only the objects made while serving.
Objects frozen stay alive until the process ends: call this once, after start-up.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

__all__ = ["FrozenHeap", "freeze_start_up_heap"]


@dataclass(frozen=True, slots=True)
class FrozenHeap:
    objects: int  # objects moved to the permanent generation
    full_collection_ms: float  # a full collection before the freeze
    after_ms: float  # the same once frozen


def _full_collection_ms() -> float:
    t = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - t) * 1e3


def freeze_start_up_heap() -> FrozenHeap:
    """Collect, freeze every survivor, and time a full collection before and after."""
    before = _full_collection_ms()
    gc.freeze()
    return FrozenHeap(gc.get_freeze_count(), before, _full_collection_ms())
