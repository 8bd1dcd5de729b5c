"""EP width: the cost model's tables measured on this machine, its predictions against
measured decode steps, and the policy's pick against the measured best.

    python bench/ep_width.py                    # (a) CPU, a 64-expert model, DP=4
    python bench/ep_width.py --model DIR --dp N [--tp T] [--device cuda]  # your own
    python bench/ep_width.py --simulate         # (b) widths 1..128, H200 + seed figures

(a) One colocated DP=4 layout of real rank actors (Ray, gloo) serving a tiny-sized model
with 64 experts (top-8) — or `--model`'s, at `--dp`/`--tp`, the tables `phalanx serve
--ep-costs` should read for that model and layout — re-shaped by the client itself through
every even split (4x1, 2x2 and 1x4: groups x ranks per group, the EP-width policy's path). At each layout and batch (sequences per
DP rank, `--batches`), a decode step is measured: the DP leaders' step counters over
wall time while every rank runs that many long requests. The expert compute is measured
apart, in this process, with the model's own expert weights' shapes (`fused_experts`
over `active` experts and `rows` routed rows). The cost tables (`policies/ep_cost.py`)
are then: experts from that grid; attention + the rest of a one-rank step from the
width-1 steps minus their expert time; exchange (with the rest of a group's lockstep)
from each width's steps minus the width-1 step at the same batch and its expert time.
Only the `--fit` batches feed the tables; every batch is predicted and compared with
its measurement (the others are held out). Then the `cost_model` policy picks a layout
at three loads and the pick is compared with the measured fastest step. The tables are
written to `--costs-out` (what `phalanx serve --ep-costs FILE` reads).

(b) `--simulate`: bench/ep_width_sim.py.

Prints a table last; writes JSON to $OUT/ep_width.json (or ./ep_width.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from phalanx.actors.ep_calibration import settle, step_ms  # noqa: E402
from phalanx.actors.ep_control import model_numbers  # noqa: E402
from phalanx.engine.expert_timing import time_experts  # noqa: E402
from phalanx.models.loader import read_model_config  # noqa: E402
from phalanx.models.tiny import tiny_variant_config, write_random_checkpoint, write_tokenizer  # noqa: E402
from phalanx.policies.ep_cost import CostTables, Grid  # noqa: E402
from phalanx.policies.ep_fit import fit_cost_tables  # noqa: E402
from phalanx.policies.ep_width import (EPInputs, OfferedLoad, RankPool,  # noqa: E402
                                       candidate_layouts, make_ep_width_policy)


def build_model(folder: Path) -> Path:
    """The tiny model's sizes with 64 experts, 8 per token, wider experts."""
    cfg = tiny_variant_config("qwen3_moe")
    cfg.update(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256,
               max_position_embeddings=4096)
    write_tokenizer(folder)
    return write_random_checkpoint(folder, cfg, seed=0)


def measure(model_dir: Path, batches: list[int], seconds: float, layouts: list, dp: int,
            tp: int, device: str) -> tuple[dict, float]:
    """{(width, batch): step ms} over `layouts`, and the mean context."""
    from phalanx import LLM
    llm = LLM(model_dir, dp=dp, tp=tp, ep_groups=dp, max_num_seqs=max(batches), page_size=16,
              num_pages=0 if device.startswith("cuda") else 2048, device=device,
              max_num_batched_tokens=1024)
    client = llm.cluster
    steps, contexts = {}, []
    try:
        for layout in layouts:
            if client.layout != layout:
                client.reshape(layout)
            settle(client)
            for b in batches:
                ms, ctx = step_ms(client, b, seconds, prompt_len=32, max_new=1500)
                steps[(layout.width, b)] = ms
                contexts.append(ctx)
                print(f"  {layout}: batch {b}: {ms:.2f} ms/step at context {ctx:.0f}", flush=True)
                settle(client)
    finally:
        llm.close()
    return steps, sum(contexts) / len(contexts)


