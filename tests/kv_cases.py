"""The KV transport tests' cases: layouts of both sides, a request's KV and its pages in
each side's pools, and its plan (test_kv_transport and its kv_actors,
test_kv_transport_inproc, test_kv_slab_copy)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from phalanx.kv_transfer.planning.layout import KVLayout
from phalanx.kv_transfer.planning.planner import plan_request

LAYERS = 2


class Case(NamedTuple):
    src_tp: int
    dst_tp: int
    kv_heads: int
    src_page: int
    dst_page: int
    tokens: int = 45
    head_dim: int = 8
    runs: bool = False  # the request's pages consecutive on both sides (else shuffled)


CASES = {
    "tp2_to_tp1": Case(2, 1, 4, 16, 8),
    "tp1_to_tp2": Case(1, 2, 4, 8, 16),
    "tp4_kv2_to_tp1": Case(4, 1, 2, 4, 16),
    "tp1_to_tp1": Case(1, 1, 4, 16, 16),
    "big": Case(1, 1, 4, 16, 16, tokens=4096, head_dim=256),  # 32 MiB per layer
    # consecutive pages, 295 KiB of whole pages per (layer, kind) and rank pair: spans of
    # the receiver's pools (>= the sender's in-place threshold, config.KV_IN_PLACE_MIN_BYTES)
    # are received in place
    "tp1_to_tp1_runs": Case(1, 1, 4, 16, 16, tokens=603, head_dim=64, runs=True),
    "tp1_to_tp2_runs": Case(1, 2, 4, 16, 16, tokens=603, head_dim=64, runs=True),
    "tp2_to_tp1_runs": Case(2, 1, 4, 16, 16, tokens=603, head_dim=64, runs=True),
}
# per case, whether any message is received in place (the receiver's pools hold every
# head of the copies' whole pages consecutively only when it holds no more heads than
# each sender: tp2 -> tp1 interleaves two senders' heads in every page)
IN_PLACE = {"tp1_to_tp1_runs": True, "tp1_to_tp2_runs": True, "tp2_to_tp1_runs": False}


def case_layouts(case: str) -> tuple[KVLayout, KVLayout]:
    c = CASES[case]
    return (KVLayout(c.src_tp, c.kv_heads, c.src_page, c.head_dim, LAYERS, 4),
            KVLayout(c.dst_tp, c.kv_heads, c.dst_page, c.head_dim, LAYERS, 4))


def case_pages(layout: KVLayout, tokens: int, seed: int, runs: bool = False
           ) -> tuple[int, list[int]]:
    """(pool size, the request's page ids: a shuffled subset of the pool, or consecutive
    pages from seed % 3 on)."""
    need = layout.pages_for(tokens)
    num_pages = need + 3
    if runs:
        return num_pages, list(range(seed % 3, seed % 3 + need))
    ids = np.random.default_rng(seed).permutation(num_pages)[:need]
    return num_pages, [int(p) for p in ids]


def case_kv(case: str) -> torch.Tensor:
    """The request's KV by global head and token: [layer, kind, head, token, head_dim]."""
    c = CASES[case]
    g = torch.Generator().manual_seed(7)
    return torch.randn(LAYERS, 2, c.kv_heads, c.tokens, c.head_dim, generator=g)


def side_pools(case: str, side: str, rank: int, fill: str) -> list[tuple[torch.Tensor, ...]]:
    """`side`'s pools of `rank` with the request's tokens in place; other slots are
    noise ('noise') or zero ('zero')."""
    layout, tokens = case_layouts(case)[0 if side == "src" else 1], CASES[case].tokens
    num_pages, ids = case_pages(layout, tokens, 11 if side == "src" else 12, CASES[case].runs)
    heads = list(layout.heads_of(rank))
    kv = case_kv(case)
    g = torch.Generator().manual_seed(100 + rank)
    t = torch.arange(tokens)
    page = torch.tensor(ids)[t // layout.page_size]
    off = t % layout.page_size
    shape = (num_pages, len(heads), layout.page_size, layout.head_dim)
    pools = []
    for layer in range(LAYERS):
        pair = []
        for kind in range(2):
            pool = torch.randn(shape, generator=g) if fill == "noise" else torch.zeros(shape)
            pool[page, :, off, :] = kv[layer, kind, heads].permute(1, 0, 2)
            pair.append(pool)
        pools.append(tuple(pair))
    return pools


def case_plan(case: str):
    (src, dst), c = case_layouts(case), CASES[case]
    return plan_request(src, dst, c.tokens, case_pages(src, c.tokens, 11, c.runs)[1],
                        case_pages(dst, c.tokens, 12, c.runs)[1])


def zero_pools(case: str, rank: int) -> list[tuple[torch.Tensor, ...]]:
    layout = case_layouts(case)[1]
    shape = (case_pages(layout, CASES[case].tokens, 12)[0], len(layout.heads_of(rank)),
             layout.page_size, layout.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(LAYERS)]


def case_batches(case: str) -> dict[tuple[int, int], list]:
    """The request's copies per rank pair as `copy_table.plan_batches` builds them."""
    from phalanx.kv_transfer.planning.copy_table import plan_batches
    (src, dst), c = case_layouts(case), CASES[case]
    return plan_batches(src, dst, range(c.tokens), case_pages(src, c.tokens, 11, c.runs)[1],
                        case_pages(dst, c.tokens, 12, c.runs)[1])
