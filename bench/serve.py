"""Serving benchmark in the manner of `vllm bench serve` (issue 31): what a user of the
HTTP server sees, beside what the engine alone does at the same batch.

    python bench/serve.py                                   # tiny model, CPU, a quick look
    python bench/serve.py --device cuda --random-shape --layers 48 \\
        --concurrency 1,16,64 --rates 8,32 --prompt-len 512 --max-tokens 256
    python bench/serve.py --url http://127.0.0.1:8000 --model NAME --no-engine

It starts `phalanx serve MODEL --tp 1 --dp 1` (one in-process engine; or measures the
server at `--url`) and, in this order:

1. cold: the largest concurrency's prompts sent at once right after the ready line (the
   first requests a user sends; nothing compiles after ready is what makes them as fast
   as later ones);
2. per `--concurrency` C, closed loop (C clients, each sending its next request when the
   last one ends): fresh random prompts (prefix misses), then the same prompts again
   (prefix hits);
3. per `--rates` R, open loop: Poisson arrivals at R requests/s;
4. a shared-prefix multi-turn trace (`--conversations` conversations of `--turns` turns
   over `--system-prompts` shared system prompts; each turn resends the conversation so
   far, the server's replies included).

Every request streams `--max-tokens` tokens (EOS ignored). Per run: output tok/s, TTFT,
ITL and end-to-end p50/p90/p99. Then, with the server stopped, the same folder in an
in-process engine (`--no-engine` skips it): the decode step at each concurrency's batch
and the prefill of that many prompts, the baseline of the ratios (ITL p50 / engine step:
the serving overhead per token; TTFT p99 / batch prefill). A table last, JSON and a PNG
(output tok/s against ITL p50) under $OUT (or .).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serve_load import (closed_loop, multi_turn, open_loop, random_prompts,  # noqa: E402
                        summarize)

READY = re.compile(r"phalanx: serving (\S+) at (http://\S+) ")
STARTED = re.compile(r"started in ([0-9.]+) s")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the tiny model)")
    ap.add_argument("--random-shape", action="store_true",
                    help="a random-weight checkpoint of the Qwen3-30B-A3B shape (--layers)")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--load-format", choices=("auto", "dummy"), default=None,
                    help="the server's --load-format (default: dummy with --random-shape, "
                         "whose folder then holds no weights: 48 layers are 61 GB in bf16)")
    ap.add_argument("--cuda-graph-max-prefill", type=int, default=None,
                    help="the server's --cuda-graph-max-prefill (default: its own)")
    ap.add_argument("--url", default=None, help="measure this server instead of starting one")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--rates", default="", help="open-loop request rates per second")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=0,
                    help="requests per run (default: 4 x concurrency, at least 8)")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-prompts", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=0, help="default: the largest level")
    ap.add_argument("--max-model-len", type=int, default=0)
    ap.add_argument("--no-engine", action="store_true", help="skip the engine baseline")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=900.0, help="server start-up limit")
    return ap.parse_args(argv)


# ---------------------------------------------------------------- the server


class Server:
    """`phalanx serve` in a subprocess (output to files), started and stopped."""

    def __init__(self, folder: str, args, out_dir: Path) -> None:
        levels = [int(c) for c in args.concurrency.split(",")]
        cmd = [sys.executable, "-m", "phalanx.cli", "serve", folder, "--tp", "1", "--dp", "1",
               "--device", args.device, "--port", "0", "--quiet",
               "--max-num-seqs", str(args.max_num_seqs or max(levels))]
        if args.max_model_len:
            cmd += ["--max-model-len", str(args.max_model_len)]
        if args.load_format:
            cmd += ["--load-format", args.load_format]
        if args.cuda_graph_max_prefill is not None:
            cmd += ["--cuda-graph-max-prefill", str(args.cuda_graph_max_prefill)]
        self.err = out_dir / "serve.err"
        self.out = out_dir / "serve.out"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                         env=env)
        self.url = self.model = None
        self.startup_s = float("nan")

    def wait_ready(self, limit_s: float) -> None:
        end = time.monotonic() + limit_s
        while time.monotonic() < end:
            m = READY.search(self.out.read_text(errors="replace"))
            if m:
                self.model, self.url = m.group(1), m.group(2)
                s = STARTED.search(self.err.read_text(errors="replace"))
                self.startup_s = float(s.group(1)) if s else float("nan")
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise SystemExit(f"server not ready (rc={self.proc.poll()}):\n"
                         f"{self.err.read_text(errors='replace')[-3000:]}")

    @classmethod
    def started(cls, folder: str, args, out_dir: Path, limit_s: float) -> "Server":
        """A server past its ready line (stopped again if it does not get there)."""
        server = cls(folder, args, out_dir)
        try:
            server.wait_ready(limit_s)
        except BaseException:
            server.stop()
            raise
        print(f"server ready: {server.url} ({server.model}), started in "
              f"{server.startup_s:.1f} s", flush=True)
        return server

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def random_shape_folder(folder: Path, layers: int, seed: int, device: str,
                        load_format: str) -> str:
    """The Qwen3-30B-A3B shape with random weights (written, or with "dummy" drawn by the
    server as it loads: the same tensors for seed 0) and a tokenizer of one token per id
    ("<i>"), so any id streams back as text."""
    import torch
    from disagg_checkpoint import write_checkpoint, write_config
    from multi_gpu_model import QWEN3_30B_A3B
    cfg = dict(QWEN3_30B_A3B, num_hidden_layers=layers)
    if load_format == "dummy":
        write_config(folder, cfg)
    else:
        write_checkpoint(folder, cfg, seed, torch.device("cuda" if device.startswith("cuda") else "cpu"))
    write_id_tokenizer(folder, cfg["vocab_size"])
    return str(folder)


def write_id_tokenizer(folder: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab)}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<0>", "pad_token": "<0>"}))


# ---------------------------------------------------------------- the engine alone


def engine_baseline(folder: str, args, levels: list[int]) -> dict[int, dict]:
    """Per batch C: the decode step (ms) with C sequences at the runs' mean context, and
    the prefill of C fresh prompts (ms), on an engine in this process."""
    import torch
    from phalanx import SamplingParams
    from phalanx.engine.llm_engine import LLMEngine
    from phalanx.llm import engine_config
    from serve_load import random_prompts as prompts_of
    cfg = engine_config(folder, device=args.device, max_num_seqs=args.max_num_seqs or max(levels),
                        max_model_len=args.max_model_len, load_format=args.load_format or "auto",
                        **({} if args.cuda_graph_max_prefill is None
                           else {"cuda_graph_max_prefill": args.cuda_graph_max_prefill}))
    engine = LLMEngine(cfg)
    engine.warm_up()
    vocab = cfg.model.vocab_size
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    out = {}
    for c in levels:
        reqs = prompts_of(c, args.prompt_len, vocab, args.seed + 1000 + c, 0)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens + 64, ignore_eos=True)
        rids = [f"e{c}-{i}" for i in range(c)]
        sync()
        t = time.perf_counter()
        for rid, r in zip(rids, reqs):
            engine.add_request(rid, list(r.prompt), params)
        while any(not engine.sequences[r].output_token_ids for r in rids):
            engine.step()
        sync()
        prefill_ms = (time.perf_counter() - t) * 1e3
        for _ in range(args.max_tokens // 2):  # to the runs' mean context
            engine.step()
        steps = 16
        sync()
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        out[c] = {"step_ms": (time.perf_counter() - t) / steps * 1e3, "prefill_ms": prefill_ms}
        for rid in rids:
            engine.abort_request(rid)
        while engine.has_unfinished():
            engine.step()
        print(f"engine: batch {c}: step {out[c]['step_ms']:.2f} ms, prefill "
              f"{out[c]['prefill_ms']:.1f} ms", flush=True)
    return out


# ---------------------------------------------------------------- runs


def run_all(url: str, model: str, args, vocab: int) -> dict:
    levels = [int(c) for c in args.concurrency.split(",")]
    rates = [float(r) for r in args.rates.split(",") if r]
    n_of = (lambda c: args.requests or max(8, 4 * c))
    runs: dict = {"closed": [], "open": []}

    def report(name: str, results, wall) -> dict:
        s = summarize(results, wall)
        print(f"{name}: {s['output_tok_s']:.1f} tok/s, TTFT p50 {s['ttft_p50_ms']:.1f} / p99 "
              f"{s['ttft_p99_ms']:.1f} ms, ITL p50 {s['itl_p50_ms']:.2f} ms, errors "
              f"{s['errors']}", flush=True)
        return s

    top = max(levels)
    cold = random_prompts(top, args.prompt_len, vocab, args.seed + 1, args.max_tokens, "cold")
    runs["cold"] = report("cold (right after ready)", *asyncio.run(
        closed_loop(url, model, [[r] for r in cold], top)))
    for c in levels:
        reqs = random_prompts(n_of(c), args.prompt_len, vocab, args.seed + 10 + c,
                              args.max_tokens)
        miss = report(f"c={c} misses", *asyncio.run(closed_loop(url, model, [[r] for r in reqs], c)))
        hit = report(f"c={c} hits", *asyncio.run(closed_loop(url, model, [[r] for r in reqs], c)))
        runs["closed"].append({"concurrency": c, "miss": miss, "hit": hit})
    for rate in rates:
        reqs = random_prompts(n_of(int(rate) + 1), args.prompt_len, vocab,
                              args.seed + 5000 + int(rate), args.max_tokens)
        runs["open"].append({"rate": rate, **report(f"rate {rate}/s", *asyncio.run(
            open_loop(url, model, reqs, rate, args.seed)))})
    convos = multi_turn(args.conversations, args.turns, args.system_prompts, args.prompt_len,
                        max(16, args.prompt_len // 8), args.max_tokens, vocab, args.seed + 7)
    results, wall = asyncio.run(closed_loop(url, model, convos, min(top, args.conversations)))
    trace = report("multi-turn trace", results, wall)
    prompt_tokens = sum(len(r.request.prompt) for r in results if r.request.prompt)
    trace["cached_tokens"] = sum(r.cached_tokens for r in results)
    trace["later_turn_ttft_p50_ms"] = summarize(
        [r for r in results if r.request.tag != "turn0"], wall)["ttft_p50_ms"]
    trace["first_turn_ttft_p50_ms"] = summarize(
        [r for r in results if r.request.tag == "turn0"], wall)["ttft_p50_ms"]
    trace["first_turn_prompt_tokens"] = prompt_tokens
    runs["trace"] = trace
    return runs


def plot(runs: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    pts = [(r["miss"]["itl_p50_ms"], r["miss"]["output_tok_s"], f"c={r['concurrency']}")
           for r in runs["closed"]]
    pts += [(r["itl_p50_ms"], r["output_tok_s"], f"{r['rate']:g}/s") for r in runs["open"]]
    ax.plot([p[0] for p in pts[:len(runs["closed"])]], [p[1] for p in pts[:len(runs["closed"])]],
            "o-", label="closed loop")
    if runs["open"]:
        ax.plot([p[0] for p in pts[len(runs["closed"]):]], [p[1] for p in pts[len(runs["closed"]):]],
                "s--", label="Poisson")
    for x, y, label in pts:
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("ITL p50 (ms)")
    ax.set_ylabel("output tokens/s")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def table(runs: dict, engine: dict) -> list[str]:
    lines = ["| run | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | e2e p50 ms | engine step ms "
             "| ITL p50 / step | hits: TTFT p50 / p99 ms |", "|---|---|---|---|---|---|---|---|"]
    c0 = runs["cold"]
    lines.append(f"| cold | {c0['output_tok_s']:.1f} | {c0['ttft_p50_ms']:.1f} / "
                 f"{c0['ttft_p99_ms']:.1f} | {c0['itl_p50_ms']:.2f} / {c0['itl_p99_ms']:.2f} | "
                 f"{c0['e2e_p50_ms']:.0f} | | | |")
    for r in runs["closed"]:
        m, h, e = r["miss"], r["hit"], engine.get(r["concurrency"], {})
        step = e.get("step_ms", float("nan"))
        lines.append(f"| c={r['concurrency']} | {m['output_tok_s']:.1f} | {m['ttft_p50_ms']:.1f} / "
                     f"{m['ttft_p99_ms']:.1f} | {m['itl_p50_ms']:.2f} / {m['itl_p99_ms']:.2f} | "
                     f"{m['e2e_p50_ms']:.0f} | {step:.2f} | {m['itl_p50_ms'] / step:.3f} | "
                     f"{h['ttft_p50_ms']:.1f} / {h['ttft_p99_ms']:.1f} |")
    for r in runs["open"]:
        lines.append(f"| {r['rate']:g}/s | {r['output_tok_s']:.1f} | {r['ttft_p50_ms']:.1f} / "
                     f"{r['ttft_p99_ms']:.1f} | {r['itl_p50_ms']:.2f} / {r['itl_p99_ms']:.2f} | "
                     f"{r['e2e_p50_ms']:.0f} | | | |")
    t = runs["trace"]
    lines.append(f"| trace | {t['output_tok_s']:.1f} | {t['ttft_p50_ms']:.1f} / "
                 f"{t['ttft_p99_ms']:.1f} | {t['itl_p50_ms']:.2f} / {t['itl_p99_ms']:.2f} | "
                 f"{t['e2e_p50_ms']:.0f} | | | later turns {t['later_turn_ttft_p50_ms']:.1f} "
                 f"(first {t['first_turn_ttft_p50_ms']:.1f}) |")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.load_format is None and args.random_shape:
        args.load_format = "dummy"
    out_dir = Path(os.environ.get("OUT", "."))
    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="serve_bench_") as tmp:
        folder = args.model
        if args.random_shape:
            folder = random_shape_folder(Path(tmp), args.layers, args.seed, args.device,
                                         args.load_format)
        elif folder is None and args.url is None:
            from phalanx.models.tiny import default_model_dir
            folder = str(default_model_dir())
        server = None
        if args.url is None:
            server = Server.started(folder, args, out_dir, args.timeout_s)
            url, model = server.url, server.model
        else:
            url, model = args.url.rstrip("/"), args.model
        try:
            vocab = _vocab(folder) if folder else 32000
            runs = run_all(url, model, args, vocab)
        finally:
            if server is not None:
                server.stop()
        engine = {} if args.no_engine or folder is None else engine_baseline(folder, args, levels)
    result = {"args": vars(args), "startup_s": server.startup_s if server else None,
              "runs": runs, "engine": engine}
    (out_dir / "serve.json").write_text(json.dumps(result, indent=1, default=str))
    png = plot(runs, out_dir / "serve.png")
    print(f"\nJSON: {out_dir / 'serve.json'}" + (f"; plot: {out_dir / 'serve.png'}" if png else ""))
    print("\n".join(table(runs, engine)))
    return 0


def _vocab(folder: str) -> int:
    return json.loads((Path(folder) / "config.json").read_text())["vocab_size"]


if __name__ == "__main__":
    sys.exit(main())
