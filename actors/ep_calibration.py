"""`calibrate`: the EP-width cost tables measured on a layout's own ranks at start, for the
`cost_model` policy when no `--ep-costs` file is given (issue 28; ARCHITECTURE §4).

On a formed client (colocated or the disaggregated decode side; `client.side` is its
`DPGroups`), before it serves: one DP leader times its expert kernel over the grid of
active experts × rows (`Rank.expert_costs`, its own device and dtype); then the client is
re-shaped through every candidate layout (the EP-width policy's path: planned reshapes of
the reconciler), the layout it started with last so that it ends there, and at each a
decode step is measured with a few batches of dummy greedy requests per DP rank (the DP
leaders' step counters over wall time while every request decodes). The tables are
fitted from those steps (`policies/ep_fit.py`). On CPU with a tiny model this takes
seconds a layout; `bench/ep_width.py` measures longer, over more batches, and writes a
file instead.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Optional

import ray

from ..engine.sampling_params import SamplingParams
from ..log import get_logger
from ..policies.ep_cost import CostTables, Grid
from ..policies.ep_fit import fit_cost_tables
from ..policies.ep_width import candidate_layouts
from .cluster import Placement

log = get_logger(__name__)

__all__ = ["calibrate", "settle", "step_ms"]

PROMPT_LEN = 16
MAX_NEW = 512  # a measured request's longest run (it must outlast the measurement)
KV_SHARE = 0.8  # of the fewest pages a DP rank has, what a batch may take


def settle(client, timeout_s: float = 120.0) -> None:
    """Return once every group of the layout serves (the leaders answer)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        client.maintain()
        try:
            client.leader_stats()
            return
        except TimeoutError:
            time.sleep(0.1)
    raise TimeoutError(f"the layout did not serve within {timeout_s} s")


def step_ms(client, batch: int, seconds: float, prompt_len: int = PROMPT_LEN,
            max_new: int = MAX_NEW, warm_steps: int = 0, min_steps: int = 0,
            window: Optional[list] = None) -> tuple[float, float]:
    """The mean decode step (ms) of the layout's groups with `batch` greedy requests per
    DP rank, measured over `seconds` and at least `min_steps` steps once every request
    decodes and `warm_steps` more steps ran (ended early when one finishes), and the mean
    context they ran at. The requests are aborted after. `window`: gets the DP leaders'
    stats at the start and at the end of the measured time appended."""
    side, vocab = client.side, client.config.model.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    ids = [f"ep-calibration-{batch}-{i}-{time.monotonic_ns()}" for i in range(side.dp * batch)]
    for i, rid in enumerate(ids):
        prompt = [(7 * i + j) % (vocab - 8) for j in range(prompt_len)]
        client.submit(rid, prompt, params, Placement(dp_group=i % side.dp))
    seen: dict[str, int] = {}
    while min((seen.get(r, 0) for r in ids), default=0) < 4:  # every request decoding
        for o in client.poll():
            seen[o.request_id] = seen.get(o.request_id, 0) + len(o.new_token_ids)
    finished = _poll_steps(client, warm_steps)
    first, t0 = client.leader_stats()["decode"], time.monotonic()
    end = t0 + seconds
    while time.monotonic() < end and not finished:
        finished = any(o.finished for o in client.poll())
    if not finished:
        finished = _poll_steps(client, min_steps - (client.leader_stats()["decode"][0]["steps"]
                                                    - first[0]["steps"]))
    last, t1 = client.leader_stats()["decode"], time.monotonic()
    if window is not None:
        window.append((first, last))
    for rid in ids:
        client.abort(rid)
    per_group = side.dp // side.groups
    leaders = range(0, side.dp, per_group)  # one DP leader per group: a group steps together
    steps = [last[g]["steps"] - first[g]["steps"] for g in leaders]
    if min(steps) <= 0:
        raise RuntimeError(f"a group took no step in {t1 - t0:.2f} s at batch {batch}")
    ctx = sum(s["running_tokens"] for s in last) / max(1, sum(s["num_running"] for s in last))
    return (t1 - t0) * 1e3 / (sum(steps) / len(steps)), ctx


def _poll_steps(client, steps: int) -> bool:
    """Poll until DP leader 0 took `steps` more steps (or a request finished: True)."""
    if steps <= 0:
        return False
    goal = client.leader_stats()["decode"][0]["steps"] + steps
    while client.leader_stats()["decode"][0]["steps"] < goal:
        if any(o.finished for o in client.poll()):
            return True
    return False


def _batches(client, wanted: Sequence[int]) -> tuple[list[int], int]:
    """The batches that fit the scheduler and the KV pool, and the new tokens a
    request may run to."""
    config, side = client.config, client.side
    cap = config.scheduler.max_num_seqs
    batches = sorted({min(b, cap) for b in wanted if b >= 1})
    tokens = side.fewest_pages(lambda key: True, 0) * config.cache.page_size * KV_SHARE
    max_new = int(min(MAX_NEW, config.max_model_len - PROMPT_LEN - 1,
                      tokens / batches[-1] - PROMPT_LEN))
    if max_new < 32:
        raise ValueError(f"EP-width calibration: {batches[-1]} requests of {PROMPT_LEN}+32 "
                         f"tokens per DP rank do not fit {tokens:.0f} KV tokens; pass "
                         "measured tables instead (--ep-costs)")
    return batches, max_new


def calibrate(client, batches: Sequence[int] = (1, 8), seconds: float = 0.5,
              reps: int = 5) -> CostTables:
    """The cost tables of `client`'s ranks (see the module doc); the client serves its
    starting layout again when this returns."""
    started, side, pool = time.monotonic(), client.side, client.ep.pool
    batches, max_new = _batches(client, batches)
    start = side.layout
    layouts = candidate_layouts(pool)
    leader = side.supervisors[0].leaders[0]
    experts = Grid(*ray.get(leader.expert_costs.remote(reps), timeout=600))
    steps, contexts = {}, []
    for layout in [lay for lay in layouts if lay != start] + [start]:
        if side.layout != layout:
            client.reshape(layout)
        settle(client)
        for b in batches:
            ms, ctx = step_ms(client, b, seconds, max_new=max_new)
            steps[(layout.width, b)] = ms
            contexts.append(ctx)
            settle(client)
    source = (f"measured at start on {len(layouts)} layouts, batches {batches}, "
              f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
    tables = fit_cost_tables(steps, experts, client.ep.model, batches,
                             sum(contexts) / len(contexts), [lay.width for lay in layouts],
                             source)
    log.warning("ep_calibrated", seconds=round(time.monotonic() - started, 1),
                layouts=[str(lay) for lay in layouts], batches=batches,
                steps_ms={f"{w}@{b}": round(ms, 3) for (w, b), ms in steps.items()})
    return tables
