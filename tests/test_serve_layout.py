"""`phalanx serve` argument handling without starting anything: the layout rule, the
errors that stop it before loading, the placement lines."""

from __future__ import annotations

import pytest

from phalanx.cli import main
from phalanx.server.launch import (DEFAULT_LAYOUT, is_single_rank, placement_lines,
                                   resolve_layout)


@pytest.mark.parametrize("given, expected, single", [
    ({}, dict(DEFAULT_LAYOUT), False),
    ({"tp": None, "dp": None, "prefill_tp": None}, dict(DEFAULT_LAYOUT), False),
    ({"tp": 1, "dp": 1}, {"tp": 1, "dp": 1}, True),
    ({"dp": 2}, {"dp": 2}, False),
    ({"tp": 1, "decode_dp": 4}, {"tp": 1, "decode_dp": 4}, False),
    ({"prefill_tp": 2, "prefill_instances": 2}, {"prefill_tp": 2, "prefill_instances": 2}, False),
])
def test_layout_rule(given, expected, single):
    layout = resolve_layout(**given)
    assert layout == expected and is_single_rank(layout) == single


def test_mixed_layouts_are_refused():
    with pytest.raises(ValueError, match="either"):
        resolve_layout(dp=2, decode_dp=2)
    with pytest.raises(ValueError, match="unknown"):
        resolve_layout(ep=2)


@pytest.mark.parametrize("argv, message", [
    (["serve", "--dp", "2", "--prefill-tp", "1"], "either --tp/--dp"),
    (["serve", "--tp", "1", "--dp", "1", "--model", "/nonexistent/model"], "not a model folder"),
])
def test_serve_errors_before_loading(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_placement_lines():
    disagg = placement_lines({"decode": ["n1", "n2"], "prefill": [["n3"]]})
    assert disagg == ["decode rank 0 on node n1", "decode rank 1 on node n2",
                      "prefill instance 0 rank 0 on node n3"]
    assert placement_lines({"decode": ["n1"], "prefill": []}) == ["group rank 0 on node n1"]
