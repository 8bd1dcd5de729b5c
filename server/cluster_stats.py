"""One snapshot of a cluster's serving stats, from its leaders' engine stats and the router.

Keys (all numbers; see `ServingBackend.stats`):
  num_waiting: requests queued on any leader (decode and prefill) plus those the client
    holds back for lack of decode pages and those held at the router (the queue depth);
  num_held: requests held at the router until a DP group has room (admission);
  num_running: requests the decode DP leaders are running;
  kv_usage: KV pages in use over KV pages, summed over the decode DP leaders;
  kv_capacity_tokens: the tokens their KV caches hold, summed;
  prefix_hit_rate: prompt tokens served from the prefix cache over prompt tokens looked
    up, on the side that runs prompts (prefill instances when disaggregated);
    prefix_query_tokens, prefix_hit_tokens: those two totals (ranks' counts since their
    epoch began: a re-formed group starts from 0 again);
  num_preemptions: sequences preempted for want of KV pages, every leader;
  num_live: requests the driver tracks; num_dp_groups, num_prefill_instances;
  router_decisions, router_prefix_hit_estimate: the router's own count and hit estimate
    for the side that runs prompts;
  recoveries: groups re-formed after a rank failure (prefill instances, decode or
    colocated groups);
  width, desired_width: DP ranks the decode (or colocated) group serves with now, and
    those it should have (fewer while a dead rank's capacity is missing);
  prefill_width: prefill instances serving;
  ep_width, ep_groups, reshardings, ep_predicted_step_ms, ep_measured_step_ms (colocated
    layouts): the EP-width policy's layout, its changes, its last predicted step and the
    step measured;
  healthy: 1.0.
"""

from __future__ import annotations

from typing import Iterable

from ..router import Router

__all__ = ["summarize"]


def _total(stats: Iterable[dict], key: str) -> float:
    return float(sum(s.get(key, 0) for s in stats))


def _hit_rate(stats: list[dict]) -> float:
    query = _total(stats, "prefix_query_tokens")
    if query:
        return _total(stats, "prefix_hit_tokens") / query
    rates = [float(s.get("prefix_hit_rate", 0.0)) for s in stats]
    return sum(rates) / len(rates) if rates else 0.0


def _kv_usage(stats: list[dict]) -> float:
    pages = _total(stats, "num_pages")
    if pages:
        return sum(float(s.get("kv_usage", 0.0)) * s.get("num_pages", 0) for s in stats) / pages
    return max((float(s.get("kv_usage", 0.0)) for s in stats), default=0.0)


def summarize(view: dict, router: Router, *, live: int, held: int = 0) -> dict[str, float]:
    """`view`: a client's `leader_stats()` (`{"decode": [...], "prefill": [...],
    "queued": n, "recoveries": n}`; empty dicts stand for leaders that did not answer);
    `held`: requests waiting at the router (admission), counted as waiting."""
    decode = [s for s in view.get("decode", ()) if s]
    prefill = [s for s in view.get("prefill", ()) if s]
    disaggregated = bool(router.prefill_instances)
    pool = router.prefill if disaggregated else router.decode
    return {
        "num_waiting": _total(decode + prefill, "num_waiting") + float(view.get("queued", 0))
        + held,
        "num_held": float(held),
        "num_running": _total(decode, "num_running"),
        "kv_usage": _kv_usage(decode),
        "kv_capacity_tokens": _total(decode, "kv_capacity_tokens"),
        "prefix_hit_rate": _hit_rate(prefill if disaggregated else decode),
        "prefix_query_tokens": _total(prefill if disaggregated else decode, "prefix_query_tokens"),
        "prefix_hit_tokens": _total(prefill if disaggregated else decode, "prefix_hit_tokens"),
        "num_preemptions": _total(decode + prefill, "num_preemptions"),
        "num_live": float(live),
        "num_dp_groups": float(len(router.groups)),
        "num_prefill_instances": float(len(router.prefill_instances)),
        "router_decisions": float(pool.stats.decisions),
        "router_prefix_hit_estimate": pool.stats.estimated_hit_rate,
        "recoveries": float(view.get("recoveries", 0)),
        "width": float(view.get("width", len(decode))),
        "desired_width": float(view.get("desired_width", len(router.groups))),
        "prefill_width": float(view.get("prefill_width", len(prefill))),
        **{k: float(view[k]) for k in ("ep_width", "ep_groups", "reshardings",
                                       "ep_predicted_step_ms", "ep_measured_step_ms")
           if k in view},
        **_microbatching(decode),
        "healthy": 1.0,
    }


def _microbatching(decode: list[dict]) -> dict[str, float]:
    steps = _total(decode, "microbatch_steps")
    out = {"microbatch_share": _total(decode, "microbatch_split_steps") / steps if steps else 0.0}
    times: dict[str, list[float]] = {}
    for s in decode:
        for key, ms in s.get("microbatch_step_ms", {}).items():
            times.setdefault(key, []).append(float(ms))
    for key, values in times.items():
        bucket, n = key.split(":")
        out[f"microbatch_step_ms:{2 ** int(bucket)}:{n}"] = sum(values) / len(values)
    return out
