"""The EP-width cost tables fitted from measured steps (policies/ep_fit.py, plain data)."""

from __future__ import annotations

import pytest

from phalanx.policies.ep_cost import Grid, ModelNumbers
from phalanx.policies.ep_fit import fit_cost_tables

MODEL = ModelNumbers(64, 8, 3, 1 << 20, 1 << 24, 4096)
EXPERTS = Grid((0.0, 64.0), (0.0, 4096.0), ((0.0, 0.0), (6400.0, 6400.0)))


def _steps(widths=(1, 2, 4), batches=(1, 16)) -> dict:
    return {(w, b): 10.0 + 0.5 * b + (2.0 * w if w > 1 else 0.0) for w in widths for b in batches}


@pytest.mark.parametrize("widths", [(1, 2, 4), (2, 4)])
def test_fitted_tables_reproduce_the_fitted_steps(widths):
    steps = _steps(widths)
    tables = fit_cost_tables(steps, EXPERTS, MODEL, [16, 1], 100.0, list(reversed(widths)), "t")
    for (w, b), ms in steps.items():
        assert tables.step_us(MODEL, w, b, 100.0) / 1e3 == pytest.approx(ms, rel=1e-6)
    assert tables.exchange.at(widths[0], 16) == 0.0, "the narrowest width has no exchange"
    assert tables.source == "t"


def test_a_missing_measurement_is_named():
    steps = _steps()
    del steps[(2, 16)]
    with pytest.raises(ValueError, match=r"\(2, 16\)"):
        fit_cost_tables(steps, EXPERTS, MODEL, [1, 16], 100.0, [1, 2, 4], "t")
    with pytest.raises(ValueError, match="at least one"):
        fit_cost_tables(steps, EXPERTS, MODEL, [], 100.0, [1, 2, 4], "t")
