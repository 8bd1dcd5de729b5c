"""The EP-width cost tables measured on the layout's own ranks at start (issue 28): the
`cost_model` policy without a cost-table file calibrates every candidate layout through
the reconciler's reshapes, ends on the layout it started with, and serves the same tokens
as the single-rank engine afterwards (colocated DP=2, and the disaggregated decode side)."""

from __future__ import annotations

import pytest

from phalanx import LLM, SamplingParams

pytestmark = pytest.mark.slow

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=256, page_size=4, num_pages=600)
PROMPTS = [[5, 9, 13, 17, 21, 25], [40, 41, 42, 43], [7, 7, 7]]


@pytest.mark.parametrize("layout", [dict(dp=2), dict(prefill_tp=1, decode_dp=2)],
                         ids=["colocated", "disaggregated"])
def test_cost_model_measures_its_tables_at_start(tiny_model, layout):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = LLM(tiny_model, **ENGINE).generate(prompt_token_ids=PROMPTS,
                                                   sampling_params=params)
    llm = LLM(tiny_model, **layout, ep_policy="cost_model",
              ep_options={"min_interval_s": 1e6}, **ENGINE)
    try:
        client = llm.cluster
        tables = client.ep.tables
        assert tables is not None and tables.source.startswith("measured at start"), tables
        assert tables.exchange.xs == (1.0, 2.0), "every candidate width measured"
        assert tables.exchange.at(1.0, 8.0) == 0.0 and tables.attention.at(1.0, 32.0) > 0
        assert tables.experts.at(2.0, 32.0) > 0, "the expert grid is a measurement"
        assert str(client.side.layout) == "1x2", "it serves the layout it started with"
        assert client.reshapes >= 2, "groups re-formed to 2x1 and back"
        out = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    finally:
        llm.close()
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in reference]
