"""Kill drills from outside, repeated with random timings (the stress run of issue 26):
every stream must equal the fault-free run; measures detection, recovery and stalls.

    python bench/kill_drills.py [--layouts disagg,dp2,tp2] [--drills 20] [--streams 16]
                                [--max-tokens 96] [--seed 0] [--device cuda] [--address A]
                                [--router-hold N] [--dtype bfloat16 --batch-invariant]

Per layout, one server stack in this process (`start_local`: the driver thread, router
and request records of `phalanx serve`, no HTTP) on the tiny model, CPU, local Ray (with
`--device cuda`: one GPU per rank, float32, NCCL with phalanx's deadlines; `--address`:
join that Ray cluster, e.g. one started with more GPUs declared than the machine has, so
that ranks share them; `--batch-invariant` and/or `--dtype bfloat16`: the GPU's
batch-invariant kernels, the serving dtype, every stream compared with a fault-free
single-rank run on the GPU in the same mode and dtype instead of the CPU's); then
`--drills` drills, each a random plan: (a) a kill while serving and one to three more
while the group re-forms, (b) two ranks at once, (c) a prefill and a decode rank at
once, (d) a decode rank while the prefill instance re-forms (disaggregated only). Rank
processes are SIGKILLed from outside, pids from Ray's
state. Each drill streams `--streams` requests (half greedy, half seeded sampling at
temperature 0.8), and every stream must equal the fault-free single-rank run (of the
layout's `tp_invariant_width`, models/row_parallel.py: its widest TP group's, e.g. 2 for
`tp2` and `disagg-tp2`).

Reported per layout: the layout's own fault-free pass (streams identical to the single
rank's), drills passed, kills, detection (death -> the client fenced the
group: every survivor is then out of its collective or killed), recovery (a drill's last
death -> the first token after the re-formation that followed it), per-stream stall
p50/p99 (the longest gap between two chunks of a stream), re-formations. Prints a table last and writes JSON to $OUT/kill_drills.json
(or ./kill_drills.json). Not run in CI (minutes per layout).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time

from phalanx import LLM, SamplingParams
from phalanx.chaos.drill import Kill, percentile, run_drill, streamed_requests
from phalanx.models.loader import read_model_config
from phalanx.models.row_parallel import layout_width
from phalanx.models.tiny import default_model_dir
from phalanx.server import start_local

LAYOUTS = {"disagg": {}, "dp2": dict(dp=2), "tp2": dict(tp=2), "dp2tp2": dict(dp=2, tp=2),
           # a TP2 prefill instance: the decode side's re-prefills meet its sums' bits
           # (models/row_parallel.py), so the reference is a single rank of width 2
           "disagg-tp2": dict(prefill_tp=2, decode_dp=2),
           # two DP×EP groups of one rank: a death in one leaves the other serving
           "dp2g2": dict(dp=2, ep_groups=2),
           # every step split in two, decode micro-batches on the peer channels' two lanes
           "dp2-peer-split": dict(dp=2, ep_exchange="peer", microbatch="on")}
ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=256, page_size=4, num_pages=600)


def invariant_width(model: str, name: str) -> int:
    """The layout's automatic `tp_invariant_width` (its widest TP group's)."""
    layout = LAYOUTS[name]
    widths = [layout.get(k, 1) for k in ("tp", "prefill_tp", "decode_tp")]
    return layout_width(read_model_config(model), widths)


def fault_free_texts(model: str, requests, reference: dict, width: int) -> list[str]:
    """The requests' fault-free texts: the single-rank engine, built with `reference`'s
    keywords (device, dtype, batch_invariant) and the layout's `width`."""
    offline = LLM(model, **ENGINE, **reference, tp_invariant_width=width)
    outs = offline.generate(prompt_token_ids=[r[0] for r in requests],
                            sampling_params=[SamplingParams(**body) for _, body in requests])
    texts = [offline.decode(o.outputs[0].token_ids) for o in outs]
    del offline, outs
    if reference.get("device", "cpu") != "cpu":
        import torch
        torch.cuda.empty_cache()  # the ranks' processes share this GPU
    return texts


def plan(layout: str, rng: random.Random) -> tuple[str, list[Kill]]:
    disagg = layout.startswith("disagg")
    kinds = ["a", "b"] + (["c", "d"] if disagg else [])
    kind = rng.choice(kinds)
    if kind == "a":
        return "a", [Kill()] + [Kill(during_formation=True)] * rng.randint(1, 3)
    if kind == "b":
        role = "decode" if disagg else "group"
        return "b", [Kill(role=(role, role))]
    if kind == "c":
        return "c", [Kill(role=("prefill", "decode"))]
    return "d", [Kill(role="prefill"), Kill(role="decode", delay_s=(0.3, 1.5))]


def _client_of(client):
    return client.backend._driver._client


def detections(client, kills: list, since: float) -> list[float]:
    """Per kill: seconds until the next fence the client logged."""
    fences = [e[0] for e in _client_of(client).recovery.events if e[1] == "fenced" and e[0] >= since]
    return [round(min((f for f in fences if f >= t), default=float("nan")) - t, 3)
            for t, *_ in kills]


def recoveries(client, kills: list, arrivals: list, since: float) -> list[float]:
    """Per drill: seconds from its last kill to the first token that left the layout
    after the next re-formation (a group formed and resumed) past that kill."""
    if not kills:
        return []
    last = max(t for t, *_ in kills)
    formed = [e[0] for e in _client_of(client).recovery.events
              if e[1] == "resumed" and e[0] >= max(since, last)]
    if not formed:
        return [float("nan")]
    after = [t for t in arrivals if t >= min(formed)]
    return [round(after[0] - last, 3)] if after else [float("nan")]


