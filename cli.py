"""The `phalanx` command line.

    phalanx generate "some text" --max-tokens 32 [--model DIR] [--temperature T] [--json]
                     [--tp N] [--dp N]
                     [--prefill-tp N --decode-dp N --decode-tp N --prefill-instances N]
    phalanx serve [--model DIR] [--host 127.0.0.1] [--port 8000] [--api-key KEY]
                  [--address RAY_ADDRESS] [--device cpu|cuda]
                  [--tp N --dp N | --prefill-tp N --decode-dp N --decode-tp N
                   --prefill-instances N] [--max-num-seqs N] ...
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete one prompt, streaming text to stdout")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", default=None, help="Hugging Face model folder (default: the tiny model)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print token ids as JSON instead of text")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=0, help="KV pages (0: sized automatically)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--quantization", "-q", choices=["fp8"], default=None,
                   help="fp8: the projections as block-scaled FP8, quantized on load")
    _add_load_format(p)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (Ray actors)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks; experts spread over all")
    p.add_argument("--collective-timeout", type=float, default=30.0,
                   help="seconds any collective may take before the group fails")
    p.add_argument("--max-recoveries", type=int, default=5,
                   help="re-formations allowed within --recovery-window before failing (0: never)")
    p.add_argument("--recovery-window", type=float, default=600.0,
                   help="seconds over which --max-recoveries re-formations are counted")
    p.add_argument("--replace-timeout", type=float, default=30.0,
                   help="seconds a dead rank's replacement may wait for room in the Ray "
                        "cluster; past it a DP group re-forms narrower (fewer DP ranks)")
    add_disagg_arguments(p)


def _add_load_format(p: argparse.ArgumentParser) -> None:
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="auto: the folder's safetensors; dummy: seeded random weights of "
                        "config.json's shapes (the folder needs no weights; benchmarks)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="GPU kernels whose row results do not depend on the batch: a seeded "
                        "request's tokens equal alone, batched and after a recovery (slower)")


def add_disagg_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ep-exchange", choices=("exact", "padded", "peer"), default="exact",
                   help="MoE all-to-all of DP×EP groups: uneven splits, padded to the "
                        "step's agreed token count (no counts exchange), or padded rows "
                        "stored into the peers' symmetric memory and waited for on the "
                        "device (NVSHMEM on GPU); same tokens")
    e = p.add_argument_group("EP width chosen while serving (the colocated --dp ranks, or "
                             "the disaggregated --decode-dp ranks)")
    e.add_argument("--ep-policy", default="fixed",
                   help="how many ranks each DP×EP group spans, chosen at run time: fixed "
                        "(--ep-groups, the default), widest (one group), cost_model (the "
                        "measured cost model, --ep-costs)")
    e.add_argument("--ep-groups", type=int, default=1,
                   help="DP×EP groups at start (the --dp or --decode-dp ranks split evenly)")
    e.add_argument("--ep-costs", default="",
                   help="cost tables for cost_model (`python bench/ep_width.py` writes them; "
                        "without: measured on the ranks at start, seconds a layout)")
    e.add_argument("--ep-itl-target-ms", type=float, default=50.0,
                   help="cost_model: the predicted step a layout must stay under")
    e.add_argument("--ep-min-interval", type=float, default=30.0,
                   help="cost_model: seconds between two layout changes at least")
    e.add_argument("--ep-interval", type=float, default=2.0,
                   help="seconds between two questions to the policy")
    m = p.add_argument_group("micro-batching of DP×EP steps (two-batch overlap)")
    m.add_argument("--microbatch", default="adaptive",
                   help="whether a DP×EP step runs as two micro-batches whose MoE exchanges "
                        "overlap the other's compute: off, on, threshold (from "
                        "--microbatch-min-tokens tokens per rank), adaptive (measures both "
                        "per token-count bucket while serving and keeps the faster)")
    m.add_argument("--microbatch-min-tokens", type=int, default=32,
                   help="threshold: tokens per rank from which a step splits")
    g = p.add_argument_group("disaggregated layout (any of these selects it)")
    g.add_argument("--prefill-tp", type=int, default=None, help="TP ranks of each prefill instance")
    g.add_argument("--prefill-instances", type=int, default=None, help="prefill TP groups")
    g.add_argument("--decode-dp", type=int, default=None, help="decode DP ranks (experts over all)")
    g.add_argument("--decode-tp", type=int, default=None, help="TP ranks inside each decode DP rank")
    g.add_argument("--prefill-page-size", type=int, default=None,
                   help="prefill-side page size (default: --page-size)")


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve an OpenAI-compatible HTTP API (completions, chat, SSE streaming)",
        description="Serve a model over HTTP. With no layout flag: the disaggregated layout "
                    "(prefill TP=1 -> decode DP=2) on a local Ray cluster; --tp 1 --dp 1: one "
                    "in-process engine without Ray. Ctrl-C or SIGTERM shuts down cleanly.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_serve_http(p)
    _add_serve_layout(p)
    _add_serve_engine(p)
    _add_serve_faults(p)


def _add_serve_http(p: argparse.ArgumentParser) -> None:
    """The model served and the HTTP front."""
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="Hugging Face model folder (as `--model`; vLLM's spelling)")
    p.add_argument("--model", default=None, help="Hugging Face model folder (default: the tiny model)")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients send (default: the model folder's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on every route but /health")
    p.add_argument("--metrics-without-key", action="store_true",
                   help="serve /metrics without the API key (Prometheus scrapers, load "
                        "generators; vLLM leaves it open)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                   help="larger request bodies are answered 413")
    p.add_argument("--quiet", action="store_true",
                   help="no access line per request and no throughput line every 10 s")
    p.add_argument("--stream-resume", type=float, default=10.0,
                   help="seconds a stream whose connection dropped keeps generating for a "
                        "client that resumes it with Last-Event-ID (0: abort at once)")
    p.add_argument("--allowed-origins", default="",
                   help="comma-separated origins (scheme://host[:port]) or * whose browser "
                        "pages may call the API (CORS); default: none")


def _add_serve_layout(p: argparse.ArgumentParser) -> None:
    """Where the ranks run and how they are laid out."""
    p.add_argument("--address", default=None,
                   help="join this Ray cluster (e.g. 10.0.0.1:6379 or auto) instead of "
                        "starting a local one")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--tp", "-tp", "--tensor-parallel-size", dest="tp", type=int, default=None,
                   help="colocated: tensor-parallel ranks")
    p.add_argument("--dp", "-dp", "--data-parallel-size", dest="dp", type=int, default=None,
                   help="colocated: data-parallel ranks")
    add_disagg_arguments(p)


def _add_serve_engine(p: argparse.ArgumentParser) -> None:
    """Each rank's engine: batching, KV cache, weights, graphs."""
    p.add_argument("--max-num-seqs", type=int, default=64, help="running requests per DP rank")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per step per DP rank")
    p.add_argument("--page-size", type=int, default=16, help="KV page size (decode side)")
    p.add_argument("--num-pages", type=int, default=0, help="KV pages per rank (0: sized automatically)")
    p.add_argument("--max-model-len", type=int, default=0, help="context length (0: the model's)")
    p.add_argument("--quantization", "-q", choices=["fp8"], default=None,
                   help="fp8: the projections as block-scaled FP8, quantized on load (an FP8 "
                        "checkpoint loads as FP8 without it)")
    p.add_argument("--seed", type=int, default=0, help="engine seed")
    _add_load_format(p)
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                   help="compute and KV cache dtype (auto: the checkpoint's)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of each GPU the weights, activations and KV cache may take "
                        "(0, 1]; the KV cache gets what is left of it")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: every step runs eagerly")
    p.add_argument("--cuda-graph-max-prefill", type=int, default=512,
                   help="one GPU: prefill and mixed steps of up to this many tokens replay "
                        "CUDA graphs (0: they run eagerly)")


