"""EP width simulated: the `cost_model` policy over widths 1..128 on the Qwen3-30B-A3B and
DeepSeek-V3 shapes, with cost tables built from measured figures (`python bench/ep_width.py
--simulate`).

Where each figure comes from (H200 unless said; see bench/NOTES.md):
- memory bandwidth 4.27 TB/s (bench/decode_gpu.py's copy rate, 2026-12-03) at 0.82 of it
  (its decode steps ran at 0.79-0.84 of the byte floor at batch 16-128);
- step overhead 2.09 ms: the measured batch-1 step (3.54 ms) minus its byte floor (1.45 ms);
- dispatch + combine inside a node (width <= 8): two rounds of the peer exchange
  (bench/peer_exchange.py, "average" blocks, ranks as streams of one H200, 2026-12-03),
  fitted as latency + bytes / bandwidth per round;
- across nodes: seed 001 (H100, InfiniBand): EP128 at 256 tokens per rank, dispatch 593
  µs + combine 1012 µs per layer (FP8 dispatch, bf16 combine, hidden 7168), i.e. an
  effective 27 GB/s per GPU for the bytes that leave the node (a fraction (W - 8) / W of
  them at width W);
- expert and dense time: bytes read per step (the active experts' weights, the dense
  weights, the KV of the batch) over the bandwidth; compute is not the bound at decode.
Memory per GPU: 141 GB at 0.9. Prints the chosen width by batch per rank, the crossovers,
writes $OUT/ep_width_sim.json and, with matplotlib, $OUT/ep_width_sim.png.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import multi_gpu_model
from phalanx.actors.ep_control import model_numbers
from phalanx.config import ModelConfig
from phalanx.policies.ep_cost import CostTables, Grid, ModelNumbers
from phalanx.policies.ep_width import (EPInputs, EPLayout, OfferedLoad, RankPool, estimate,
                                       make_ep_width_policy)

BW = 4.27e12 * 0.82  # bytes/s actually read per GPU
OVERHEAD_US = 3540.0 - 1447.0
NODE = 8
WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128)
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# bench/peer_exchange.py, "average" blocks: (world, tokens per rank) -> (bytes, µs) per round
PEER_ROUNDS = {(2, 16): (1052672, 16.94), (2, 64): (4210688, 24.96), (2, 128): (8421376, 29.07),
               (4, 16): (2105344, 25.55), (4, 64): (8421376, 30.40), (4, 128): (16842752, 38.75),
               (8, 16): (4210688, 33.78), (8, 64): (16842752, 42.56), (8, 128): (33685504, 61.62)}
SEED_EP128_US, SEED_TOKENS, SEED_SLOT_BYTES = 593.0 + 1012.0, 256, 7168 * (1 + 2)
IB_BW = SEED_TOKENS * 8 * SEED_SLOT_BYTES / (SEED_EP128_US * 1e-6)

QWEN3_30B_A3B = model_numbers(ModelConfig.from_hf(multi_gpu_model.QWEN3_30B_A3B), 2)
# 671B parameters in FP8, of which 58 MoE layers x 256 routed experts x 3 x 7168 x 2048;
# MLA KV 70,272 bytes per token (seed 001).
DEEPSEEK_V3 = ModelNumbers(num_experts=256, experts_per_token=8, moe_layers=58,
                           expert_bytes=3 * 7168 * 2048,
                           dense_bytes=671_000_000_000 - 58 * 256 * 3 * 7168 * 2048,
                           kv_bytes_per_token=70_272)
MODELS = {"qwen3-30b-a3b": (QWEN3_30B_A3B, 2048 * 2, 2048),
          "deepseek-v3": (DEEPSEEK_V3, 7168 * 3 / 2, 5000)}  # (model, slot bytes/round, ctx)


def _fit_rounds() -> tuple[float, float]:
    """Latency (µs) and bandwidth (bytes/µs) of one exchange round, least squares."""
    xs = [b for b, _ in PEER_ROUNDS.values()]
    ys = [us for _, us in PEER_ROUNDS.values()]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, 1.0 / slope


def tables(model: ModelNumbers, slot_bytes: float) -> CostTables:
    latency, nvl = _fit_rounds()
    k, layers = model.experts_per_token, model.moe_layers
    tokens = (1.0, 64.0, 256.0, 1024.0)

    def exchange_us(w: int, t: float) -> float:
        if w == 1:
            return 0.0
        moved = t * k * slot_bytes * (w - 1) / w  # what leaves the rank, both ways summed
        inter = max(0.0, (w - NODE) / w)
        per_round = latency + moved * (1 - inter) / nvl + moved * inter / IB_BW * 1e6
        return 2 * per_round * layers

    exchange = Grid(tuple(float(w) for w in WIDTHS), tokens,
                    tuple(tuple(exchange_us(w, t) for t in tokens) for w in WIDTHS))
    e = float(model.num_experts)
    per_expert = model.expert_bytes * layers / BW * 1e6
    experts = Grid((0.0, e), (0.0, 1e6), ((0.0, 0.0), (e * per_expert, e * per_expert)))
    dense = model.dense_bytes / BW * 1e6
    kv = model.kv_bytes_per_token / BW * 1e6
    attention = Grid((0.0, 1024.0), (0.0, 1e5), ((dense, dense), (dense, dense + kv * 1024 * 1e5)))
    overhead = Grid((1.0,), (0.0,), ((OVERHEAD_US,),))
    return CostTables(exchange, experts, attention, overhead,
                      source="bench/ep_width_sim.py: H200 figures of bench/NOTES.md, seed 001")


def simulate(name: str, itl_target_ms: float) -> dict:
    model, slot_bytes, ctx = MODELS[name]
    t = tables(model, slot_bytes)
    pool = RankPool(128, ranks_per_node=NODE, memory_bytes=int(141e9 * 0.9), max_seqs=256)
    rows = []
    for b in BATCHES:
        load = OfferedLoad((b,) * 128, (0,) * 128, (0,) * 128, float(ctx))
        widest = EPLayout(128, 1)
        inputs = EPInputs(pool, model, load, t, widest)
        policy = make_ep_width_policy("cost_model", {"itl_target_ms": itl_target_ms,
                                                     "margin": 0.0, "min_interval_s": 0.0})
        d = policy.decide(inputs)
        per_width = {e.layout.width: (round(e.tokens_per_s_per_rank, 1) if e.fits else None,
                                      round(e.step_us / 1e3, 2) if e.fits else None)
                     for e in (estimate(inputs, EPLayout(w, 128 // w)) for w in WIDTHS)}
        rows.append({"batch": b, "chosen_width": d.layout.width, "per_width": per_width,
                     "reason": d.reason})
    crossovers = [(a["batch"], b["batch"], a["chosen_width"], b["chosen_width"])
                  for a, b in zip(rows, rows[1:]) if a["chosen_width"] != b["chosen_width"]]
    return {"model": name, "context": ctx, "itl_target_ms": itl_target_ms, "rows": rows,
            "crossovers": crossovers}


def plot(results: list[dict], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5))
    for ax, r in zip(axes, results):
        for w in WIDTHS:
            pts = [(row["batch"], row["per_width"][w][0]) for row in r["rows"]
                   if row["per_width"][w][0] is not None]
            if pts:
                ax.plot(*zip(*pts), marker=".", label=f"EP{w}")
        chosen = [(row["batch"], row["per_width"][row["chosen_width"]][0]) for row in r["rows"]
                  if row["per_width"][row["chosen_width"]][0] is not None]
        ax.scatter(*zip(*chosen), s=80, facecolors="none", edgecolors="k", label="policy's pick")
        ax.set(xscale="log", yscale="log", xlabel="sequences per GPU",
               ylabel="output tokens/s per GPU", title=f"{r['model']}, ctx {r['context']}, "
               f"ITL <= {r['itl_target_ms']:g} ms")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> int:
    out = Path(os.environ.get("OUT", "."))
    results = [simulate(name, itl) for name in MODELS for itl in (50.0,)]
    (out / "ep_width_sim.json").write_text(json.dumps(results, indent=1))
    drew = plot(results, out / "ep_width_sim.png")
    latency, nvl = _fit_rounds()
    print(f"exchange round fit: {latency:.1f} µs + bytes / {nvl * 1e6 / 1e9:.0f} GB/s in a node; "
          f"across nodes {IB_BW / 1e9:.0f} GB/s (seed 001)")
    for r in results:
        print(f"\n{r['model']} (ctx {r['context']}, ITL <= {r['itl_target_ms']:g} ms), 128 GPUs:")
        print("| batch/GPU | chosen EP | " + " | ".join(f"EP{w} tok/s (ms)" for w in WIDTHS) + " |")
        print("|---" * (len(WIDTHS) + 2) + "|")
        for row in r["rows"]:
            cells = ["-" if tps is None else f"{tps:.0f} ({ms})"
                     for tps, ms in (row["per_width"][w] for w in WIDTHS)]
            print(f"| {row['batch']} | {row['chosen_width']} | " + " | ".join(cells) + " |")
        print("crossovers (batch a -> b: width a -> b):", r["crossovers"] or "none")
    print(f"\nJSON: {out / 'ep_width_sim.json'}" + (f"; plot: {out / 'ep_width_sim.png'}" if drew
                                                   else "; no plot (pip install matplotlib)"))
    return 0
