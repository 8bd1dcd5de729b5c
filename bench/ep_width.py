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

from phalanx.actors.cluster import Placement  # noqa: E402
from phalanx.actors.ep_control import model_numbers  # noqa: E402
from phalanx.engine.sampling_params import SamplingParams  # noqa: E402
from phalanx.kernels.moe import fused_experts  # noqa: E402
from phalanx.models.loader import read_model_config  # noqa: E402
from phalanx.models.tiny import tiny_variant_config, write_random_checkpoint, write_tokenizer  # noqa: E402
from phalanx.policies.ep_cost import CostTables, Grid, active_experts  # noqa: E402
from phalanx.policies.ep_width import (EPInputs, OfferedLoad, RankPool,  # noqa: E402
                                       candidate_layouts, make_ep_width_policy)

ACTIVE = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ROWS = (8, 32, 128, 512)


def build_model(folder: Path) -> Path:
    """The tiny model's sizes with 64 experts, 8 per token, wider experts."""
    cfg = tiny_variant_config("qwen3_moe")
    cfg.update(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256,
               max_position_embeddings=4096)
    write_tokenizer(folder)
    return write_random_checkpoint(folder, cfg, seed=0)


def expert_grid(model_dir: Path, reps: int, device: str, dtype: torch.dtype) -> Grid:
    """µs of one step's expert compute (all MoE layers) by distinct experts and rows,
    with the kernel the ranks run (`fused_experts`: Triton on GPU, the reference on CPU)."""
    m = read_model_config(model_dir)
    h, inter, k = m.hidden_size, m.moe_intermediate_size, m.num_experts_per_tok
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    gen = torch.Generator(device=dev).manual_seed(0)
    actives = [a for a in ACTIVE if a <= m.num_experts]
    values = []
    for active in actives:
        w13 = torch.randn(active, 2 * inter, h, generator=gen, device=dev).to(dtype)
        w2 = torch.randn(active, h, inter, generator=gen, device=dev).to(dtype)
        row = []
        for rows in ROWS:
            tokens = max(1, rows // k)
            x = torch.randn(tokens, h, generator=gen, device=dev).to(dtype)
            ids = torch.randint(0, active, (tokens, k), generator=gen, device=dev)
            weights = torch.full((tokens, k), 1.0 / k, device=dev)
            fused_experts(x, weights, ids, w13, w2)  # warm (and compile)
            sync()
            t = time.perf_counter()
            for _ in range(reps):
                fused_experts(x, weights, ids, w13, w2)
            sync()
            row.append((time.perf_counter() - t) / reps * 1e6 * m.num_moe_layers)
        values.append(tuple(row))
    return Grid(tuple(float(a) for a in actives), tuple(float(r) for r in ROWS), tuple(values))


def step_ms(client, batch: int, prompt_len: int, seconds: float, vocab: int) -> tuple[float, float]:
    """Mean decode step (ms) of the layout's groups with `batch` long requests per DP rank,
    and the mean context they ran at."""
    params = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
    dp = client.dp
    ids = [f"b{batch}-{i}-{time.monotonic_ns()}" for i in range(dp * batch)]
    for i, rid in enumerate(ids):
        prompt = [(7 * i + j) % (vocab - 8) for j in range(prompt_len)]
        client.submit(rid, prompt, params, Placement(dp_group=i % dp))
    seen: dict[str, int] = {}
    while min((seen.get(r, 0) for r in ids), default=0) < 4:  # every request decoding
        for o in client.poll():
            seen[o.request_id] = seen.get(o.request_id, 0) + len(o.new_token_ids)
    first, t0 = client.leader_stats()["decode"], time.monotonic()
    end = t0 + seconds
    while time.monotonic() < end:
        client.poll()
    last, t1 = client.leader_stats()["decode"], time.monotonic()
    for rid in ids:
        client.abort(rid)
    per_group = client.dp // client.layout_groups
    leaders = range(0, client.dp, per_group)  # one DP leader per group: they step together
    steps = [last[g]["steps"] - first[g]["steps"] for g in leaders]
    ctx = sum(s["running_tokens"] for s in last) / max(1, sum(s["num_running"] for s in last))
    return (t1 - t0) * 1e3 / (sum(steps) / len(steps)), ctx


def settle(client, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        client.maintain()
        try:
            client.leader_stats()
            return
        except TimeoutError:
            time.sleep(0.1)
    raise TimeoutError("the layout did not settle")


def measure(model_dir: Path, batches: list[int], seconds: float, layouts: list, dp: int,
            tp: int, device: str) -> tuple[dict, float]:
    """{(width, batch): step ms} over `layouts`, and the mean context."""
    from phalanx import LLM
    llm = LLM(model_dir, dp=dp, tp=tp, ep_groups=dp, max_num_seqs=max(batches), page_size=16,
              num_pages=0 if device.startswith("cuda") else 2048, device=device,
              max_num_batched_tokens=1024)
    client, vocab = llm.cluster, llm.config.model.vocab_size
    steps, contexts = {}, []
    try:
        for layout in layouts:
            if client.layout != layout:
                client.reshape(layout)
            settle(client)
            for b in batches:
                ms, ctx = step_ms(client, b, 32, seconds, vocab)
                steps[(layout.width, b)] = ms
                contexts.append(ctx)
                print(f"  {layout}: batch {b}: {ms:.2f} ms/step at context {ctx:.0f}", flush=True)
                settle(client)
    finally:
        llm.close()
    return steps, sum(contexts) / len(contexts)


def fit_tables(steps: dict, experts: Grid, model, fit: list[int], ctx: float,
               widths: tuple[int, ...] = (1, 2, 4)) -> CostTables:
    """The tables from the `fit` batches (see the module docstring); `widths`: the
    layouts' ranks per group, narrowest (no exchange) first."""
    k, narrow = model.experts_per_token, widths[0]

    def expert_us(w, b):
        return experts.at(active_experts(model, w, b), b * k)

    attention = Grid(tuple(float(b) for b in fit), (ctx,), tuple(
        (max(0.0, steps[(narrow, b)] * 1e3 - expert_us(narrow, b)),) for b in fit))
    exchange = Grid(tuple(float(w) for w in widths), tuple(float(b) for b in fit), tuple(
        tuple(0.0 if w == narrow else max(0.0, steps[(w, b)] * 1e3 - attention.at(b, ctx)
                                          - expert_us(w, b)) for b in fit) for w in widths))
    zero = Grid((1.0,), (0.0,), ((0.0,),))
    return CostTables(exchange, experts, attention, zero,
                      source=f"bench/ep_width.py on {os.uname().nodename}, "
                             f"{time.strftime('%Y-%m-%d')}, CPU, batches {fit}")


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
        experts = expert_grid(model_dir, args.reps, args.device, dtype)
        steps, ctx = measure(model_dir, sorted(set(batches) | set(fit)), args.seconds, layouts,
                             args.dp, args.tp, args.device)
    tables = fit_tables(steps, experts, model, fit, ctx, tuple(lay.width for lay in layouts))
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