def _add_serve_faults(p: argparse.ArgumentParser) -> None:
    """Deadlines, recovery and routing."""
    p.add_argument("--collective-timeout", type=float, default=30.0,
                   help="seconds any collective or KV transfer may take before a group fails")
    p.add_argument("--max-recoveries", type=int, default=5,
                   help="re-formations (a group that loses a rank, its requests resumed) "
                        "allowed within --recovery-window; one more and the server fails "
                        "its requests (0: never re-form)")
    p.add_argument("--recovery-window", type=float, default=600.0,
                   help="seconds over which --max-recoveries re-formations are counted")
    p.add_argument("--replace-timeout", type=float, default=30.0,
                   help="seconds a dead rank's replacement may wait for room in the Ray "
                        "cluster; past it a DP group re-forms narrower (fewer DP ranks)")
    p.add_argument("--routing-policy", default=None,
                   help="routing policy over DP groups (default: prefix_aware)")
    p.add_argument("--router-hold", type=int, default=None,
                   help="requests a DP group may hold (routed, not finished) before new ones "
                        "wait at the router, each then going to the group with room that "
                        "serves it best (default: --max-num-seqs + 1; 0: route every request "
                        "as it arrives)")


def _generate(args: argparse.Namespace) -> int:
    import signal

    from .engine.sampling_params import SamplingParams
    from .llm import LLM
    from .server.launch import layout_kwargs

    # SIGINT interrupts even when the shell started us with it ignored (a background
    # job, as `phalanx serve` also does): `main` reports it and exits 130.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            min_p=args.min_p, max_tokens=args.max_tokens, seed=args.seed,
                            ignore_eos=args.ignore_eos)
    llm = LLM(args.model, tp=args.tp, dp=args.dp, page_size=args.page_size, num_pages=args.num_pages,
              device=args.device, collective_timeout_s=args.collective_timeout,
              max_recoveries=args.max_recoveries, recovery_window_s=args.recovery_window,
              replace_timeout_s=args.replace_timeout, quantization=args.quantization,
              load_format=args.load_format, ep_exchange=args.ep_exchange,
              batch_invariant=args.batch_invariant, **layout_kwargs(args))
    try:
        return _run_generate(llm, args, params)
    finally:
        llm.close()


