"""Sampling parameters and the per-row, per-position seeded sampler."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from phalanx.engine.sampler import filter_logits, position_seed, sample, sample_row
from phalanx.engine.sampling_params import SamplingParams


def _logits(seed: int, *shape: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# -- SamplingParams ----------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1),
    ("temperature", -1),
    ("temperature", float("nan")),
    ("top_k", -2),
    ("top_k", -100),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.0001),
    ("top_p", float("nan")),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("min_p", float("nan")),
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 2.0),
    ("max_tokens", True),
    ("max_tokens", None),
    ("max_tokens", "8"),
    ("stop_token_ids", (-1,)),
    ("stop_token_ids", [3, -7]),
    ("stop_token_ids", ("a",)),
    ("stop_token_ids", (1.5,)),
    ("seed", 1.5),
    ("seed", "7"),
    ("seed", True),
])
def test_bad_values_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_defaults_and_accepted_edge_values():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.max_tokens) == (1.0, 0, 1.0, 0.0, 16)
    assert p.stop_token_ids == () and p.ignore_eos is False and p.seed is None
    assert not p.greedy
    for kw in (dict(temperature=0.0), dict(temperature=0), dict(top_k=-1), dict(top_k=0),
               dict(top_k=1), dict(top_p=1.0), dict(top_p=1e-9), dict(min_p=0.0),
               dict(min_p=1.0), dict(max_tokens=1), dict(seed=0), dict(seed=-5),
               dict(seed=2**63 - 1), dict(stop_token_ids=[0, 5]), dict(stop_token_ids=None)):
        SamplingParams(**kw)
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()
    assert SamplingParams(stop_token_ids=range(2)).stop_token_ids == (0, 1)


def test_params_are_frozen_and_hashable():
    p = SamplingParams(temperature=0.5, stop_token_ids=[1, 2])
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0  # type: ignore[misc]
    assert hash(p) == hash(SamplingParams(temperature=0.5, stop_token_ids=(1, 2)))
    assert p == SamplingParams(temperature=0.5, stop_token_ids=(1, 2))


def test_with_seed_returns_a_validated_copy():
    p = SamplingParams(temperature=0.7, top_k=5)
    q = p.with_seed(123)
    assert q.seed == 123 and p.seed is None
    assert dataclasses.replace(q, seed=None) == p
    with pytest.raises(ValueError, match="seed"):
        p.with_seed("x")  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [2.5, True])
def test_non_integer_top_k_rejected(value):
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=value, seed=1)


@pytest.mark.parametrize("seed", [2**127, -(2**127) - 1, 2**200])
def test_any_accepted_seed_can_be_sampled(seed):
    try:
        p = SamplingParams(temperature=1.0, seed=seed)
    except ValueError:
        return  # rejecting it up front is fine too
    assert 0 <= sample_row(_logits(0, 16), p, 3) < 16


# -- position_seed -----------------------------------------------------------------------

def test_position_seed():
    a = position_seed(42, 7)
    assert a == position_seed(42, 7)
    assert 0 <= a < 2**63
    seeds = {position_seed(s, pos) for s in (0, 1, -1, 2**62) for pos in range(50)}
    assert len(seeds) == 200
    assert position_seed(1, 0) != position_seed(0, 1)


# -- greedy and filters ------------------------------------------------------------------

def test_greedy_is_argmax():
    logits = _logits(1, 9, 50)
    params = [SamplingParams(temperature=0.0)] * 9
    assert sample(logits, params, list(range(9))) == torch.argmax(logits, -1).tolist()
    for i in range(9):
        assert sample_row(logits[i], params[i], 100 + i) == int(torch.argmax(logits[i]))


def test_greedy_ignores_filters_and_seed():
    logits = _logits(2, 30)
    want = int(torch.argmax(logits))
    p = SamplingParams(temperature=0.0, top_k=3, top_p=0.1, min_p=0.5, seed=9)
    assert sample_row(logits, p, 0) == want
    assert sample(logits[None], [p], [0]) == [want]


def test_greedy_on_bf16_logits():
    logits = _logits(3, 4, 64).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0)] * 4
    assert sample(logits, params, [0] * 4) == torch.argmax(logits, -1).tolist()


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_top_k_one_equals_greedy(temperature):
    logits = _logits(4, 6, 40)
    for row in range(6):
        want = int(torch.argmax(logits[row]))
        for s in range(20):
            p = SamplingParams(temperature=temperature, top_k=1, seed=s)
            assert sample_row(logits[row], p, s * 3) == want


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_tiny_top_p_equals_greedy(temperature):
    logits = _logits(5, 6, 40)
    for row in range(6):
        want = int(torch.argmax(logits[row]))
        for s in range(20):
            p = SamplingParams(temperature=temperature, top_p=1e-6, seed=s)
            assert sample_row(logits[row], p, s) == want


def test_top_k_filter_keeps_exactly_k():
    logits = _logits(6, 100)
    for k in (1, 2, 10, 99):
        x = filter_logits(logits, SamplingParams(top_k=k))
        kept = torch.isfinite(x)
        assert int(kept.sum()) == k
        assert set(torch.nonzero(kept).flatten().tolist()) == set(torch.topk(logits, k).indices.tolist())
    # top_k of 0, -1 or >= vocab keeps everything.
    for k in (0, -1, 100, 1000):
        assert torch.isfinite(filter_logits(logits, SamplingParams(top_k=k))).all()


def test_temperature_scales_logits():
    logits = _logits(7, 20)
    for t in (0.5, 1.0, 4.0):
        x = filter_logits(logits, SamplingParams(temperature=t))
        assert x.dtype == torch.float32 and torch.isfinite(x).all()
        # Up to a constant shift (softmax is shift-invariant), x is logits / T.
        torch.testing.assert_close(torch.softmax(x, -1), torch.softmax(logits / t, -1))
        torch.testing.assert_close(x - x.max(), (logits - logits.max()) / t)
    x16 = filter_logits(logits.to(torch.bfloat16), SamplingParams(temperature=2.0))
    assert x16.dtype == torch.float32


def test_top_p_keeps_smallest_prefix_reaching_mass():
    logits = torch.log(torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15]))
    order = [1, 3, 4, 2, 0]  # by probability
    cum = [0.4, 0.7, 0.85, 0.95, 1.0]
    for top_p in (0.1, 0.39, 0.41, 0.69, 0.71, 0.84, 0.86, 0.94, 0.96, 1.0):
        x = filter_logits(logits, SamplingParams(top_p=top_p))
        n_keep = next(i + 1 for i, c in enumerate(cum) if c >= top_p)
        assert set(torch.nonzero(torch.isfinite(x)).flatten().tolist()) == set(order[:n_keep]), top_p


def test_min_p_filtering():
    probs = torch.tensor([0.5, 0.25, 0.12, 0.08, 0.05])
    logits = torch.log(probs)
    for min_p, keep in ((0.0, 5), (0.09, 5), (0.11, 4), (0.2, 3), (0.3, 2), (0.49, 2), (0.51, 1), (1.0, 1)):
        x = filter_logits(logits, SamplingParams(min_p=min_p))
        kept = torch.nonzero(torch.isfinite(x)).flatten().tolist()
        assert kept == list(range(keep)), (min_p, kept)
    # Sampling never returns a filtered token.
    p = SamplingParams(min_p=0.3)
    draws = {sample_row(logits, p.with_seed(s), 0) for s in range(300)}
    assert draws == {0, 1}


def test_filters_compose_in_order_top_k_top_p_min_p():
    probs = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1])
    logits = torch.log(probs)
    # top_k=4 renormalises to [.333, .278, .222, .167]; top_p=0.6 keeps the first two
    # (.333 + .278 = .611); min_p=0.9 of the max then drops the second.
    x = filter_logits(logits, SamplingParams(top_k=4, top_p=0.6))
    assert torch.isfinite(x).tolist() == [True, True, False, False, False]
    x = filter_logits(logits, SamplingParams(top_k=4, top_p=0.6, min_p=0.9))
    assert torch.isfinite(x).tolist() == [True, False, False, False, False]


def test_sampling_only_returns_kept_tokens():
    logits = _logits(8, 50)
    p = SamplingParams(temperature=1.3, top_k=7, seed=0)
    allowed = set(torch.topk(logits, 7).indices.tolist())
    draws = {sample_row(logits, p, pos) for pos in range(400)}
    assert draws <= allowed
    assert len(draws) >= 5


# -- seeds -------------------------------------------------------------------------------

def test_same_seed_and_position_same_token():
    logits = _logits(9, 64, scale=0.5)
    p = SamplingParams(temperature=1.0, seed=1234)
    for pos in range(20):
        assert sample_row(logits, p, pos) == sample_row(logits.clone(), p, pos)
        assert sample_row(logits, p, pos) == sample_row(logits, SamplingParams(seed=1234), pos)


def test_different_positions_and_seeds_vary():
    logits = torch.zeros(10)  # uniform
    p = SamplingParams(temperature=1.0, seed=77)
    by_pos = [sample_row(logits, p, pos) for pos in range(60)]
    assert len(set(by_pos)) >= 7
    by_seed = [sample_row(logits, p.with_seed(s), 5) for s in range(60)]
    assert len(set(by_seed)) >= 7
    assert by_pos != by_seed


def test_row_alone_equals_row_in_batch():
    vocab = 48
    target = _logits(10, vocab)
    target_params = [
        SamplingParams(temperature=0.8, seed=5),
        SamplingParams(temperature=1.0, top_k=10, seed=6),
        SamplingParams(temperature=1.2, top_p=0.8, seed=7),
        SamplingParams(temperature=0.9, min_p=0.05, seed=8),
        SamplingParams(temperature=0.0),
    ]
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, seed=1),
        SamplingParams(temperature=0.5, top_k=3, seed=2),
        SamplingParams(temperature=1.0, top_p=0.5, seed=3),
        SamplingParams(temperature=1.0, min_p=0.2, seed=4),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.01, seed=99),
        SamplingParams(temperature=0.0, top_k=2),
        SamplingParams(temperature=3.0, seed=-12),
    ]
    other_logits = _logits(11, 8, vocab, scale=4.0)
    for tp in target_params:
        for pos in (0, 7, 1000):
            alone = sample(target[None], [tp], [pos])
            assert alone == [sample_row(target, tp, pos)]
            for where in (0, 4, 8):
                rows = list(other_logits.unbind(0))
                rows.insert(where, target)
                params = others[:where] + [tp] + others[where:]
                positions = list(range(3, 3 + where)) + [pos] + list(range(50, 58 - where))
                got = sample(torch.stack(rows), params, positions)
                assert got[where] == alone[0], (tp, pos, where)


def test_batch_rows_are_independent_of_each_other():
    vocab = 32
    logits = _logits(12, 9, vocab)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(9)]
    positions = list(range(9))
    full = sample(logits, params, positions)
    for i in range(9):
        assert full[i] == sample_row(logits[i], params[i], positions[i])
    # Permuting the batch permutes the outputs.
    perm = [3, 8, 0, 5, 1, 7, 2, 6, 4]
    permuted = sample(logits[perm], [params[i] for i in perm], [positions[i] for i in perm])
    assert permuted == [full[i] for i in perm]


def _chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.6, 0), (2.5, 0), (1.0, 3)])
def test_empirical_distribution_matches_softmax(temperature, top_k):
    logits = torch.tensor([1.0, 0.2, -0.5, 0.9, -1.5, 0.0])
    x = logits / temperature
    if top_k:
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, -1).tolist()
    n = 3000
    counts = [0] * 6
    for s in range(n):  # different seeds, fixed position
        counts[sample_row(logits, SamplingParams(temperature=temperature, top_k=top_k, seed=s), 11)] += 1
    support = sum(p > 0 for p in probs)
    assert all(c == 0 for c, p in zip(counts, probs) if p == 0)
    # 5 degrees of freedom at most: the 1e-4 tail is about 25.7; the draws are fixed, not flaky.
    chi2 = _chi_square(counts, probs)
    assert chi2 < 25.0, (counts, [round(n * p) for p in probs], chi2)
    assert support - 1 <= 5
    # Draws across positions of one seed follow the same law.
    counts = [0] * 6
    p = SamplingParams(temperature=temperature, top_k=top_k, seed=2024)
    for pos in range(n):
        counts[sample_row(logits, p, pos)] += 1
    assert _chi_square(counts, probs) < 25.0


# -- errors ------------------------------------------------------------------------------

def test_unseeded_non_greedy_raises():
    logits = _logits(13, 3, 16)
    with pytest.raises(ValueError, match="seed"):
        sample_row(logits[0], SamplingParams(temperature=1.0), 0)
    with pytest.raises(ValueError, match="seed"):
        sample(logits, [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7),
                        SamplingParams(temperature=0.0)], [0, 1, 2])


def test_sample_shape_mismatch_and_empty():
    logits = _logits(14, 2, 8)
    g = SamplingParams(temperature=0.0)
    with pytest.raises(ValueError):
        sample(logits, [g], [0])
    with pytest.raises(ValueError):
        sample(logits, [g, g], [0])
    assert sample(torch.empty(0, 8), [], []) == []


def test_tiny_temperature_behaves_like_greedy():
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    p = SamplingParams(temperature=1e-40, seed=0)
    assert [sample_row(logits, p, pos) for pos in range(4)] == [1] * 4


def test_top_k_top_p_from_candidates_equals_the_full_sort():
    """The partial top-k path gives the full sort's filter; a row whose top-p prefix or
    k-th tie reaches past the candidates is sorted alone, so every row's result is its
    own whatever shares the batch."""
    from phalanx.engine.sampler import _top_k_top_p_candidates, _top_k_top_p_sorted

    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        b, v = 12, 5000
        x = torch.randn(b, v, generator=g) * (0.5 + trial / 4)
        x[0] = 0.0  # a flat row: top-p 0.5 needs 2500 tokens, past the candidates
        k = torch.tensor([[v if i % 3 == 0 else (1, 5, 50, 900)[i % 4]] for i in range(b)])
        top_p = torch.tensor([[float("inf") if i % 2 else (0.5, 0.9, 0.99)[i % 3]]
                              for i in range(b)])
        fast = _top_k_top_p_candidates(x, k, top_p, 900)
        assert torch.equal(torch.isinf(fast), torch.isinf(_top_k_top_p_sorted(x, k, top_p)))
        for row in (0, 3, 4):  # alone, each row gets what it got in the batch
            alone = _top_k_top_p_candidates(x[row:row + 1], k[row:row + 1], top_p[row:row + 1], 900)
            assert torch.equal(alone[0], fast[row])
