"""The disaggregated layout end to end on the Qwen3-30B-A3B shape with random weights:
prefill TP=T instances stream each prompt's KV over UCX to a decode DP=D × EP=D group,
through the real serving path (`LLM(prefill_tp=T, decode_dp=D)`: Ray rank actors, the
planner, the transport, the DP agreement and the MoE exchange), against the single-GPU
engine on the same checkpoint.

    python bench/disagg.py [--prefill-tp 4] [--decode-dp 4] [--layers 4] [--batches 16,64,128]
    python bench/disagg.py --device cpu --tiny     # the same code paths at toy sizes

1. checkpoint: a random-weight Hugging Face folder of the shape with `--layers` layers
   (bench/disagg_checkpoint.py), stored in bfloat16 (tiny: float32), in a temp folder.
2. single (one spawned process, GPU 0): the greedy tokens of `--check-prompts` prompts
   (16-200 random tokens, `--max-new` each) for each of `--check-dtypes`.
3. disagg (Ray rank actors, one GPU each): per dtype, the same prompts through the layout;
   tokens equal the single engine's (`--check-pass-dtype` must be equal on every prompt;
   the others are reported: bfloat16 sums in other orders may flip a near tie). Then,
   in the first dtype, the load: per batch B of `--batches`, B × D requests (prompts of
   `--ctx` random tokens, EOS ignored, at most `--max-tokens` each) submitted at once,
   each token's arrival timed at the caller, until every request has decoded `--new`
   tokens since the last one's first token; the rest are aborted.
Figures per batch: TTFT median and max (submission to first token, the queue behind the
other prefills included); decode tokens/s per decode GPU over that window, where all
B × D requests decode at once (flagged incomplete if one hit `--max-tokens` in it);
prefill tokens/s per prefill GPU (prompt tokens over the time to the last first token);
the KV bytes one request moves. Ranks: T × `--prefill-instances` + D, one GPU each; with `--share-gpus`
they wrap onto the GPUs present (Ray is told there are as many as ranks): a dry run of
the code paths whose times are no figures. Prints a table last; writes JSON to
$OUT/disagg.json (or ./disagg.json).
"""

from __future__ import annotations

import argparse
import bisect
import json
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from typing import Callable, Optional

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1",
               "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}.items():
    os.environ.setdefault(_k, _v)  # multicast stays off on the GPU machine

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from disagg_checkpoint import write_checkpoint  # noqa: E402
from multi_gpu_model import QWEN3_30B_A3B, TINY  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="toy dimensions (CPU)")
    ap.add_argument("--prefill-tp", type=int, default=None, help="prefill TP (4; tiny 2)")
    ap.add_argument("--prefill-instances", type=int, default=1)
    ap.add_argument("--decode-dp", type=int, default=None, help="decode DP=EP (4; tiny 2)")
    ap.add_argument("--layers", type=int, default=None, help="model layers (4; tiny 2)")
    ap.add_argument("--batches", default=None, help="requests per decode rank (16,64,128; tiny 2)")
    ap.add_argument("--ctx", type=int, default=None, help="load prompt tokens (1024; tiny 32)")
    ap.add_argument("--new", type=int, default=None,
                    help="load: tokens per request timed once all decode (32; tiny 4)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="load: cap per request, covering the decode while the other "
                         "prompts are prefilled (4096; tiny 64)")
    ap.add_argument("--check-prompts", type=int, default=None, help="max(4, D)")
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--check-dtypes", default=None, help="bfloat16,float32 (tiny float32)")
    ap.add_argument("--check-pass-dtype", default="float32")
    ap.add_argument("--ep-exchange", choices=("exact", "padded", "peer"), default="exact")
    ap.add_argument("--share-gpus", action="store_true")
    ap.add_argument("--num-pages", type=int, default=0,
                    help="KV pages per rank (0: from free memory; --share-gpus: from the load)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--deadline-s", type=float, default=60.0, help="collectives and transfers")
    ap.add_argument("--timeout-s", type=float, default=540.0, help="whole run, then give up")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    tiny = args.tiny
    for name, t, g in (("prefill_tp", 2, 4), ("decode_dp", 2, 4), ("layers", 2, 4),
                       ("batches", "2", "16,64,128"), ("ctx", 32, 1024), ("new", 4, 32),
                       ("max_tokens", 64, 4096),
                       ("check_dtypes", "float32", "bfloat16,float32")):
        if getattr(args, name) is None:
            setattr(args, name, t if tiny else g)
    args.batches = [int(b) for b in str(args.batches).split(",")]
    args.check_dtypes = args.check_dtypes.split(",")
    if args.check_prompts is None:
        args.check_prompts = max(4, args.decode_dp)
    return args


