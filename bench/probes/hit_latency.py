"""Why a prefix hit's first token can take longer than a miss's at batch 1 (issue 31:
"prefix hits never slower than misses"): the engine in this process, one GPU, the
Qwen3-30B-A3B shape with `--layers` layers and random weights (`load_format="dummy"`).

Per prompt: a miss (fresh `--prompt-len` tokens), the same prompt again (a hit: all but
the last page cached, so one page is computed), and a fresh prompt of one page (the same
work as the hit without a cached prefix). For each: the wall time from `add_request` to
the first token (device synchronised), the steps it took, and the host time of those
steps. Then one of each under `torch.profiler`: host time per operator and kernel time,
the launch and synchronisation counts (tables under $OUT).

    python bench/probes/hit_latency.py --layers 48
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH))

import torch  # noqa: E402

from disagg_checkpoint import write_config  # noqa: E402
from multi_gpu_model import QWEN3_30B_A3B  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def first_token(engine, rid: str, prompt: list[int], params) -> dict:
    sync()
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, params)
    steps, host = 0, 0.0
    while not engine.sequences[rid].output_token_ids:
        s = time.perf_counter()
        engine.step()
        host += time.perf_counter() - s
        steps += 1
    sync()
    wall = (time.perf_counter() - t0) * 1e3
    cached = engine.sequences[rid].num_cached_tokens
    engine.abort_request(rid)
    while engine.has_unfinished():
        engine.step()
    return {"ms": wall, "steps": steps, "host_ms": host * 1e3, "cached": cached}


def profiled(engine, rid: str, prompt: list[int], params, out: Path, tag: str) -> dict:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        r = first_token(engine, rid, prompt, params)
    ev = prof.key_averages()
    (out / f"profile_{tag}.txt").write_text(
        ev.table(sort_by="self_cpu_time_total", row_limit=40) + "\n\n"
        + ev.table(sort_by="self_device_time_total", row_limit=30))
    count = {e.key: e.count for e in ev}
    kernel_us = sum(e.self_device_time_total for e in ev if e.device_type.name == "CUDA")
    r.update(launches=count.get("cudaLaunchKernel", 0) + count.get("cuLaunchKernel", 0)
             + count.get("cuLaunchKernelEx", 0),
             syncs=count.get("cudaStreamSynchronize", 0) + count.get("cudaDeviceSynchronize", 0)
             + count.get("cudaEventSynchronize", 0),
             memcpy=count.get("cudaMemcpyAsync", 0), kernel_ms=kernel_us / 1e3)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "."))
    from phalanx import SamplingParams
    from phalanx.engine.llm_engine import LLMEngine
    from phalanx.llm import engine_config
    from serve import write_id_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = dict(QWEN3_30B_A3B, num_hidden_layers=args.layers)
        write_config(Path(tmp), cfg)
        write_id_tokenizer(Path(tmp), cfg["vocab_size"])
        config = engine_config(tmp, device=args.device, max_num_seqs=64, max_model_len=4096,
                               load_format="dummy")
        t = time.perf_counter()
        engine = LLMEngine(config)
        engine.warm_up()
        print(f"engine ready in {time.perf_counter() - t:.1f} s", flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    vocab, page = cfg["vocab_size"], config.cache.page_size
    rows: dict[str, list[dict]] = {"miss": [], "hit": [], "one page": []}
    for i in range(args.prompts):
        prompt = torch.randint(3, vocab - 3, (args.prompt_len,), generator=g).tolist()
        rows["miss"].append(first_token(engine, f"m{i}", prompt, params))
        rows["hit"].append(first_token(engine, f"h{i}", prompt, params))
        short = torch.randint(3, vocab - 3, (page,), generator=g).tolist()
        rows["one page"].append(first_token(engine, f"s{i}", short, params))
    prompt = torch.randint(3, vocab - 3, (args.prompt_len,), generator=g).tolist()
    prof = {"miss": profiled(engine, "pm", prompt, params, out, "miss"),
            "hit": profiled(engine, "ph", prompt, params, out, "hit"),
            "one page": profiled(engine, "ps", prompt[:page][::-1], params, out, "page")}
    (out / "hit_latency.json").write_text(json.dumps({"rows": rows, "profiled": prof}, indent=1))
    print("| kind | first token ms (median) | steps | host ms | cached | profiled: ms, kernel ms, "
          "launches, syncs, memcpy |")
    print("|---|---|---|---|---|---|")
    for kind, rs in rows.items():
        med = sorted(r["ms"] for r in rs)[len(rs) // 2]
        host = sorted(r["host_ms"] for r in rs)[len(rs) // 2]
        p = prof[kind]
        print(f"| {kind} | {med:.1f} | {rs[0]['steps']} | {host:.1f} | {rs[0]['cached']} | "
              f"{p['ms']:.1f}, {p['kernel_ms']:.1f}, {p['launches']}, {p['syncs']}, "
              f"{p['memcpy']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
