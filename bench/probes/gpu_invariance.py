"""How far the GPU path is from batch invariance (ARCHITECTURE §5), and whether a
``tl.dot`` row's bits depend on the tile's row count.

Four questions, each answered by counts of differing bits (never timings):

1. ``llm``: a seeded request's logprobs alone against beside 1..31 others, and a
   re-prefill of its emitted tokens (the recovery after a KV loss) against the decoded
   logprobs, on a mid-size random Qwen3-MoE (bf16, and FP8 with ``--fp8``);
2. ``linear``: a projection's row alone (M = 1) against the same row among M rows, as
   the model calls it (`kernels.linear.project`), with ``--invariant`` in the
   batch-invariant mode (kernels/batch_invariant.py) too, as the ``llm`` rows;
3. ``moe``: a token's experts (bf16) alone against among 2..2048 tokens;
4. ``dot``: one Triton GEMM at BLOCK_M 16 / 32 / 64 / 128 and BLOCK_K 16..128 (the same
   K order): does a row's result depend on the tile (mma.sync against wgmma)?

Run on the GPU machine from the repository root: ``python bench/probes/gpu_invariance.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

TARGET = "The quick brown fox jumps over the lazy dog"
OTHERS = ["Hello there, my friend", "One two three four five six", "A B C",
          "Lorem ipsum dolor sit amet, consectetur", "To be or not to be", "Alpha beta gamma"]


def mid_model(folder: Path) -> str:
    """A 4-layer random Qwen3-MoE with 128-wide heads and 1024-wide rows."""
    from phalanx.models.tiny import tiny_variant_config, write_random_checkpoint, write_tokenizer

    cfg = tiny_variant_config("qwen3_moe")
    cfg.update(hidden_size=1024, intermediate_size=2048, num_attention_heads=16, num_key_value_heads=4,
               head_dim=128, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256,
               max_position_embeddings=4096)
    write_tokenizer(folder)
    write_random_checkpoint(folder, cfg, seed=0)
    return str(folder)


def _pairs(lps):
    return [(lp.token, lp.logprob) for lp in lps]


def llm_rows(model: str, quantization: str | None, device: str = "cuda", invariant: bool = False) -> dict:
    from phalanx import LLM, SamplingParams

    llm = LLM(model, device=device, dtype="bfloat16", max_num_seqs=64, num_pages=4000,
              quantization=quantization, enable_prefix_caching=False, batch_invariant=invariant)
    try:
        target = SamplingParams(temperature=1.0, max_tokens=48, seed=5, logprobs=0, ignore_eos=True)
        (alone,) = llm.generate([TARGET], target)
        want = _pairs(alone.outputs[0].logprobs)
        batched = {}
        for k in (1, 3, 7, 15, 31):
            company = [SamplingParams(temperature=1.0, max_tokens=48 - i % 40, seed=9 + i, ignore_eos=True)
                       for i in range(k)]
            prompts = [TARGET] + [OTHERS[i % len(OTHERS)] + f" {i}" for i in range(k)]
            got = _pairs(llm.generate(prompts, [target] + company)[0].outputs[0].logprobs)
            batched[k] = {"logprobs_differ": sum(a[1] != b[1] for a, b in zip(got, want)),
                          "tokens_differ": sum(a[0] != b[0] for a, b in zip(got, want))}
        prompt, emitted = alone.prompt_token_ids, alone.outputs[0].token_ids
        (again,) = llm.generate(prompt_token_ids=[prompt + emitted[:40]], sampling_params=SamplingParams(
            temperature=1.0, max_tokens=1, prompt_logprobs=0))
        pre = _pairs(again.prompt_logprobs[len(prompt):])
        reprefill = {"positions": len(pre), "logprobs_differ": sum(a != b for a, b in zip(pre, want[:40])),
                     "max_abs": max(abs(a[1] - b[1]) for a, b in zip(pre, want[:40]))}
        return {"alone_vs_batched": batched, "reprefill_vs_decode": reprefill}
    finally:
        llm.close()


def linear_rows(invariant: bool) -> dict:
    from phalanx.kernels.batch_invariant import batch_invariant
    from phalanx.kernels.linear import project

    g = torch.Generator(device="cuda").manual_seed(3)
    out = {}
    mode = batch_invariant(invariant)
    for n, k in ((5120, 2048), (2048, 4096), (128, 2048)):
        w = (torch.randn(n, k, generator=g, device="cuda") / k ** 0.5).bfloat16()
        x = torch.randn(128, k, generator=g, device="cuda").bfloat16()
        alone = torch.cat([project(x[i:i + 1], w) for i in range(128)])
        out[f"{n}x{k}"] = {m: int((project(x[:m], w) != alone[:m]).any(1).sum()) for m in (2, 4, 16, 64, 128)}
    mode.__exit__()
    return out


def moe_rows() -> dict:
    """A token's experts alone against among T tokens (bf16, the Qwen3-30B-A3B expert
    shape, 32 of its 128 experts): rows that differ."""
    from phalanx.kernels.moe import fused_experts, route

    g = torch.Generator(device="cuda").manual_seed(5)
    w13 = (torch.randn(32, 2 * 768, 2048, generator=g, device="cuda") / 2048 ** 0.5).bfloat16()
    w2 = (torch.randn(32, 2048, 768, generator=g, device="cuda") / 768 ** 0.5).bfloat16()
    x = torch.randn(2048, 2048, generator=g, device="cuda").bfloat16()
    weights, ids = route(torch.randn(2048, 32, generator=g, device="cuda"), 8, True, torch.bfloat16)
    alone = torch.cat([fused_experts(x[i:i + 1], weights[i:i + 1], ids[i:i + 1], w13, w2) for i in range(64)])
    return {t: int((fused_experts(x[:t], weights[:t], ids[:t], w13, w2)[:64] != alone[:min(t, 64)]).any(1).sum())
            for t in (2, 4, 8, 32, 128, 512, 2048)}


def dot_rows() -> dict:
    import triton
    import triton.language as tl

    @triton.jit
    def mm(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
           PREC: tl.constexpr):
        pm, pn = tl.program_id(0), tl.program_id(1)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            a = tl.load(a_ptr + rm[:, None] * K + (k0 + rk)[None, :], mask=rm[:, None] < M, other=0.0)
            b = tl.load(b_ptr + rn[:, None] * K + (k0 + rk)[None, :], mask=rn[:, None] < N, other=0.0)
            acc = tl.dot(a, tl.trans(b), acc=acc, input_precision=PREC)
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))

    g = torch.Generator(device="cuda").manual_seed(4)
    out = {}
    for dtype, prec in ((torch.bfloat16, "ieee"), (torch.float32, "ieee"), (torch.float32, "tf32")):
        M, N, K = 256, 512, 1024
        a = torch.randn(M, K, generator=g, device="cuda").to(dtype)
        b = torch.randn(N, K, generator=g, device="cuda").to(dtype)
        res = {}
        for bm, bk, warps in ((16, 64, 4), (32, 64, 4), (64, 64, 4), (128, 64, 4), (128, 64, 8),
                              (16, 32, 4), (16, 128, 4), (128, 128, 8), (64, 16, 4)):
            c = torch.empty(M, N, device="cuda")
            mm[(M // bm, N // 64)](a, b, c, M, N, K, BM=bm, BN=64, BK=bk, PREC=prec, num_warps=warps, num_stages=2)
            res[f"{bm}/k{bk}/{warps}w"] = c
        base = res["16/k64/4w"]
        out[f"{dtype}/{prec}"] = {key: int((c != base).any(1).sum()) for key, c in res.items()}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skip", default="", help="comma list of llm,linear,moe,dot to skip")
    p.add_argument("--fp8", action="store_true", help="also the FP8 row of --llm")
    p.add_argument("--invariant", action="store_true",
                   help="also the linear and --llm rows in the batch-invariant mode")
    p.add_argument("--device", default="cuda", help="--llm's device (cpu: a sanity run)")
    p.add_argument("--json", default=os.environ.get("OUT", ".") + "/gpu_invariance.json")
    a = p.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    if "dot" not in skip:
        report["dot"] = dot_rows()
        print("dot: rows differing from BLOCK_M 16:", json.dumps(report["dot"]), flush=True)
    if "linear" not in skip:
        for inv in (False, True) if a.invariant else (False,):
            key = "linear/invariant" if inv else "linear"
            report[key] = linear_rows(inv)
            print(f"{key}: rows differing from the row alone:", json.dumps(report[key]), flush=True)
    if "moe" not in skip:
        report["moe"] = moe_rows()
        print("moe: rows differing from the token alone:", json.dumps(report["moe"]), flush=True)
    if "llm" not in skip:
        with tempfile.TemporaryDirectory() as d:
            model = mid_model(Path(d))
            runs = [(None, False)] + [("fp8", False)] * a.fp8 + [(None, True)] * a.invariant
            for q, inv in runs:
                key = f"llm/{q or 'bf16'}" + ("/invariant" if inv else "")
                report[key] = llm_rows(model, q, a.device, inv)
                print(f"{key}:", json.dumps(report[key]), flush=True)
    Path(a.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
