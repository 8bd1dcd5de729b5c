"""`Rank` (mailbox + lockstep + role) driven directly, without Ray: a one-rank group in
this process."""

from __future__ import annotations

import time

import pytest

from free_ports import free_port

from phalanx import LLM, SamplingParams
from phalanx.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from phalanx.actors.rank.lockstep import Lockstep
from phalanx.actors.rank.rank import Rank
from phalanx.actors.rank.spec import RankSpec
from phalanx.models.loader import read_model_config


@pytest.fixture
def rank(tiny_model):
    cfg = EngineConfig(model_path=tiny_model, model=read_model_config(tiny_model),
                       cache=CacheConfig(page_size=8, num_pages=128),
                       scheduler=SchedulerConfig(max_num_batched_tokens=64),
                       parallel=ParallelConfig(tp=1, dp=1))
    eng = Rank(RankSpec(0, 1, 1, 3, f"tcp://127.0.0.1:{free_port()}", 10.0, cfg))
    info = eng.start()
    assert info["rank"] == 0 and info["epoch"] == 3 and info["num_pages"] == 128
    yield eng
    eng.stop()
    assert eng.wait(10) is None, "a clean stop reports no failure"
    eng.comm.destroy()


def _collect(eng: Rank, rids: set[str], timeout_s: float = 60.0) -> dict[str, list]:
    tokens: dict[str, list[int]] = {r: [] for r in rids}
    done: set[str] = set()
    end = time.monotonic() + timeout_s
    while done != rids and time.monotonic() < end:
        for out in eng.poll(0.1):
            assert out.epoch == 3, "outputs carry the group epoch"
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                done.add(out.request_id)
    assert done == rids
    return tokens


def test_rank_matches_single_rank_engine(rank, tiny_model):
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    prompts = {"a": list(range(1, 40)), "b": [5, 6, 7], "c": list(range(100, 190))}
    for rid, p in prompts.items():
        rank.submit(rid, p, params)
    got = _collect(rank, set(prompts))
    ref = LLM(tiny_model, page_size=8, num_pages=128).generate(
        prompt_token_ids=list(prompts.values()), sampling_params=params)
    assert [got[r] for r in prompts] == [o.outputs[0].token_ids for o in ref]
    assert rank.stats()["steps"] > 0 and not rank.stats()["failed"]


def test_bad_requests_are_refused_in_the_callers_thread(rank):
    params = SamplingParams(temperature=0.0, max_tokens=3)
    with pytest.raises(ValueError, match="prompt"):
        rank.submit("x", [], params)
    rank.submit("dup", [1, 2, 3], params)
    with pytest.raises(ValueError, match="already in use"):
        rank.submit("dup", [4, 5], params)
    _collect(rank, {"dup"})
    rank.submit("dup", [4, 5], params)  # finished ids may be reused
    _collect(rank, {"dup"})
    assert not rank.stats()["failed"]


class _WakeComm:
    """A comm whose wake counter a test moves (as a peer's `wake_peers` would)."""

    def __init__(self) -> None:
        self.count = 0

    def wake_count(self) -> int:
        return self.count


def test_an_idle_rank_wakes_when_a_peer_has_work(tiny_model):
    """An idle rank of a group sleeps until its own inbox gets an item or a peer's wake
    counter moves, not for its whole idle timeout."""
    import threading
    cfg = EngineConfig(model_path=tiny_model, model=read_model_config(tiny_model),
                       parallel=ParallelConfig(tp=2, dp=1))
    lockstep = Lockstep(RankSpec(1, 2, 1, 3, "tcp://127.0.0.1:1", 10.0, cfg), lambda point: None)
    lockstep.comm = _WakeComm()
    timer = threading.Timer(0.2, lambda: setattr(lockstep.comm, "count", 1))
    timer.start()
    t0 = time.monotonic()
    lockstep.idle_wait(threading.Event(), 60.0)
    assert time.monotonic() - t0 < 30.0, "slept through the peer's wake"
    timer.join()
