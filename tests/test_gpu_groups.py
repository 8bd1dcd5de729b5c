"""Multi-GPU groups: Ray rank actors with one GPU each, NCCL for activations, gloo for plans.

Greedy tokens of the TP and DP×EP layouts on two GPUs equal the CPU engine's; a rank
killed while its peer is inside an NCCL all-to-all makes the survivor leave it within the
deadline through our own wait loop (NCCL itself never returns): with recovery off the
caller gets a `GroupFailure`, with it on the group is re-formed and the requests finish
with the CPU tokens.

On a machine with one GPU the same tests run with the ranks sharing it: Ray is told the
node has two GPUs, every GPU stays visible to the ranks and each picks the one Ray
assigned it, wrapped to the GPUs that exist (`RankActor.gpu_index`); the world relays its
CUDA collectives through host memory over gloo (`GroupComm.relay`: NCCL refuses two
ranks on one device), while the peer exchange and UCX still move device memory between
the rank processes. Only the NCCL-specific part (our wait loop leaving a stuck NCCL
collective) needs two GPUs (the GPU machine's `nvidia-h200-x2`).
"""

from __future__ import annotations

import time

import pytest
import ray
import torch

from phalanx import LLM, SamplingParams
from phalanx.actors.supervisor import GroupFailure

from test_groups import check_one_recovery
from test_hf_oracle import make_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SHARED = torch.cuda.device_count() < 2  # the ranks share one GPU

MAX_NEW = 12
KW = dict(max_num_seqs=8, max_num_batched_tokens=96, page_size=4, num_pages=200)