def hf_config(args) -> dict:
    shape = TINY if args.tiny else QWEN3_30B_A3B
    return dict(shape, num_hidden_layers=args.layers,
                dtype="float32" if args.tiny else "bfloat16",
                max_position_embeddings=max(shape["max_position_embeddings"], 2 * args.ctx))


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def engine_kwargs(args, dtype: str) -> dict:
    pages = args.num_pages
    if not pages and (args.share_gpus or args.device == "cpu"):  # a share of one device
        per_req = -(-(max(args.ctx, 200) + max(args.max_tokens, args.max_new)) // args.page_size)
        pages = max(args.batches) * per_req + 64
    return dict(device=args.device, dtype=dtype, page_size=args.page_size, num_pages=pages,
                max_num_seqs=max(max(args.batches), args.check_prompts),
                max_num_batched_tokens=max(2048, args.ctx), seed=args.seed)


# ------------------------------------------------------------------ driving requests

def drive(submit, poll, requests: dict[str, tuple[list[int], object]], timeout_s: float,
          until: Optional[Callable[[dict], bool]] = None) -> tuple[dict[str, dict], set]:
    """Submit every request at once and poll until all finish or `until(runs)` holds:
    (per request its tokens, the caller's clock at submission and at each token's
    arrival, and the arrival of its last token if it finished; the unfinished ids)."""
    out = {rid: {"tokens": [], "times": [], "finished": None} for rid in requests}
    t_submit = time.perf_counter()
    for rid, (tokens, params) in requests.items():
        submit(rid, tokens, params)
        out[rid]["submit"] = t_submit
    pending, end = set(requests), t_submit + timeout_s
    while pending and not (until and until(out)):
        if time.perf_counter() > end:
            raise TimeoutError(f"{len(pending)} of {len(requests)} requests unfinished "
                               f"after {timeout_s:.0f} s")
        for o in poll():
            rec = out.get(o.request_id)
            if rec is None:
                continue
            now = time.perf_counter()
            rec["tokens"].extend(o.new_token_ids)
            rec["times"].extend([now] * len(o.new_token_ids))
            if o.finished:
                rec["finished"] = now
                pending.discard(o.request_id)
    return out, pending


def decode_window(runs: dict[str, dict], new: int) -> Optional[tuple[float, float, bool]]:
    """The window in which every request is decoding: from the last first token until
    every request has `new` more tokens (complete) or one finishes first (not): (start,
    stop, complete); None while that is not known yet (a request without its first
    token, or one still decoding short of its `new` tokens)."""
    if any(not r["times"] for r in runs.values()):
        return None
    start = max(r["times"][0] for r in runs.values())
    stop, complete = start, True
    for r in runs.values():
        k = bisect.bisect_right(r["times"], start) + new - 1
        if k < len(r["times"]):
            stop = max(stop, r["times"][k])
        elif r["finished"] is None:
            return None
        else:
            complete = False
    ends = [r["finished"] for r in runs.values() if r["finished"] is not None]
    return start, min([stop, *ends]), complete and all(e >= stop for e in ends)


def greedy_requests(prompts, max_new: int, prefix: str) -> dict:
    from phalanx import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    return {f"{prefix}{i}": (p, params) for i, p in enumerate(prompts)}


def load_figures(runs: dict[str, dict], new: int, decode_gpus: int, prefill_gpus: int) -> dict:
    """TTFT, decode tokens/s per GPU in the all-decoding window, prefill tokens/s per GPU."""
    t0 = min(r["submit"] for r in runs.values())
    ttft = sorted(r["times"][0] - t0 for r in runs.values())
    start, stop, complete = decode_window(runs, new)
    in_window = sum(bisect.bisect_right(r["times"], stop) - bisect.bisect_right(r["times"], start)
                    for r in runs.values())
    prompt_tokens = sum(r["prompt"] for r in runs.values())
    return {"requests": len(runs), "ttft_ms_median": 1e3 * statistics.median(ttft),
            "ttft_ms_max": 1e3 * ttft[-1], "window_s": stop - start,
            "window_tokens": in_window, "window_complete": complete,
            "decode_tok_s_per_gpu": (in_window / (stop - start) / decode_gpus
                                     if stop > start else None),
            "prefill_tok_s_per_gpu": prompt_tokens / (start - t0) / prefill_gpus}


# ------------------------------------------------------------------ phases

def single_tokens(model_dir: str, args, prompts) -> dict:
    """(spawned process) The single-rank engine's greedy tokens per dtype."""
    from phalanx.engine.llm_engine import LLMEngine
    from phalanx.llm import engine_config
    result = {}
    for dtype in args.check_dtypes:
        engine = LLMEngine(engine_config(model_dir, **engine_kwargs(args, dtype)))
        runs, _ = drive(engine.add_request, engine.step,
                        greedy_requests(prompts, args.max_new, "check"), args.timeout_s / 3)
        result[dtype] = [runs[f"check{i}"]["tokens"] for i in range(len(prompts))]
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return result


def run_single(model_dir: str, args, prompts) -> dict:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(single_tokens, (model_dir, args, prompts))


def run_disagg(model_dir: str, args, prompts, reference: dict, bytes_per_token: int) -> dict:
    from phalanx import LLM, SamplingParams
    result = {"check": {}, "load": {}}
    for n, dtype in enumerate(args.check_dtypes):
        t = time.monotonic()
        llm = LLM(model_dir, prefill_tp=args.prefill_tp, decode_dp=args.decode_dp,
                  prefill_instances=args.prefill_instances, ep_exchange=args.ep_exchange,
                  collective_timeout_s=args.deadline_s, **engine_kwargs(args, dtype))
        print(f"layout formed ({dtype}): {time.monotonic() - t:.1f} s", flush=True)
        try:
            client = llm.cluster
            runs, _ = drive(client.submit, client.poll,
                            greedy_requests(prompts, args.max_new, "check"), args.timeout_s / 4)
            got = [runs[f"check{i}"]["tokens"] for i in range(len(prompts))]
            result["check"][dtype] = compare(got, reference[dtype])
            if n:
                continue
            result["gpus"] = _placement(client)
            for batch in args.batches:
                load = make_prompts(batch * args.decode_dp, args.ctx, args.ctx,
                                    args.vocab, args.seed + batch)
                params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                        ignore_eos=True)
                reqs = {f"b{batch}-{i}": (p, params) for i, p in enumerate(load)}
                runs, unfinished = drive(client.submit, client.poll, reqs, args.timeout_s / 4,
                                         until=lambda r: decode_window(r, args.new) is not None)
                for rid in unfinished:  # the window is measured: the rest is not needed
                    client.abort(rid)
                for rid, rec in runs.items():
                    rec["prompt"] = len(reqs[rid][0])
                fig = load_figures(runs, args.new, args.decode_dp,
                                   args.prefill_tp * args.prefill_instances)
                fig["kv_mb_per_request"] = args.ctx * bytes_per_token / 1e6
                result["load"][batch] = fig
                print(f"  batch {batch}/rank: {fig}", flush=True)
            result["kv_receivers"] = _transfer_stats(client)
        finally:
            llm.close()
    return result


