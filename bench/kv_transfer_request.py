"""The request of `bench/kv_transfer.py`: its KV shape (Qwen3-30B-A3B-like), the prefill
and decode layouts, its pages in both pools (shuffled, or consecutive runs as a fresh
pool hands them out), its copy tables by rank pair (planned once per process and
cached; the receiver's checks use them) and each sender rank's share of them as template
batches (what it sends)."""

from __future__ import annotations

import time
from functools import lru_cache

import numpy as np

LAYERS, KV_HEADS, HEAD_DIM, PAGE = 48, 4, 128, 16


def kv_layouts(p: int, d: int):
    from phalanx.kv_transfer.planning.layout import KVLayout
    return (KVLayout(p, KV_HEADS, PAGE, HEAD_DIM, LAYERS, 2),
            KVLayout(d, KV_HEADS, PAGE, HEAD_DIM, LAYERS, 2))


PAGE_ORDERS = ("shuffled", "runs")


def request_pages(num_pages: int, tokens: int, seed: int, order: str) -> list[int]:
    """shuffled: a random subset of the pool; runs: consecutive pages from `seed` on."""
    need = -(-tokens // PAGE)
    if order == "runs":
        return list(range(seed, seed + need))
    return [int(x) for x in np.random.default_rng(seed).permutation(num_pages)[:need]]


@lru_cache(maxsize=None)
def request_plan(p: int, tokens: int, num_pages: int, order: str):
    """The request's copy tables by (src, dst) rank pair (the same pages in every
    process; built as the prefill ranks build them) and the time it took."""
    from phalanx.kv_transfer.planning.copy_table import plan_tables
    src, dst = kv_layouts(p, 1)
    t = time.perf_counter()
    tables = plan_tables(src, dst, range(tokens), request_pages(num_pages, tokens, 1, order),
                         request_pages(num_pages, tokens, 2, order))
    return tables, time.perf_counter() - t


def sender_shares(p: int, tokens: int, num_pages: int, order: str) -> list[int]:
    """Bytes each sender rank moves to the receiver."""
    from phalanx.kv_transfer.planning.copy_table import table_nbytes
    tables = request_plan(p, tokens, num_pages, order)[0]
    return [table_nbytes(tables[(r, 0)], HEAD_DIM, 2) for r in range(p)]


def rank_batches(rank: int, p: int, tokens: int, num_pages: int, order: str):
    """This rank's copies of the request as the sender takes them (`plan_batches`' template
    batches): per layer, and whole; the planning time; bytes."""
    from phalanx.kv_transfer.planning.copy_table import layer_batches, plan_batches
    src, dst = kv_layouts(p, 1)
    t = time.perf_counter()
    whole = plan_batches(src, dst, range(tokens), request_pages(num_pages, tokens, 1, order),
                         request_pages(num_pages, tokens, 2, order))[(rank, 0)]
    plan_s = time.perf_counter() - t
    by_layer = layer_batches(whole)
    return ([by_layer[layer] for layer in range(LAYERS)], whole, plan_s,
            sender_shares(p, tokens, num_pages, order)[rank])