@pytest.fixture(scope="module", autouse=True)
def _ray():
    """A local Ray for the module that counts at least two GPUs (one-GPU machines: the
    ranks share it)."""
    ray.init(address="local", num_cpus=16, num_gpus=max(2, torch.cuda.device_count()),
             include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def cpu_tokens(tiny_model):
    prompts = make_prompts(2048, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    llm = LLM(tiny_model, device="cpu", **KW)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return prompts, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("tp, dp, exchange, eager", [
    (2, 1, "exact", False), (1, 2, "exact", False), (1, 2, "peer", False), (1, 2, "peer", True)],
    ids=["tp2", "dp2", "dp2-peer", "dp2-peer-eager"])
def test_two_gpu_layouts_equal_cpu(tiny_model, cpu_tokens, tp, dp, exchange, eager):
    """dp2-peer: the MoE rows of decode steps through NVSHMEM symmetric memory, the
    decode steps replayed as CUDA graphs (GroupGraphs); -eager: launched eagerly."""
    prompts, expected = cpu_tokens
    llm = LLM(tiny_model, tp=tp, dp=dp, device="cuda", dtype="float32",
              collective_timeout_s=30, ep_exchange=exchange, enforce_eager=eager, **KW)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        for i, out in enumerate(outs):
            assert out.outputs[0].token_ids == expected[i], f"prompt {i} ({len(prompts[i])} tokens)"
        stats = llm.cluster.stats()
        assert all(not s["failed"] for s in stats)
        if exchange == "peer":
            assert all(s["peer_exchanges"] > 0 for s in stats), stats
            replays = [s.get("graph_replays", 0) for s in stats]
            assert all(n == 0 for n in replays) if eager else all(n > 0 for n in replays), stats
    finally:
        llm.close()


@pytest.mark.parametrize("exchange, eager", [
    ("exact", True), ("padded", True), ("peer", True), ("peer", False)],
    ids=["exact", "padded", "peer-eager", "peer-graphs"])
def test_two_micro_batches_on_gpu_equal_cpu(tiny_model, cpu_tokens, exchange, eager):
    """Two-batch overlap on GPU (every step split): exact/padded, every step eager: each
    rank's MoE exchanges run on its exchange thread's own CUDA stream, ordered by events
    against the other micro-batch's kernels; peer: the decode steps' micro-batches on two
    lanes (a stream and a pair of channels each), launched eagerly or replayed as the
    split CUDA graphs; the tokens are the CPU engine's."""
    prompts, expected = cpu_tokens
    llm = LLM(tiny_model, dp=2, device="cuda", dtype="float32", collective_timeout_s=30,
              ep_exchange=exchange, enforce_eager=eager, microbatch="on", **KW)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert [o.outputs[0].token_ids for o in outs] == expected
        stats = llm.cluster.leader_stats()["decode"]
        assert all(s["microbatch_split_steps"] > 0 for s in stats), stats
        if exchange == "peer":
            assert all(min(s["peer_exchanges_by_lane"]) > 0 for s in stats), stats
            assert all((s.get("graph_split_replays", 0) > 0) != eager for s in stats), stats
    finally:
        llm.close()


@pytest.mark.parametrize("exchange", ["exact", "peer"])
def test_gpu_rank_killed_mid_all_to_all_fails_fast(tiny_model, exchange):
    """peer: the survivor's wait kernel spins on the dead rank's flags until the
    watchdog raises the abort word at the deadline."""
    deadline = 5.0
    llm = LLM(tiny_model, dp=2, device="cuda", dtype="bfloat16", page_size=8, num_pages=256,
              collective_timeout_s=deadline, max_recoveries=0,  # the fail-fast path
              ep_exchange=exchange)
    try:
        victim = llm.cluster.supervisor.actors[1]
        ray.get(victim.arm_fault.remote("moe_dispatch", 40))
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        t0 = time.monotonic()
        with pytest.raises(GroupFailure) as info:
            llm.generate(prompt_token_ids=[[5 + i] * 20 for i in range(6)], sampling_params=params)
        elapsed = time.monotonic() - t0
        failure = info.value
        assert failure.dead_ranks == [1], failure
        survivor = {d.rank: d.reason for d in failure.deaths if d.rank != 1}
        assert set(survivor) == {0}, failure
        assert "CollectiveError" in survivor[0] and "epoch 1" in survivor[0], survivor
        if exchange == "peer":
            assert "peer_exchange" in survivor[0], survivor
        print(f"caller got GroupFailure after {elapsed:.2f}s: {failure}")
        assert elapsed < deadline + 15, f"caller waited {elapsed:.1f}s"
    finally:
        llm.close()


@pytest.mark.parametrize("exchange", ["exact", "peer"])
def test_gpu_rank_killed_mid_all_to_all_recovers(tiny_model, cpu_tokens, exchange):
    """The same fault with recovery on: the survivor leaves the NCCL all-to-all (peer:
    its graph replay's wait) at the deadline, the group is re-formed on the two GPUs
    under epoch 2, and every request resumes: the CPU engine's tokens, each once."""
    prompts, expected = cpu_tokens
    llm = LLM(tiny_model, dp=2, device="cuda", dtype="float32", collective_timeout_s=5,
              ep_exchange=exchange, **KW)
    try:
        check_one_recovery(llm, "moe_dispatch", 25, prompts, expected)
    finally:
        llm.close()


def test_two_gpu_disaggregated_equals_cpu(tiny_model, cpu_tokens):
    """Prefill on one GPU streams KV over UCX (cuda_ipc) to the decode rank on the other."""
    prompts, expected = cpu_tokens
    llm = LLM(tiny_model, prefill_tp=1, decode_dp=1, device="cuda", dtype="float32",
              collective_timeout_s=30, **KW)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        for i, out in enumerate(outs):
            assert out.outputs[0].token_ids == expected[i], f"prompt {i} ({len(prompts[i])} tokens)"
        stats = llm.cluster.stats()
        assert stats["recoveries"] == 0
        kv = ray.get(llm.cluster.decode.actors[0].kv_stats.remote())
        print(f"decode receiver: {kv}")
        assert kv["messages"] > 0 and kv["rejected"] == 0
        gpus = [info["gpu"] for sup in (llm.cluster.decode, *llm.cluster.prefill)
                for info in sup.start_info]
        assert all(0 <= g < torch.cuda.device_count() for g in gpus), gpus
        assert SHARED or len(set(gpus)) == len(gpus), gpus  # the GPUs Ray assigned
    finally:
        llm.close()