def _placement(client) -> dict:
    """The GPU of each rank (None on CPU), decode group and prefill instances."""
    import ray
    return {"decode": ray.get([a.gpu_index.remote() for a in client.decode.actors]),
            "prefill": [ray.get([a.gpu_index.remote() for a in g.actors]) for g in client.prefill]}


def _transfer_stats(client) -> dict:
    """The decode ranks' KV receiver counters, summed (messages, bytes, of which in place,
    staging buffer bytes made, rejected, connections lost)."""
    import ray
    out: dict[str, float] = {}
    for stats in ray.get([a.kv_stats.remote() for a in client.decode.actors]):
        for key, value in stats.items():
            if isinstance(value, (int, float)):
                out[key] = out.get(key, 0) + value
    return out


def compare(got: list[list[int]], want: list[list[int]]) -> dict:
    leading = []
    for g, w in zip(got, want):
        k = 0
        while k < min(len(g), len(w)) and g[k] == w[k]:
            k += 1
        leading.append(k)
    return {"equal": got == want, "leading_equal": leading}


# ------------------------------------------------------------------ main

def start_ray(args) -> None:
    import ray
    ranks = args.prefill_tp * args.prefill_instances + args.decode_dp
    found = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device == "cuda" and found < ranks and not args.share_gpus:
        raise SystemExit(f"{ranks} ranks need {ranks} GPUs, found {found} (--share-gpus to "
                         f"wrap them onto these, as a dry run)")
    gpus = max(ranks, found) if args.device == "cuda" else 0
    ray.init(address="local", num_cpus=max(8, 2 * ranks), num_gpus=gpus,
             include_dashboard=False, log_to_driver=False)