async def run_layout(model: str, name: str, drills: int, requests, refs, seed: int,
                     placement: dict) -> dict:
    """`placement`: where the ranks run (`device`, `dtype`, `ray_address`)."""
    rng = random.Random(seed)
    client = start_local(model, model_name="tiny", collective_timeout_s=5.0, max_recoveries=10_000,
                         **LAYOUTS[name], **ENGINE, **placement)
    rows = []
    try:
        # The layout's own fault-free pass first: a stream that differs here differs by
        # the layout (its sums), not by a kill.
        base = await run_drill(client, requests, refs, [], seed=0)
        fault_free = base.identical if not base.errors else -len(base.errors)
        print(f"  {name} fault-free: {base.identical}/{len(requests)} identical to the single rank",
              flush=True)
        for d in range(drills):
            kind, steps = plan(name, rng)
            t0 = time.time()
            report = await run_drill(client, requests, refs, steps, seed=rng.randrange(1 << 30))
            ok = (report.identical == len(requests) and not report.errors
                  and not report.killer_error)
            rows.append({"drill": d, "kind": kind, "ok": ok, **report.summary(),
                         "stalls": report.stalls,
                         "detect_s": detections(client, report.kills, t0),
                         "recover_s": recoveries(client, report.kills, report.arrivals, t0)})
            print(f"  {name} drill {d} ({kind}): {rows[-1]['identical']}/{len(requests)} identical, "
                  f"{rows[-1]['kills']} kills, stall p99 {rows[-1]['stall_p99_s']} s, "
                  f"recovered {rows[-1]['recover_s']} s{'' if ok else '  FAILED'}", flush=True)
        restarts = _client_of(client).recovery.recoveries
    finally:
        await client.close()
    stalls = [s for r in rows for s in r["stalls"]]
    detect = [x for r in rows for x in r["detect_s"] if x == x]
    resumed = [x for r in rows for x in r["recover_s"] if x == x]
    return {"layout": name, "fault_free_identical": fault_free, "drills": len(rows),
            "passed": sum(r["ok"] for r in rows),
            "kills": sum(r["kills"] for r in rows), "reformations": restarts,
            "detect_p50_s": percentile(detect, 50), "detect_p99_s": percentile(detect, 99),
            "recovery_p50_s": percentile(resumed, 50), "recovery_p99_s": percentile(resumed, 99),
            "stall_p50_s": percentile(stalls, 50), "stall_p99_s": percentile(stalls, 99),
            "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="disagg,dp2,tp2")
    ap.add_argument("--drills", type=int, default=20)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (ranks in float32: the "
                    "streams are compared with the CPU's)")
    ap.add_argument("--dtype", default=None, help="the ranks' dtype on cuda (default float32, "
                    "compared with the CPU; another, with the GPU's own single rank)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="the batch-invariant kernels (kernels/batch_invariant.py); on cuda the "
                         "fault-free reference is then a single-rank run on the GPU in this mode")
    ap.add_argument("--address", default=None, help="join this Ray cluster")
    ap.add_argument("--router-hold", type=int, default=None,
                    help="phalanx serve's --router-hold (default: max_num_seqs + 1); small "
                         "values keep most streams waiting at the router through the kills")
    args = ap.parse_args()
    names = args.layouts.split(",")
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}")
    on_gpu = args.device != "cpu"
    if args.dtype is not None and not on_gpu:
        ap.error("--dtype is for --device cuda (the CPU ranks run the model's dtype)")
    model = str(default_model_dir())
    placement = {"device": args.device, "ray_address": args.address,
                 "router_hold": args.router_hold, "batch_invariant": args.batch_invariant}
    if on_gpu:
        placement["dtype"] = args.dtype or "float32"
    # On a GPU in the mode or another dtype than float32 the reference is the GPU's own
    # fault-free single rank (without the mode, expect streams to differ: its rows change
    # with their batch); float32 without it is compared with the CPU's.
    gpu_reference = on_gpu and (args.batch_invariant or placement["dtype"] != "float32")
    reference = ({"device": args.device, "dtype": placement["dtype"],
                  "batch_invariant": args.batch_invariant} if gpu_reference else {})
    requests = streamed_requests(args.streams, read_model_config(model).vocab_size,
                                 args.max_tokens, random.Random(args.seed))
    refs = {w: fault_free_texts(model, requests, reference, w)
            for w in sorted({invariant_width(model, n) for n in names})}
    results = [asyncio.run(run_layout(model, name, args.drills, requests,
                                      refs[invariant_width(model, name)], args.seed + i, placement))
               for i, name in enumerate(names)]
    out = os.path.join(os.environ.get("OUT", "."), "kill_drills.json")
    with open(out, "w") as f:
        json.dump({"meta": {"python": platform.python_version(), "cpus": os.cpu_count(),
                            "args": vars(args)}, "layouts": results}, f, indent=1)
    print(f"\nwrote {out}")
    print("| layout | fault-free identical | drills passed | kills | re-formations "
          "| detection p50/p99 s | recovery p50/p99 s | stall p50/p99 s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['layout']} | {r['fault_free_identical']}/{args.streams} | {r['passed']}/{r['drills']} "
              f"| {r['kills']} | {r['reformations']} "
              f"| {r['detect_p50_s']} / {r['detect_p99_s']} | {r['recovery_p50_s']} / "
              f"{r['recovery_p99_s']} | {r['stall_p50_s']} / {r['stall_p99_s']} |")
    return 0 if all(r["passed"] == r["drills"] and r["fault_free_identical"] == args.streams
                    for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
