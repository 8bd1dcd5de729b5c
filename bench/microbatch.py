"""Micro-batching (two-batch overlap) in DP×EP steps: the step time with one batch and
with two micro-batches against tokens per rank, and the `adaptive` policy's choice against
the better one per bucket.

    python bench/microbatch.py                         # dp2 and dp4, CPU
    python bench/microbatch.py --dp 2 --batches 1,16,64 --seconds 1
    python bench/microbatch.py --device cuda --dp 2 --ep-exchange peer   # 2 GPUs: graphs
    python bench/microbatch.py --device cuda --dp 2 --ep-exchange exact  # eager, NCCL

On GPUs (one per rank; `--share-gpus` lets ranks share one, which checks that the script
runs and measures nothing: processes time-slice the device) the peer exchange's decode
steps replay the group's CUDA graphs, whole or split (engine/lanes.py), and `--eager`
launches them.

A colocated layout of real rank actors (Ray, gloo, shared memory) serving a model whose
exchange is a real share of the step (wide hidden size, narrow experts, 64 experts
top-8, few layers). Two layouts per `--dp`, each stepping `batch` decoding sequences per
DP rank at every `--batches` point (`actors/ep_calibration.step_ms`):

- A/B: the adaptive policy told to keep measuring (`samples` unbounded), so its steps
  alternate one batch / two micro-batches: both figures come from the same processes,
  interleaved step by step (separate layouts differ by 10-25% from placement alone);
  each step timed by the ranks themselves (`MicrobatchControl`), means over the window;
- adaptive: the policy with its defaults, measured once it has tried both choices at that
  batch (its steady state, re-probes included): the share of its steps that split, and
  the cost of its choices valued at the A/B means (mean over its steps of the A/B time of
  the choice it made, over the better A/B time).

The baseline is one batch in the same layout. Prints a table last; writes JSON to
$OUT/microbatch.json (or ./microbatch.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from phalanx.actors.ep_calibration import settle, step_ms  # noqa: E402
from phalanx.config import MicrobatchConfig  # noqa: E402
from phalanx.models.tiny import tiny_variant_config, write_random_checkpoint, write_tokenizer  # noqa: E402
from phalanx.policies.microbatch import bucket_of  # noqa: E402

DEFAULTS = MicrobatchConfig()
ALTERNATE = {"samples": 10 ** 9, "probe": 0.0, "window": 10 ** 9}  # both choices, alternating
MIN_STEPS = 24  # steps measured per point at least
SLOWER_LIMIT = 1.03  # adaptive is the default if never slower than this × the better choice


def build_model(folder: Path, hidden: int, layers: int, moe_width: int = 64) -> Path:
    """Exchange-heavy sizes: wide hidden rows to send, narrow experts to compute."""
    cfg = tiny_variant_config("qwen3_moe")
    cfg.update(hidden_size=hidden, num_hidden_layers=layers, num_experts=64,
               num_experts_per_tok=8, moe_intermediate_size=moe_width, intermediate_size=256,
               num_attention_heads=8, num_key_value_heads=2, head_dim=64,
               max_position_embeddings=4096)
    write_tokenizer(folder)
    return write_random_checkpoint(folder, cfg, seed=0)


def _delta(first: dict, last: dict, bucket: int) -> dict[int, tuple[int, float]]:
    """{n: (steps, mean ms)} of leader 0's steps of `bucket` between two stats."""
    out = {}
    for n in (1, 2):
        key = f"{bucket}:{n}"
        c0 = first.get("microbatch_step_counts", {}).get(key, 0)
        c1 = last.get("microbatch_step_counts", {}).get(key, 0)
        m0 = first.get("microbatch_step_ms", {}).get(key, 0.0)
        m1 = last.get("microbatch_step_ms", {}).get(key, 0.0)
        if c1 > c0:
            out[n] = (c1 - c0, (c1 * m1 - c0 * m0) / (c1 - c0))
    return out


def measure(model_dir: Path, dp: int, options: dict, batches: list[int], seconds: float,
            warm: int, engine: dict) -> dict[int, dict[int, tuple[int, float]]]:
    """{batch: {n: (steps, mean ms)}} of a dp-rank layout under adaptive(`options`);
    `engine`: the device, exchange and dtype keywords of `LLM`."""
    from phalanx import LLM
    llm = LLM(model_dir, dp=dp, microbatch="adaptive", microbatch_options=options,
              max_num_seqs=max(batches), max_num_batched_tokens=max(1024, max(batches) * 4),
              page_size=16, num_pages=max(256, max(batches) * 12), **engine)
    client, out = llm.cluster, {}
    try:
        settle(client)
        for b in batches:
            window: list = []
            step_ms(client, b, seconds, prompt_len=8, max_new=160, warm_steps=warm,
                    min_steps=MIN_STEPS, window=window)
            first, last = window[0]
            out[b] = _delta(first[0], last[0], bucket_of(b))
            print(f"  dp{dp} {options}: batch {b}: {out[b]}", flush=True)
            settle(client)
    finally:
        llm.close()
    return out


