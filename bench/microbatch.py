"""Micro-batching (two-batch overlap) in DP×EP steps: the step time with one batch and
with two micro-batches against tokens per rank, and the `adaptive` policy's choice against
the better fixed one per bucket.

    python bench/microbatch.py                         # dp2 and dp4, CPU
    python bench/microbatch.py --dp 2 --batches 1,16,64 --seconds 1

A colocated layout of real rank actors (Ray, gloo, shared memory) serving a model whose
exchange is a real share of the step (wide hidden size, narrow experts, 64 experts
top-8, few layers). For each `--dp`, each policy (`off`, `on`, `adaptive`) gets its own
layout; at each batch (sequences per DP rank, each decoding one token a step) the step is
measured as the DP leaders' step counters over wall time while every request decodes
(`actors/ep_calibration.step_ms`). The adaptive layout's choice per bucket is read from
its ranks' stats (the share of its steps there that split). The baseline is the `off`
layout in the same process: ratios, not absolute times, are what the table reports.

Prints a table last; writes JSON to $OUT/microbatch.json (or ./microbatch.json).
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
from phalanx.models.tiny import tiny_variant_config, write_random_checkpoint, write_tokenizer  # noqa: E402
from phalanx.policies.microbatch import bucket_of  # noqa: E402

POLICIES = ("off", "on", "adaptive")
SLOWER_LIMIT = 1.03  # adaptive is the default if never slower than this × the better fixed


def build_model(folder: Path, hidden: int, layers: int) -> Path:
    """Exchange-heavy sizes: wide hidden rows to send, narrow experts to compute."""
    cfg = tiny_variant_config("qwen3_moe")
    cfg.update(hidden_size=hidden, num_hidden_layers=layers, num_experts=64,
               num_experts_per_tok=8, moe_intermediate_size=64, intermediate_size=256,
               num_attention_heads=8, num_key_value_heads=2, head_dim=64,
               max_position_embeddings=4096)
    write_tokenizer(folder)
    return write_random_checkpoint(folder, cfg, seed=0)


def measure(model_dir: Path, dp: int, policy: str, batches: list[int], seconds: float
            ) -> tuple[dict[int, float], dict]:
    """{batch: step ms} of a dp-rank layout under `policy`, and its leader 0's stats."""
    from phalanx import LLM
    options = {"samples": 3, "probe": 0.05} if policy == "adaptive" else None
    llm = LLM(model_dir, dp=dp, microbatch=policy, microbatch_options=options,
              max_num_seqs=max(batches), max_num_batched_tokens=max(1024, max(batches) * 4),
              page_size=16, num_pages=max(256, max(batches) * 8))
    client, steps = llm.cluster, {}
    try:
        settle(client)
        for b in batches:
            ms, _ = step_ms(client, b, seconds, prompt_len=8, max_new=96)
            steps[b] = ms
            print(f"  dp{dp} {policy}: batch {b}: {ms:.2f} ms/step", flush=True)
            settle(client)
        stats = client.leader_stats()["decode"][0]
    finally:
        llm.close()
    return steps, stats


def adaptive_choice(stats: dict, batch: int) -> str:
    """What the adaptive layout ran at `batch`'s bucket: steps with one batch / two."""
    counts = stats.get("microbatch_step_counts", {})
    b = bucket_of(batch)
    return f"{counts.get(f'{b}:1', 0)}/{counts.get(f'{b}:2', 0)}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", default="2,4", help="DP ranks of the layouts")
    ap.add_argument("--batches", default="1,4,16,32,64,128,256",
                    help="sequences per DP rank (tokens per rank: decode steps)")
    ap.add_argument("--seconds", type=float, default=1.5, help="measured time per point")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args(argv)
    out_dir = Path(os.environ.get("OUT", "."))
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "moe", args.hidden, args.layers)
        for dp in (int(d) for d in args.dp.split(",")):
            results = {p: measure(model_dir, dp, p, batches, args.seconds) for p in POLICIES}
            for b in batches:
                off, on, adaptive = (results[p][0][b] for p in POLICIES)
                best = min(off, on)
                rows.append({"dp": dp, "batch": b, "off_ms": off, "on_ms": on,
                             "adaptive_ms": adaptive, "on_over_off": on / off,
                             "adaptive_over_best": adaptive / best,
                             "better_fixed": "on" if on < off else "off",
                             "adaptive_ran": adaptive_choice(results["adaptive"][1], b)})
    worst = max(r["adaptive_over_best"] for r in rows)
    default = "adaptive" if worst <= SLOWER_LIMIT else "threshold"
    (out_dir / "microbatch.json").write_text(json.dumps(
        {"rows": rows, "worst_adaptive_over_best": worst, "default": default,
         "hidden": args.hidden, "layers": args.layers}, indent=1))
    print(f"\nJSON: {out_dir / 'microbatch.json'}; adaptive at worst {worst:.3f}x the better "
          f"fixed choice -> default {default!r} (limit {SLOWER_LIMIT}x)")
    print("| dp | batch/rank | off ms | on ms | on/off | adaptive ms | adaptive/best | "
          "adaptive steps 1/2 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dp']} | {r['batch']} | {r['off_ms']:.2f} | {r['on_ms']:.2f} | "
              f"{r['on_over_off']:.2f} | {r['adaptive_ms']:.2f} | {r['adaptive_over_best']:.2f} | "
              f"{r['adaptive_ran']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