def print_report(result: dict) -> bool:
    a = result["args"]
    print(f"\ndisaggregated: prefill TP{a['prefill_tp']} x {a['prefill_instances']} -> decode "
          f"DP{a['decode_dp']} x EP{a['decode_dp']} ({a['ep_exchange']}), {a['layers']} layers"
          f"{', GPUs shared (times are no figures)' if a['share_gpus'] else ''}")
    gpus = result.get("gpus")
    if gpus and gpus["decode"][0] is not None:
        print(f"GPUs: decode ranks {gpus['decode']}, prefill instances {gpus['prefill']}")
        if len(set(gpus["decode"])) < len(gpus["decode"]):
            print("  decode ranks share GPUs: their collectives relay through host memory, "
                  "so the decode figures are not those of DP x EP on separate GPUs")
    ok = True
    for dtype, c in result.get("check", {}).items():
        must = dtype == a["check_pass_dtype"]
        verdict = ("PASS" if c["equal"] else "FAIL") if must else ("equal" if c["equal"] else "differ")
        ok &= c["equal"] or not must
        print(f"check {dtype}: greedy tokens vs single engine: {verdict}; leading equal "
              f"{c['leading_equal']}")
    rows = result.get("load", {})
    if rows:
        print(f"\n| batch/rank | requests | TTFT median ms | TTFT max ms | decode tok/s/GPU "
              f"| prefill tok/s/GPU | KV MB/request |\n|---|---|---|---|---|---|---|")
        for batch, f in rows.items():
            dec = f["decode_tok_s_per_gpu"]
            dec = "-" if dec is None else f"{dec:.0f}" + ("" if f["window_complete"] else " (short)")
            print(f"| {batch} | {f['requests']} | {f['ttft_ms_median']:.0f} | {f['ttft_ms_max']:.0f} "
                  f"| {dec} | {f['prefill_tok_s_per_gpu']:.0f} "
                  f"| {f['kv_mb_per_request']:.3g} |")
    kv = result.get("kv_receivers")
    if kv:
        print(f"KV into the decode ranks: {kv.get('messages', 0):.0f} messages, "
              f"{kv.get('bytes', 0) / 1e9:.3g} GB, {kv.get('direct', 0):.0f} in place, "
              f"{kv.get('rejected', 0):.0f} rejected, {kv.get('conn_lost', 0):.0f} connections lost")
    if result.get("error"):
        print(f"error: {result['error']}")
    return ok and not result.get("error")


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = hf_config(args)
    args.vocab = cfg["vocab_size"]
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    prompts = make_prompts(args.check_prompts, 16, 200, args.vocab, args.seed)
    itemsize = 2 if args.check_dtypes[0] in ("bfloat16", "float16") else 4
    per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * itemsize
    result: dict = {"args": {k: v for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="disagg_ckpt_") as folder:
        t = time.monotonic()
        _, nbytes = write_checkpoint(folder, cfg, args.seed, device)
        print(f"checkpoint: {nbytes / 1e9:.2f} GB in {time.monotonic() - t:.1f} s", flush=True)
        try:
            t = time.monotonic()
            reference = run_single(folder, args, prompts)
            print(f"single engine: {time.monotonic() - t:.1f} s", flush=True)
            start_ray(args)
            result.update(run_disagg(folder, args, prompts, reference, per_token))
        except Exception as e:  # the report still prints what ran
            traceback.print_exc()
            result["error"] = f"{type(e).__name__}: {e}"
    path = os.path.join(os.environ.get("OUT", "."), "disagg.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    return 0 if print_report(result) else 1


if __name__ == "__main__":
    sys.exit(main())