def row(dp: int, b: int, ab: dict, adaptive: dict) -> dict:
    one, two = ab.get(1, (0, float("nan")))[1], ab.get(2, (0, float("nan")))[1]
    if b < 2:  # one token per rank never splits: both columns are one batch
        two = one
    best = min(one, two)
    steps = sum(c for c, _ in adaptive.values())
    valued = sum(c * (one if n == 1 else two) for n, (c, _) in adaptive.items())
    return {"dp": dp, "batch": b, "one_ms": one, "two_ms": two, "two_over_one": two / one,
            "ab_steps": {n: c for n, (c, _) in ab.items()},
            "adaptive_split_share": adaptive.get(2, (0, 0))[0] / steps if steps else 0.0,
            "adaptive_over_best": valued / steps / best if steps else float("nan"),
            "better": "two" if two < one else "one"}


def start_ray_with_gpus(ranks: int, share: bool) -> None:
    """Ray counting a GPU per rank: the GPUs there are, or (`share`) as many as the ranks,
    wrapped onto the real ones by the ranks (`RankActor.gpu_index`)."""
    import ray
    import torch
    found = torch.cuda.device_count()
    if found < ranks and not share:
        raise SystemExit(f"{ranks} ranks need {ranks} GPUs, found {found} (--share-gpus to "
                         "share them: no figures)")
    ray.init(num_gpus=max(ranks, found), include_dashboard=False, log_to_driver=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", default="2,4", help="DP ranks of the layouts")
    ap.add_argument("--batches", default="1,4,16,32,64,128,256",
                    help="sequences per DP rank (tokens per rank: decode steps)")
    ap.add_argument("--seconds", type=float, default=1.0, help="measured time per point")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--moe-width", type=int, default=64, help="each expert's intermediate size")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--ep-exchange", default="exact", choices=["exact", "padded", "peer"])
    ap.add_argument("--dtype", default=None, help="default: the model's (float32 on CPU)")
    ap.add_argument("--eager", action="store_true", help="GPU: no CUDA graphs")
    ap.add_argument("--share-gpus", action="store_true",
                    help="GPU: ranks share the GPUs there are (checks the script, no figures)")
    args = ap.parse_args(argv)
    out_dir = Path(os.environ.get("OUT", "."))
    batches = [int(b) for b in args.batches.split(",")]
    dps = [int(d) for d in args.dp.split(",")]
    defaults = {"samples": DEFAULTS.samples, "probe": DEFAULTS.probe}
    engine = {"device": args.device, "ep_exchange": args.ep_exchange,
              "enforce_eager": args.eager, **({"dtype": args.dtype} if args.dtype else {})}
    if args.device == "cuda":
        start_ray_with_gpus(max(dps), args.share_gpus)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "moe", args.hidden, args.layers, args.moe_width)
        for dp in dps:
            ab = measure(model_dir, dp, ALTERNATE, batches, args.seconds, warm=2, engine=engine)
            adaptive = measure(model_dir, dp, defaults, batches, args.seconds,
                               warm=2 * DEFAULTS.samples + 2, engine=engine)
            rows += [row(dp, b, ab[b], adaptive[b]) for b in batches]
    worst = max(r["adaptive_over_best"] for r in rows)
    default = "adaptive" if worst <= SLOWER_LIMIT else "threshold"
    (out_dir / "microbatch.json").write_text(json.dumps(
        {"rows": rows, "worst_adaptive_over_best": worst, "default": default,
         "hidden": args.hidden, "layers": args.layers, "moe_width": args.moe_width,
         "engine": engine, "shared_gpus": args.share_gpus, "adaptive": defaults}, indent=1))
    print(f"\nJSON: {out_dir / 'microbatch.json'}; adaptive at worst {worst:.3f}x the better "
          f"choice -> default {default!r} (limit {SLOWER_LIMIT}x)")
    print("| dp | batch/rank | one batch ms | two micro-batches ms | two/one | better | "
          "adaptive: steps split | adaptive/best |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dp']} | {r['batch']} | {r['one_ms']:.2f} | {r['two_ms']:.2f} | "
              f"{r['two_over_one']:.2f} | {r['better']} | {r['adaptive_split_share']:.0%} | "
              f"{r['adaptive_over_best']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
