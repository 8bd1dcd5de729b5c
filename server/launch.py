"""Building a serving backend from a model folder and layout arguments (`phalanx serve`
and `phalanx.server.start_local` share this).

Layout rule: with no layout argument at all, the disaggregated default — one prefill
instance of TP=1 streaming KV to a decode group of DP=2 (`DEFAULT_LAYOUT`); `tp=1,
dp=1` given explicitly (and nothing disaggregated), one in-process engine
(`EngineBackend`, no Ray); anything else, the layout `actors.cluster_builder.build_cluster`
forms from the same keywords as `LLM`'s, served by a `ClusterBackend` (Ray started
locally, or joined with `ray_address`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from .backend import ServingBackend

if TYPE_CHECKING:
    from ..router.admission import AdmissionConfig

__all__ = ["DEFAULT_LAYOUT", "LAYOUT_KEYS", "resolve_layout", "is_single_rank",
           "build_backend", "layout_kwargs", "placement_lines"]

DEFAULT_LAYOUT: Mapping[str, int] = {"prefill_tp": 1, "decode_dp": 2}
LAYOUT_KEYS = ("tp", "dp", "prefill_tp", "decode_dp", "decode_tp", "prefill_instances",
               "prefill_page_size")
_DISAGG_KEYS = LAYOUT_KEYS[2:]
_CLUSTER_ONLY = ("collective_timeout_s", "max_recoveries", "recovery_window_s",
                 "replace_timeout_s", "ep_exchange", "ray_address", "ep_policy", "ep_groups",
                 "ep_costs", "ep_options", "microbatch", "microbatch_options")
Progress = Callable[[str], None]


def resolve_layout(**given: Optional[int]) -> dict[str, int]:
    """The layout keywords to build from those given (None = not given); see the module
    docstring. ValueError for colocated and disaggregated keywords mixed."""
    unknown = set(given) - set(LAYOUT_KEYS)
    if unknown:
        raise ValueError(f"unknown layout keyword(s): {sorted(unknown)}")
    chosen = {k: int(v) for k, v in given.items() if v is not None}
    if not chosen:
        return dict(DEFAULT_LAYOUT)
    if any(k in chosen for k in _DISAGG_KEYS) and chosen.get("tp", 1) * chosen.get("dp", 1) != 1:
        raise ValueError("layout: give either --tp/--dp (colocated) or the --prefill-*/--decode-* "
                         "flags (disaggregated), not both")
    return chosen


def is_single_rank(layout: Mapping[str, int]) -> bool:
    return (layout.get("tp", 1) * layout.get("dp", 1) == 1
            and not any(k in layout for k in _DISAGG_KEYS))


def describe(layout: Mapping[str, int]) -> str:
    if is_single_rank(layout):
        return "one in-process engine (TP=1, DP=1)"
    if any(k in layout for k in _DISAGG_KEYS):
        return (f"disaggregated: {layout.get('prefill_instances', 1)} prefill instance(s) of "
                f"TP={layout.get('prefill_tp', 1)} -> decode DP={layout.get('decode_dp', 1)} x "
                f"TP={layout.get('decode_tp', 1)}")
    return f"colocated: TP={layout.get('tp', 1)} x DP={layout.get('dp', 1)}"


def placement_lines(nodes: Mapping[str, Any]) -> list[str]:
    """Human lines of a client's `rank_nodes()`: where each rank runs."""
    lines = [f"{'decode' if nodes.get('prefill') else 'group'} rank {r} on node {n}"
             for r, n in enumerate(nodes.get("decode", ()))]
    for i, ranks in enumerate(nodes.get("prefill", ())):
        lines += [f"prefill instance {i} rank {r} on node {n}" for r, n in enumerate(ranks)]
    return lines


