"""Which CUDA device a Ray rank actor uses (`rank_actor.device_index`): the GPU Ray
assigned it, found among the GPUs its process sees (every GPU of the node stays
visible, `GroupSupervisor._env_vars`)."""

from __future__ import annotations

from phalanx.actors.rank_actor import device_index
from phalanx.actors.supervisor import GroupSupervisor
from phalanx.llm import engine_config


def test_assigned_gpu_among_the_visible_ones():
    assert device_index([], None, 4) is None
    assert device_index(["2"], None, 4) == 2
    assert device_index([3], "", 4) == 3
    assert device_index(["6"], "4,5,6,7", 4) == 2  # the node lists a subset
    assert device_index(["6"], " 4, 6 ", 2) == 1
    assert device_index(["1"], None, 1) == 0  # a node declaring more GPUs than it has


def test_rank_processes_environment(tiny_model):
    def env(device: str, dp: int, exchange: str) -> dict:
        config = engine_config(tiny_model, dp=dp, device=device, ep_exchange=exchange)
        return GroupSupervisor(config, tp=1, dp=dp, deadline_s=5.0)._env_vars()

    assert env("cuda", 2, "peer") == {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
    assert env("cuda", 1, "exact") == {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
    assert env("cpu", 2, "peer") == {"TRITON_INTERPRET": "1"}
    assert env("cpu", 2, "exact") == {} == env("cpu", 1, "peer")