def picks(tables: CostTables, model, steps: dict, ctx: float, loads: list[int], dp: int,
          tp: int) -> list[dict]:
    pool = RankPool(dp * tp, tp, memory_bytes=1 << 40, max_seqs=max(loads))
    layouts = candidate_layouts(pool)
    out = []
    for b in loads:
        policy = make_ep_width_policy("cost_model", {"margin": 0.0, "min_interval_s": 0.0,
                                                     "itl_target_ms": 1e6})
        load = OfferedLoad((b,) * dp, (0,) * dp, (0,) * dp, ctx)
        d = policy.decide(EPInputs(pool, model, load, tables, layouts[0]))
        best = min(layouts, key=lambda lay: steps[(lay.width, b)])
        out.append({"batch": b, "pick": str(d.layout), "measured_best": str(best),
                    "pick_ms": steps[(d.layout.width, b)], "best_ms": steps[(best.width, b)],
                    "reason": d.reason})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--simulate", action="store_true", help="(b): bench/ep_width_sim.py")
    ap.add_argument("--model", default=None,
                    help="a Hugging Face MoE model folder (default: a tiny-sized 64-expert one)")
    ap.add_argument("--dp", type=int, default=4, help="DP ranks of the layout to calibrate")
    ap.add_argument("--tp", type=int, default=1, help="TP ranks inside each DP rank")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--batches", default="1,4,8,16", help="sequences per DP rank")
    ap.add_argument("--fit", default="1,16", help="batches the tables are fitted from")
    ap.add_argument("--seconds", type=float, default=3.0, help="measured time per point")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per expert point")
    ap.add_argument("--costs-out", default=None, help="cost tables file (default $OUT/ep_costs.json)")
    args = ap.parse_args(argv)
    if args.simulate:
        import ep_width_sim
        return ep_width_sim.main()
    out_dir = Path(os.environ.get("OUT", "."))
    batches = [int(b) for b in args.batches.split(",")]
    fit = [int(b) for b in args.fit.split(",")]
    layouts = candidate_layouts(RankPool(args.dp * args.tp, args.tp))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else build_model(Path(tmp) / "moe64")
        cfg = read_model_config(model_dir)
        dtype = torch.float32 if args.device == "cpu" else getattr(torch, cfg.dtype, torch.bfloat16)
        model = model_numbers(cfg, torch.tensor([], dtype=dtype).element_size())
        experts = Grid(*time_experts(cfg, torch.device(args.device), dtype, args.reps))
        steps, ctx = measure(model_dir, sorted(set(batches) | set(fit)), args.seconds, layouts,
                             args.dp, args.tp, args.device)
    tables = fit_cost_tables(steps, experts, model, fit, ctx, [lay.width for lay in layouts],
                             f"bench/ep_width.py on {os.uname().nodename}, "
                             f"{time.strftime('%Y-%m-%d')}, {args.device}, batches {fit}")
    costs = Path(args.costs_out) if args.costs_out else out_dir / "ep_costs.json"
    costs.write_text(tables.to_json())
    rows = [{"layout": str(lay), "batch": b, "measured_ms": steps[(lay.width, b)],
             "predicted_ms": tables.step_us(model, lay.width, b, ctx) / 1e3, "fitted": b in fit}
            for lay in layouts for b in batches]
    chosen = picks(tables, model, steps, ctx, [batches[0], batches[len(batches) // 2], batches[-1]],
                   args.dp, args.tp)
    (out_dir / "ep_width.json").write_text(json.dumps(
        {"context": ctx, "steps": rows, "picks": chosen, "costs": str(costs)}, indent=1))
    print(f"\ncost tables: {costs}; mean context {ctx:.0f} tokens; JSON: {out_dir / 'ep_width.json'}")
    print("| layout | batch/DP rank | measured ms | predicted ms | pred/meas | in fit |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['batch']} | {r['measured_ms']:.2f} | {r['predicted_ms']:.2f} "
              f"| {r['predicted_ms'] / r['measured_ms']:.2f} | {'yes' if r['fitted'] else 'held out'} |")
    print("\n| batch/DP rank | policy's pick | measured best | pick ms | best ms |")
    print("|---|---|---|---|---|")
    for c in chosen:
        print(f"| {c['batch']} | {c['pick']} | {c['measured_best']} | {c['pick_ms']:.2f} | {c['best_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
