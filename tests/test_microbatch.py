"""Two-batch overlap in DP×EP steps (issue 29): the same tokens with micro-batching on or
off, greedy and seeded-sampled, over the exact and the padded exchange, prefill and
decode mixed; the split steps are counted in the ranks' stats."""

from __future__ import annotations

import pytest

from indexed_outputs import generate_indexed
from phalanx import LLM, SamplingParams

pytestmark = pytest.mark.slow

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=48, page_size=4, num_pages=400)
PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(5 + 9 * i)] for i in range(7)]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=10 + i, ignore_eos=True) if i % 2 == 0
          else SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=10 + i,
                              ignore_eos=True) for i in range(len(PROMPTS))]


def _tokens(llm) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_model) -> list[list[int]]:
    return _tokens(LLM(tiny_model, **ENGINE))


@pytest.mark.parametrize("ep_exchange", ["exact", "padded", "peer"])
def test_two_micro_batches_give_the_same_tokens(tiny_model, reference, ep_exchange):
    """peer: decode steps fit the peer channels, each micro-batch through its own lane's
    pair (engine/lanes.py); prefill chunks do not, and go over the exchange thread."""
    llm = LLM(tiny_model, dp=2, microbatch="on", ep_exchange=ep_exchange, **ENGINE)
    try:
        got = _tokens(llm)
        stats = llm.cluster.leader_stats()["decode"]
    finally:
        llm.close()
    assert got == reference
    assert all(s["microbatch_split_steps"] > 0 for s in stats), stats
    assert all(s["microbatch_split_steps"] <= s["microbatch_steps"] for s in stats)
    if ep_exchange == "peer":
        assert all(min(s["peer_exchanges_by_lane"]) > 0 for s in stats), stats


def test_off_never_splits_and_adaptive_measures_both(tiny_model, reference):
    for name, check in (("off", lambda s: s["microbatch_split_steps"] == 0),
                        ("adaptive", lambda s: 0 < s["microbatch_split_steps"]
                         < s["microbatch_steps"])):
        llm = LLM(tiny_model, dp=2, microbatch=name, microbatch_options={"samples": 1}
                  if name == "adaptive" else None, **ENGINE)
        try:
            got = _tokens(llm)
            stats = llm.cluster.leader_stats()["decode"]
        finally:
            llm.close()
        assert got == reference, name
        assert all(check(s) for s in stats), (name, stats)


@pytest.mark.parametrize("ep_exchange", ["exact", "peer"])
def test_rank_killed_inside_a_micro_batched_all_to_all_recovers(tiny_model, reference,
                                                                ep_exchange):
    """Rank 1 exits inside an MoE dispatch of a split step: the group re-forms under
    epoch 2 and every request resumes with the same tokens, each delivered once (peer:
    the survivor's lane waits end at the deadline)."""
    import ray

    llm = LLM(tiny_model, dp=2, microbatch="on", collective_timeout_s=5.0,
              ep_exchange=ep_exchange, **ENGINE)
    try:
        ray.get(llm.cluster.supervisor.actors[1].arm_fault.remote("moe_dispatch", 40))
        got = generate_indexed(llm, PROMPTS, PARAMS)
        assert llm.cluster.recoveries == 1 and llm.cluster.epoch == 2
    finally:
        llm.close()
    assert got == reference


def test_a_dead_peer_ends_the_survivors_split_step_within_the_deadline(tiny_model):
    """No re-formation (max_recoveries=0): the survivors' exchange threads meet the dead
    rank's missing rows, and their steps end with CollectiveError, not a hang."""
    import time

    import ray

    from phalanx.actors.supervisor import GroupFailure

    deadline = 5.0
    llm = LLM(tiny_model, dp=3, microbatch="on", collective_timeout_s=deadline,
              max_recoveries=0, **ENGINE)
    try:
        ray.get(llm.cluster.supervisor.actors[2].arm_fault.remote("moe_dispatch", 40))
        t0 = time.monotonic()
        with pytest.raises(GroupFailure) as info:
            llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS)
        elapsed = time.monotonic() - t0
    finally:
        llm.close()
    survivors = {d.rank: d.reason for d in info.value.deaths if d.rank != 2}
    assert set(survivors) == {0, 1}, info.value
    assert all("CollectiveError" in r for r in survivors.values()), survivors
    assert elapsed < deadline + 15, f"the caller waited {elapsed:.1f} s"