def build_backend(model: Optional[str | os.PathLike] = None, *, model_name: Optional[str] = None,
                  routing_policy: Optional[str] = None, router_hold: Optional[int] = None,
                  progress: Optional[Progress] = None, **kwargs: Any) -> ServingBackend:
    """A backend for `model` (None: the tiny default model). `kwargs`: `LLM`'s keywords
    (layout ones resolved by `resolve_layout`; None values count as not given).
    `routing_policy`: a registered routing policy name, `router_hold`: requests a DP group
    may hold before new ones wait at the router (`admission_for`; cluster layouts).
    `progress` receives one line per loading stage."""
    say = progress or (lambda line: None)
    layout = resolve_layout(**{k: kwargs.pop(k, None) for k in LAYOUT_KEYS})
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if model is None:
        from ..models.tiny import default_model_dir
        say("preparing the tiny default model")
        model = default_model_dir()
    say(f"loading {model} as {describe(layout)}")
    if is_single_rank(layout):
        from .engine_backend import EngineBackend
        single = {k: v for k, v in kwargs.items() if k not in _CLUSTER_ONLY}
        return EngineBackend.from_model_dir(model, model_name=model_name, **single)
    return _cluster_backend(model, layout, kwargs, model_name, routing_policy, router_hold, say)


def admission_for(scheduler: Any, hold: Optional[int] = None) -> "AdmissionConfig":
    """When requests wait at the router for a DP group with room (router/admission.py):
    a group has room below `hold` requests (None: the engine's `max_num_seqs` + 1, what it
    can run plus one ready; 0: no hold) and below two steps' worth of uncached prompt
    tokens (`2 * max_num_batched_tokens`)."""
    from ..router.admission import AdmissionConfig
    if hold == 0:
        return AdmissionConfig()
    if hold is not None and hold < 0:
        raise ValueError(f"router_hold must be >= 0, got {hold}")
    return AdmissionConfig(max_requests=hold or scheduler.max_num_seqs + 1,
                           max_queued_tokens=2 * scheduler.max_num_batched_tokens)


def _cluster_backend(model, layout: dict, kwargs: dict, model_name: Optional[str],
                     routing_policy: Optional[str], router_hold: Optional[int],
                     say: Progress) -> ServingBackend:
    from transformers import AutoTokenizer

    from ..actors.cluster_builder import build_cluster
    from ..llm import check_fp8_disagg, disagg_config, engine_config
    from .cluster_backend import ClusterBackend
    from .cluster_driver import DriverConfig

    import ray

    address = kwargs.pop("ray_address", None)
    config = engine_config(model, tp=layout.get("tp", 1), dp=layout.get("dp", 1), **kwargs)
    disagg = None
    if any(k in layout for k in _DISAGG_KEYS):
        disagg = disagg_config(*(layout.get(k) for k in _DISAGG_KEYS),
                               config.parallel.collective_timeout_s)
        check_fp8_disagg(config, disagg)
    if ray.is_initialized():
        say("using the Ray cluster this process is connected to")
    else:
        say(f"joining the Ray cluster at {address}" if address else "starting a local Ray cluster")
    client = build_cluster(config, disagg, address)
    say(f"Ray cluster at {ray.get_runtime_context().gcs_address}")
    say("rank groups formed, shards loaded")
    try:
        for line in placement_lines(client.rank_nodes()):
            say(line)
        admission = admission_for(config.scheduler, router_hold)
        driver = DriverConfig(policy=routing_policy, admission=admission) if routing_policy \
            else DriverConfig(admission=admission)
        name = model_name or os.path.basename(os.path.normpath(config.model_path))
        return ClusterBackend(client, model_name=name, max_model_len=config.max_model_len,
                              tokenizer=AutoTokenizer.from_pretrained(config.model_path),
                              config=driver, eos_token_ids=config.model.eos_token_ids)
    except BaseException:
        client.close()
        raise


def layout_kwargs(args) -> dict:
    """The layout keywords of `LLM` / `build_backend` beyond tp/dp from the command
    line's `args` (cli.py): the disaggregated layout's, the EP-width policy's and the
    micro-batch policy's."""
    ep = {}
    if args.ep_policy != "fixed" or args.ep_groups != 1:
        ep = dict(ep_policy=args.ep_policy, ep_groups=args.ep_groups, ep_costs=args.ep_costs,
                  ep_options={"itl_target_ms": args.ep_itl_target_ms,
                              "min_interval_s": args.ep_min_interval,
                              "interval_s": args.ep_interval})
    micro = dict(microbatch=args.microbatch,
                 microbatch_options={"min_tokens": args.microbatch_min_tokens})
    return dict(prefill_tp=args.prefill_tp, prefill_instances=args.prefill_instances,
                decode_dp=args.decode_dp, decode_tp=args.decode_tp,
                prefill_page_size=args.prefill_page_size, **ep, **micro)