def _run_generate(llm, args: argparse.Namespace, params) -> int:
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    prompt_ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    if args.json:
        out = llm.generate(prompt_token_ids=[prompt_ids], sampling_params=params)[0]
        print(json.dumps({"prompt_token_ids": prompt_ids, "token_ids": out.outputs[0].token_ids,
                          "finish_reason": out.outputs[0].finish_reason}))
        return 0
    ids: list[int] = []
    shown = ""
    for token in llm.stream(prompt_ids, params):
        ids.append(token)
        text = llm.decode(ids)
        # Print only a stable suffix: an incomplete UTF-8 sequence decodes to U+FFFD.
        if not text.endswith("\ufffd") and text.startswith(shown):
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    sys.stdout.write("\n")
    return 0


def _merge_model_path(args: argparse.Namespace) -> None:
    """`phalanx serve MODEL` is `--model MODEL` (ValueError when both name different ones)."""
    if args.model_path is not None:
        if args.model is not None and args.model != args.model_path:
            raise ValueError(f"two models given: MODEL {args.model_path!r} and --model "
                             f"{args.model!r}")
        args.model = args.model_path


def build_parser() -> argparse.ArgumentParser:
    """The `phalanx` parser: `generate`, `serve` and `chaos`."""
    from .version import __version__
    from .chaos.cli import add_chaos
    parser = argparse.ArgumentParser(prog="phalanx", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"phalanx {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    add_chaos(sub)
    return parser


def _user_message(e: BaseException) -> str:
    """What to tell the user: an error raised inside a rank actor reaches us as Ray's
    task error (its text is the remote traceback): its cause's message instead."""
    cause = getattr(e, "cause", None)
    while type(e).__name__.startswith("RayTaskError") and isinstance(cause, BaseException):
        e, cause = cause, getattr(cause, "cause", None)
    return str(e)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            _merge_model_path(args)
            from .server.serve_main import run_serve
            return run_serve(args)
        if args.command == "chaos":
            from .chaos.cli import run_chaos
            return run_chaos(args)
    except (ValueError, OSError) as e:  # OSError: e.g. the port is taken
        print(f"phalanx: error: {_user_message(e)}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # e.g. GroupFailure: a rank died; named with its epoch
        print(f"phalanx: error: {_user_message(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: what was built is closed on the way out
        print("\nphalanx: interrupted", file=sys.stderr)
        return 130
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
