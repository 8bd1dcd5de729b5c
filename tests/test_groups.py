"""Multi-rank groups on local Ray with gloo: TP groups, DP×EP groups, and a dead rank.

Greedy tokens of every layout equal transformers'; a rank holds only its share of the
weights; a rank killed while its peers are inside an MoE all-to-all makes every survivor
raise within the deadline and the caller get a `GroupFailure` naming the rank and epoch.
"""

from __future__ import annotations

import time

import pytest
import ray

from phalanx import LLM, SamplingParams
from phalanx.actors.cluster import Placement
from phalanx.actors.rank_actor import RankActor
from phalanx.actors.supervisor import GroupFailure, GroupSupervisor
from phalanx.llm import engine_config
from phalanx.actors.rank.spec import RankSpec, shard_for
from phalanx.models.loader import read_model_config
from phalanx.models.qwen3_moe import CausalLM

from indexed_outputs import assert_same_reports, generate_reported, sampled_cases
from test_hf_oracle import hf_greedy, make_prompts

MAX_NEW = 10


@pytest.fixture(scope="module", autouse=True)
def _ray(local_ray):
    """Every test of this module runs on the module's local Ray (conftest)."""


@pytest.fixture(scope="module")
def oracle(tiny_model):
    prompts = make_prompts(2048, seed=5)
    return prompts, hf_greedy(tiny_model, prompts, MAX_NEW)


@pytest.fixture(scope="module")
def sampled(tiny_model, oracle):
    """Requests with every sampling field and the single engine's answers to them."""
    prompts, params = sampled_cases(oracle[0][5:], 2 * MAX_NEW)
    llm = LLM(tiny_model, max_num_seqs=8, num_pages=200)
    return prompts, params, generate_reported(llm, prompts, params)


def _uneven(dp: int, n: int) -> list[Placement]:
    """Most requests on DP rank 0; the others get one short request each, then idle."""
    return [Placement(i + 1 if i < dp - 1 else 0) for i in range(n)]


def _generate_placed(llm: LLM, prompts, params: SamplingParams, placements) -> list[list[int]]:
    """Each prompt's tokens, submitted to the cluster with its placement."""
    rids = [f"placed-{i}" for i in range(len(prompts))]
    for rid, prompt, placement in zip(rids, prompts, placements):
        llm.cluster.submit(rid, list(prompt), params, placement)
    got: dict[str, list[int]] = {rid: [] for rid in rids}
    pending = set(rids)
    while pending:
        for out in llm._poll():
            got[out.request_id].extend(out.new_token_ids)
            if out.finished:
                pending.discard(out.request_id)
    return [got[rid] for rid in rids]


@pytest.mark.parametrize("tp, dp, exchange", [
    (2, 1, "exact"), (4, 1, "exact"), (1, 2, "exact"), (1, 4, "exact"), (2, 2, "exact"),
    (1, 2, "padded"), (2, 2, "padded"), (1, 2, "peer"), (2, 2, "peer")],
    ids=["tp2", "tp4", "dp2", "dp4", "dp2xtp2", "dp2-padded", "dp2xtp2-padded", "dp2-peer",
         "dp2xtp2-peer"])
def test_layouts_match_transformers(tiny_model, oracle, tp, dp, exchange):
    """Every layout's greedy tokens equal transformers'; DP×EP groups with every MoE
    exchange (uneven splits, padded to the step's agreed token count, and the padded
    rows through shared memory with the waits in Triton kernels: decode steps of up to
    max_num_seqs tokens per rank take it, longer prefill steps the padded one)."""
    prompts, expected = oracle
    llm = LLM(tiny_model, tp=tp, dp=dp, max_num_seqs=8, max_num_batched_tokens=96, page_size=4,
              num_pages=120, collective_timeout_s=30, ep_exchange=exchange)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        if dp > 1:
            # the short requests placed on ranks 1.. finish early: those ranks run dummy steps
            order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
            got = _generate_placed(llm, [prompts[i] for i in order], params,
                                   _uneven(dp, len(order)))
        else:
            order = list(range(len(prompts)))
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
            got = [o.outputs[0].token_ids for o in outs]
        for i, tokens in zip(order, got):
            assert tokens == expected[i], f"prompt {i} ({len(prompts[i])} tokens)"
        stats = llm.cluster.stats()
        assert all(not s["failed"] for s in stats)
        if exchange == "peer":  # decode steps went through the peers' memory
            assert all(s["peer_exchanges"] > 0 for s in stats), stats
        if dp > 1:
            leaders = stats[::tp]
            # lockstep: every rank ran the same number of real-or-dummy MoE steps, but the
            # idle ranks' own forward passes were fewer
            assert leaders[0]["steps"] > min(s["steps"] for s in leaders[1:])
        if tp > 1 and dp == 1:
            assert sum(s.get("num_preemptions", 0) for s in stats) > 0
        if (tp, dp, exchange) == (2, 2, "exact"):
            check_ranks_load_only_their_share(llm, tiny_model)
    finally:
        llm.close()


def check_ranks_load_only_their_share(llm: LLM, tiny_model: str) -> None:
    """Each rank of a TP2 x DP2 group holds exactly its shard's parameters: experts over
    4 ranks, heads and vocab over 2 (run on the dp2xtp2 layout above)."""
    info = sorted(llm.cluster.supervisor.start_info, key=lambda i: i["rank"])
    assert [i["rank"] for i in info] == [0, 1, 2, 3], info
    cfg = read_model_config(tiny_model)
    full = sum(p.numel() for p in CausalLM(cfg).parameters())
    for i in info:
        spec = RankSpec(i["rank"], 2, 2, 1, "", 1.0, llm.config)
        shard, _ = shard_for(spec, cfg.num_experts)
        expected = sum(p.numel() for p in CausalLM(cfg, shard, _ShapeOnlyComm(shard)).parameters())
        assert i["num_params"] == expected
        assert i["num_params"] < full / 2.5, "experts over 4 ranks, heads and vocab over 2"


