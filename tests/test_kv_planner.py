"""KV resharding planner: layouts, plan shape, and a simulated copy over random layouts."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.kv_transfer.planning.layout import KVLayout
from phalanx.kv_transfer.planning.planner import KINDS, Copy, plan_request, plan_tokens
from phalanx.models.shard import ModelShard


def _layout(tp=1, heads=4, page_size=16, head_dim=8, layers=2, dtype_bytes=2) -> KVLayout:
    return KVLayout(tp, heads, page_size, head_dim, layers, dtype_bytes)


# ---------------------------------------------------------------- fake caches

def _src_caches(src: KVLayout, num_tokens: int, pages, layers) -> list[dict]:
    """Per prefill rank: (layer, kind, local head, page, offset) -> (layer, kind, head, token)."""
    caches = []
    for r in range(src.tp):
        cache = {}
        for local, h in enumerate(src.heads_of(r)):
            for layer in layers:
                for kind in KINDS:
                    for t in range(num_tokens):
                        key = (layer, kind, local, pages[t // src.page_size], t % src.page_size)
                        cache[key] = (layer, kind, h, t)
        caches.append(cache)
    return caches


def _expected_dst(dst: KVLayout, num_tokens: int, pages, layers) -> list[dict]:
    """What every decode rank must end up holding: the same map, with dst heads/pages."""
    return _src_caches(dst, num_tokens, pages, layers)


def _apply(plan, src_caches: list[dict]) -> list[dict]:
    """Apply every Copy into empty decode caches; fails on a slot written twice, a read of
    a slot the prefill rank does not hold, or a run that crosses a page boundary."""
    src, dst = plan.src, plan.dst
    out = [dict() for _ in range(dst.tp)]
    for c in plan:
        assert c.kind in KINDS and c.num_heads > 0 and c.num_tokens > 0
        assert 0 <= c.src_offset and c.src_offset + c.num_tokens <= src.page_size
        assert 0 <= c.dst_offset and c.dst_offset + c.num_tokens <= dst.page_size
        assert c.src_head + c.num_heads <= len(src.heads_of(c.src_rank))
        assert c.dst_head + c.num_heads <= len(dst.heads_of(c.dst_rank))
        for i in range(c.num_heads):
            for j in range(c.num_tokens):
                # KeyError here: read of a head/token the src rank does not hold.
                value = src_caches[c.src_rank][
                    (c.layer, c.kind, c.src_head + i, c.src_page, c.src_offset + j)]
                assert value[2] in src.heads_of(c.src_rank)
                key = (c.layer, c.kind, c.dst_head + i, c.dst_page, c.dst_offset + j)
                assert key not in out[c.dst_rank], f"slot {key} written twice"
                out[c.dst_rank][key] = value
    return out


def _written_slots(plan) -> set:
    return {(c.dst_rank, c.layer, c.kind, c.dst_head + i, c.dst_page, c.dst_offset + j,
             c.src_rank, c.src_head + i, c.src_page, c.src_offset + j)
            for c in plan for i in range(c.num_heads) for j in range(c.num_tokens)}


# ---------------------------------------------------------------- layouts

def test_layout_even_split():
    lay = _layout(tp=2, heads=4)
    assert lay.heads_of(0) == range(0, 2) and lay.heads_of(1) == range(2, 4)
    assert lay.holders(3) == [1] and lay.replicas == 1
    assert lay.local_head_index(1, 3) == 1


def test_layout_replicated_heads():
    lay = _layout(tp=4, heads=2)
    assert [lay.heads_of(r) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    assert lay.holders(0) == [0, 1] and lay.holders(1) == [2, 3]
    assert lay.replicas == 2
    assert lay.local_head_index(3, 1) == 0
    with pytest.raises(ValueError, match="does not hold"):
        lay.local_head_index(0, 1)


@pytest.mark.parametrize("tp,heads", [(1, 1), (1, 8), (2, 4), (4, 4), (4, 8), (4, 1), (8, 2)])
def test_layout_matches_model_shard(tp, heads):
    lay = _layout(tp=tp, heads=heads)
    cfg = SimpleNamespace(num_key_value_heads=heads)
    for r in range(tp):
        assert lay.heads_of(r) == ModelShard(r, tp).kv_heads(cfg)
    for h in range(heads):
        assert lay.holders(h) == [r for r in range(tp) if h in lay.heads_of(r)]


@pytest.mark.parametrize("field", ["tp", "num_kv_heads", "page_size", "head_dim",
                                   "num_layers", "dtype_bytes"])
def test_layout_rejects_non_positive(field):
    kw = dict(tp=1, num_kv_heads=2, page_size=4, head_dim=8, num_layers=1, dtype_bytes=2)
    kw[field] = 0
    with pytest.raises(ValueError, match=field):
        KVLayout(**kw)


def test_layout_rejects_indivisible_and_bad_indices():
    with pytest.raises(ValueError, match="one must divide"):
        _layout(tp=3, heads=2)
    lay = _layout(tp=2, heads=4)
    with pytest.raises(ValueError, match="tp_rank"):
        lay.heads_of(2)
    with pytest.raises(ValueError, match="head"):
        lay.holders(4)


def test_page_bytes():
    assert _layout(page_size=16, head_dim=128, dtype_bytes=2).page_bytes(4) == 4 * 16 * 128 * 2


# ---------------------------------------------------------------- plan shape and errors

def test_plan_rejects_mismatched_layouts_and_short_page_lists():
    src = _layout(tp=2, heads=4)
    for field, value in [("head_dim", 16), ("num_layers", 3), ("dtype_bytes", 4),
                         ("num_kv_heads", 8)]:
        kw = dict(tp=1, heads=4, head_dim=8, layers=2, dtype_bytes=2)
        kw[{"num_kv_heads": "heads", "num_layers": "layers"}.get(field, field)] = value
        with pytest.raises(ValueError, match=field):
            plan_request(src, _layout(**kw), 4, [0], [0])
    with pytest.raises(ValueError, match="src_pages"):
        plan_request(src, _layout(tp=1), 17, [0], [0, 1])
    with pytest.raises(ValueError, match="dst_pages"):
        plan_request(src, _layout(tp=1, page_size=4), 17, [0, 1], [0, 1, 2, 3])
    with pytest.raises(ValueError, match="distinct"):
        plan_request(src, _layout(tp=1, page_size=4), 8, [0], [3, 3])
    with pytest.raises(ValueError, match="layers"):
        plan_request(src, _layout(tp=1), 4, [0], [0], layers=range(2, 3))


def test_identity_plan_is_one_copy_per_rank_page():
    lay = _layout(tp=2, heads=4, page_size=8, layers=3)
    plan = plan_request(lay, lay, 20, [5, 6, 7], [0, 1, 2])
    assert plan.num_copies == 3 * 2 * 2 * 3  # layers * kinds * ranks * pages
    assert all(c.src_rank == c.dst_rank and c.num_heads == 2 for c in plan)
    assert plan.total_bytes() == 3 * 2 * 4 * 20 * 8 * 2
    assert plan.for_layer(1).num_copies == 2 * 2 * 3
    assert {c.layer for c in plan.for_layer(1)} == {1}


def test_head_runs_merge_and_token_runs_split_at_both_page_boundaries():
    src = _layout(tp=1, heads=8, page_size=8, layers=1)
    dst = _layout(tp=2, heads=8, page_size=4, layers=1)
    plan = plan_request(src, dst, 10, [9, 3], [0, 1, 2], layers=range(1))
    k0 = [c for c in plan if c.kind == "k" and c.dst_rank == 0]
    assert k0 == [Copy(0, 0, 0, "k", 0, 0, 4, 9, 0, 0, 0, 4),
                  Copy(0, 0, 0, "k", 0, 0, 4, 9, 4, 1, 0, 4),
                  Copy(0, 0, 0, "k", 0, 0, 4, 3, 0, 2, 0, 2)]
    assert {c.src_head for c in plan if c.dst_rank == 1} == {4}
    assert plan.bytes_by_pair() == {(0, 0): 2 * 4 * 10 * 8 * 2, (0, 1): 2 * 4 * 10 * 8 * 2}


def test_reads_spread_over_replicas():
    src, dst = _layout(tp=4, heads=2, layers=1), _layout(tp=2, heads=2, layers=1)
    used: dict[int, set[int]] = {0: set(), 1: set()}
    for dp_rank in range(2):
        plan = plan_request(src, dst, 5, [0], [0], replica_hint=dp_rank)
        again = plan_request(src, dst, 5, [0], [0], replica_hint=dp_rank)
        assert plan == again  # deterministic
        for c in plan:
            head = dst.heads_of(c.dst_rank)[c.dst_head]
            assert c.src_rank in src.holders(head)
            used[head].add(c.src_rank)
    assert used == {0: {0, 1}, 1: {2, 3}}  # both replicas of each head get read
    # Decode TP 4 over the same replicas: the four decode ranks read four distinct ranks.
    plan = plan_request(src, _layout(tp=4, heads=2, layers=1), 5, [0], [0])
    assert {(c.dst_rank, c.src_rank) for c in plan} == {(0, 0), (1, 1), (2, 2), (3, 3)}


def test_chunked_plans_equal_whole_request():
    src, dst = _layout(tp=2, heads=2, page_size=8), _layout(tp=1, heads=2, page_size=16)
    rng = random.Random(0)
    src_pages, dst_pages = rng.sample(range(100), 7), rng.sample(range(100), 4)
    whole = plan_request(src, dst, 53, src_pages, dst_pages)
    chunks = [plan_tokens(src, dst, r, src_pages, dst_pages)
              for r in (range(0, 21), range(21, 53))]
    assert _written_slots(chunks[0]) | _written_slots(chunks[1]) == _written_slots(whole)
    assert not _written_slots(chunks[0]) & _written_slots(chunks[1])
    assert plan_tokens(src, dst, range(7, 7), src_pages, dst_pages).num_copies == 0


# ---------------------------------------------------------------- property: simulated copy

TPS = (1, 2, 4)
PAGE_SIZES = (4, 8, 16)


@st.composite
def _cases(draw):
    tp_src, tp_dst = draw(st.sampled_from(TPS)), draw(st.sampled_from(TPS))
    heads = draw(st.sampled_from([h for h in range(1, 9)
                                  if all(h % t == 0 or t % h == 0 for t in (tp_src, tp_dst))]))
    ps_src, ps_dst = draw(st.sampled_from(PAGE_SIZES)), draw(st.sampled_from(PAGE_SIZES))
    num_layers = draw(st.integers(1, 2))
    src = KVLayout(tp_src, heads, ps_src, 4, num_layers, 2)
    dst = KVLayout(tp_dst, heads, ps_dst, 4, num_layers, 2)
    num_tokens = draw(st.integers(1, 500))
    dp = draw(st.integers(1, 2))
    # Distinct, shuffled page ids; a spare page or two past what the request needs.
    src_pages = draw(st.permutations(range(src.pages_for(num_tokens) + 2)))
    dst_pages = [draw(st.permutations(range(dst.pages_for(num_tokens) + 1))) for _ in range(dp)]
    return src, dst, num_tokens, src_pages, dst_pages


@settings(max_examples=200, deadline=None)
@given(_cases())
def test_simulated_copy_writes_every_needed_slot_once(case):
    src, dst, num_tokens, src_pages, dst_pages_per_dp = case
    layers = range(src.num_layers)
    src_caches = _src_caches(src, num_tokens, src_pages, layers)
    # dp only changes which decode instance receives the request: plan per DP rank.
    for dp_rank, dst_pages in enumerate(dst_pages_per_dp):
        plan = plan_request(src, dst, num_tokens, src_pages, dst_pages, replica_hint=dp_rank)
        got = _apply(plan, src_caches)
        assert got == _expected_dst(dst, num_tokens, dst_pages, layers)
        # Plan is minimal: one copy per (pair, layer, kind, head run, token run).
        keys = [(c.src_rank, c.dst_rank, c.layer, c.kind, c.dst_head, c.dst_page, c.dst_offset)
                for c in plan]
        assert len(keys) == len(set(keys))
        assert sum(plan.bytes_by_pair().values()) == (
            dst.tp * len(dst.heads_of(0)) * num_tokens * 2 * len(layers) * 4 * 2)


@settings(max_examples=100, deadline=None)
@given(_cases(), st.integers(0, 3))
def test_copy_tables_equal_the_copies(case, chunk_start):
    """`plan_tables` (numpy, what the engine sends) encodes exactly `plan_tokens`' copies,
    pair by pair and in the same layer-major order."""
    import numpy as np

    from phalanx.kv_transfer.planning.copy_table import layer_slices, plan_tables
    from phalanx.kv_transfer.planning.messages import encode_copies

    src, dst, num_tokens, src_pages, dst_pages_per_dp = case
    tokens = range(min(chunk_start * 37, num_tokens - 1), num_tokens)
    plan = plan_tokens(src, dst, tokens, src_pages, dst_pages_per_dp[0], replica_hint=1)
    tables = plan_tables(src, dst, tokens, src_pages, dst_pages_per_dp[0], replica_hint=1)
    pairs = {(c.src_rank, c.dst_rank) for c in plan}
    assert set(tables) == pairs
    for pair, table in tables.items():
        expected = encode_copies([c for c in plan if (c.src_rank, c.dst_rank) == pair])
        assert table.dtype == expected.dtype and np.array_equal(table, expected)
        assert sorted(layer_slices(table)) == list(range(src.num_layers))


@settings(max_examples=100, deadline=None)
@given(_cases(), st.integers(0, 3), st.sampled_from([3, 16384]))
def test_copy_batches_replay_to_the_copy_tables(case, chunk_start, max_rows):
    """`plan_batches` (templates + blocks, what the sender sends without a table) replays,
    block by block, to `plan_tables`' rows, layer by layer (`layer_batches`), also when
    templates are cut at `MAX_TEMPLATE_ROWS` (3 here: many pieces)."""
    from unittest import mock

    import numpy as np

    from phalanx.kv_transfer.planning import messages as m
    from phalanx.kv_transfer.planning.copy_table import layer_batches, layer_slices, plan_batches, plan_tables

    src, dst, num_tokens, src_pages, dst_pages_per_dp = case
    tokens = range(min(chunk_start * 37, num_tokens - 1), num_tokens)
    args = (src, dst, tokens, src_pages, dst_pages_per_dp[0])
    tables = plan_tables(*args, replica_hint=1)
    with mock.patch.object(m, "MAX_TEMPLATE_ROWS", max_rows):
        batches = plan_batches(*args, replica_hint=1)
    assert set(batches) == set(tables)

    def replay(parts):
        rows = []
        for template, blocks in parts:
            assert template.dtype == np.dtype("<i4") and len(template) <= max_rows
            assert not template[:, :2].any()  # layer and kind unused
            for layer, kind, r0, r1 in blocks.tolist():
                run = template[r0:r1].copy()
                run[:, m.F_LAYER], run[:, m.F_KIND] = layer, kind
                rows.append(run)
        return sorted(map(tuple, np.concatenate(rows).tolist()))

    for pair, table in tables.items():
        assert replay(batches[pair]) == sorted(map(tuple, table.tolist()))
        by_layer = layer_batches(batches[pair])
        assert sorted(by_layer) == sorted(layer_slices(table))
        for layer, rows in layer_slices(table).items():
            assert replay(by_layer[layer]) == sorted(map(tuple, rows.tolist()))
