"""`freeze_start_up_heap`: the objects alive at start-up leave the collector's reach
(a later full collection no longer walks them), and it says how long a full collection
took before and after."""

from __future__ import annotations

import gc

from phalanx.server.gc_freeze import freeze_start_up_heap


def test_freeze_takes_the_live_objects_out_of_full_collections():
    keep = [{"n": i} for i in range(50_000)]  # live, tracked objects
    try:
        heap = freeze_start_up_heap()
        # a frozen object freed since (by another thread of this process) leaves the count
        assert heap.objects >= gc.get_freeze_count() >= len(keep)
        assert heap.full_collection_ms > 0 and heap.after_ms >= 0
        # get_objects lists the collected generations only, not the permanent one
        assert id(keep[0]) not in {id(o) for o in gc.get_objects()}
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