class _ShapeOnlyComm:
    def __init__(self, shard) -> None:
        self.tp_rank, self.tp_size = shard.tp_rank, shard.tp_size

    def all_reduce_tp(self, t):
        return t

    def all_gather_tp(self, t, dim):
        return t


@pytest.mark.parametrize("exchange", ["exact", "peer"])
def test_rank_killed_mid_all_to_all_fails_fast(tiny_model, exchange):
    """peer: the survivors spin in the wait kernel for the dead rank's rows until the
    watchdog raises the abort word at the deadline; the step's settle then fails."""
    deadline = 5.0
    # max_recoveries=0: the fail-fast path, no re-formed group
    llm = LLM(tiny_model, dp=3, page_size=8, num_pages=256, collective_timeout_s=deadline,
              max_recoveries=0, ep_exchange=exchange)
    try:
        victim = llm.cluster.supervisor.actors[2]
        # exit at the 40th MoE dispatch (real or dummy): peers are inside the all-to-all
        ray.get(victim.arm_fault.remote("moe_dispatch", 40))
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        t0 = time.monotonic()
        with pytest.raises(GroupFailure) as info:
            llm.generate(prompt_token_ids=[[5 + i] * 20 for i in range(6)], sampling_params=params)
        elapsed = time.monotonic() - t0
        failure = info.value
        assert failure.epoch == 1
        assert failure.dead_ranks == [2]
        survivors = {d.rank: d.reason for d in failure.deaths if d.rank != 2}
        assert set(survivors) == {0, 1}, failure
        assert all("CollectiveError" in r and "epoch 1" in r for r in survivors.values()), survivors
        if exchange == "peer":
            assert all("peer_exchange" in r for r in survivors.values()), survivors
        print(f"caller got GroupFailure after {elapsed:.2f}s: {failure}")
        assert elapsed < deadline + 15, f"caller waited {elapsed:.1f}s"
    finally:
        llm.close()


def check_one_recovery(llm: LLM, point: str, count: int, prompts, expected, sampled=None) -> None:
    """Rank 1 exits at the `count`-th pass through `point`; greedy generation still gives
    `expected`, each token once, after exactly one re-formation (epoch 2). `sampled`
    (prompts, params, the single engine's reports): run beside the greedy requests, their
    tokens, logprobs and prompt logprobs equal the single engine's."""
    ray.get(llm.cluster.supervisor.actors[1].arm_fault.remote(point, count))
    params = SamplingParams(temperature=0.0, max_tokens=len(expected[0]), ignore_eos=True)
    extra_prompts, extra_params, want = sampled or ([], [], [])
    got = generate_reported(llm, list(prompts) + extra_prompts,
                            [params] * len(prompts) + extra_params)
    for i, (tokens, _, _) in enumerate(got[:len(prompts)]):
        assert tokens == expected[i], f"prompt {i}"
    assert_same_reports(got[len(prompts):], want, extra_params)
    assert llm.cluster.recoveries == 1 and llm.cluster.epoch == 2


@pytest.mark.parametrize("tp, dp, point, count", [(1, 2, "moe_dispatch", 25), (2, 1, "step", 6)],
                         ids=["dp2-mid-all-to-all", "tp2-mid-step"])
def test_rank_killed_group_recovers(tiny_model, oracle, sampled, tp, dp, point, count):
    """A rank dies mid-generation: the group is re-formed under epoch 2 and every request
    resumes from prompt + the tokens already delivered, so the caller gets each token
    once and the same tokens as transformers; requests using every sampling field get
    the single engine's tokens and logprobs."""
    prompts, expected = oracle
    llm = LLM(tiny_model, tp=tp, dp=dp, max_num_seqs=8, max_num_batched_tokens=96, page_size=4,
              num_pages=120, collective_timeout_s=5)
    try:
        check_one_recovery(llm, point, count, prompts, expected, sampled)
    finally:
        llm.close()


class _PortSnatcher(RankActor):
    """A rank that, before it joins, tries to bind its epoch's rendezvous port as another
    socket of the node might (as seen in CI when the port was only picked, not held)."""

    def configure(self, spec) -> None:
        import errno
        import socket
        host, port = spec.init_method.removeprefix("tcp://").rsplit(":", 1)
        with socket.socket() as s:
            try:
                s.bind((host, int(port)))
                self.snatched = "bound"
            except OSError as e:
                self.snatched = errno.errorcode.get(e.errno, str(e))
        super().configure(spec)

    def snatch_result(self) -> str:
        return self.snatched


def test_rendezvous_port_is_held_until_rank_0_joins(tiny_model):
    import sys

    from ray import cloudpickle
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    sup = GroupSupervisor(engine_config(tiny_model), tp=2, dp=1, deadline_s=5.0,
                          actor_cls=ray.remote(_PortSnatcher))
    try:
        sup.form()
        snatched = ray.get([a.snatch_result.remote() for a in sup.actors], timeout=30)
        assert snatched == ["EADDRINUSE", "EADDRINUSE"] and sup.epoch == 1
        assert ray.get(sup.actors[1].ping.remote(), timeout=30) == 1
    finally:
        sup.shutdown()
