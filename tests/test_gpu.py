"""GPU path: greedy tokens of the tiny model on the GPU equal the CPU engine's.

Skipped without a CUDA device (CI); run on the GPU machine with `pytest -m gpu`.
"""

from __future__ import annotations

import gc

import pytest
import torch

from phalanx import LLM, SamplingParams

from test_hf_oracle import make_prompts

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    gc.collect()
    torch.cuda.empty_cache()
    yield


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cuda-graphs"])
def test_tiny_model_gpu_tokens_equal_cpu(tiny_model, eager):
    prompts = make_prompts(2048, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kw = dict(max_num_seqs=8, max_num_batched_tokens=96, page_size=4, num_pages=200)
    cpu = LLM(tiny_model, device="cpu", **kw).generate(prompt_token_ids=prompts, sampling_params=params)
    gpu_llm = LLM(tiny_model, device="cuda", dtype="float32", enforce_eager=eager, **kw)
    gpu = gpu_llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for i, (a, b) in enumerate(zip(cpu, gpu)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, f"prompt {i}"
    assert gpu_llm.engine.stats()["num_preemptions"] > 0
    assert (gpu_llm.engine.runner.graphs is None) == eager
    # prefill and mixed steps (<= 96 tokens here) replay engine/prefill_graphs.py's graphs
    prefill_graphs = gpu_llm.engine.runner.prefill_graphs
    assert (prefill_graphs is None) if eager else prefill_graphs.replays > 10


def test_seeded_sampling_gpu_alone_and_in_batch(tiny_model):
    llm = LLM(tiny_model, device="cuda", dtype="bfloat16", page_size=16, num_pages=2000)
    target = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=5, ignore_eos=True)
    prompt = list(range(100, 160))
    alone = llm.generate(prompt_token_ids=[prompt], sampling_params=target)[0].outputs[0].token_ids
    others = [list(range(i, i + 30 + 7 * i)) for i in range(7)]
    batch = llm.generate(prompt_token_ids=others + [prompt],
                         sampling_params=[SamplingParams(temperature=1.0, max_tokens=25, seed=i,
                                                         ignore_eos=True) for i in range(7)] + [target])
    assert batch[-1].outputs[0].token_ids == alone


def test_batch_invariant_mode_on_gpu(tiny_model):
    """With `batch_invariant` a GPU engine gives a seeded request the same logprob bits
    alone and batched, and a re-prefill of its emitted tokens the decoded bits
    (kernels/batch_invariant.py; without it both differ: bench/probes/gpu_invariance.py)."""
    from test_batch_invariance import assert_alone_equals_batched, assert_reprefill_equals_decode

    llm = LLM(tiny_model, device="cuda", dtype="bfloat16", max_num_seqs=16, num_pages=512,
              batch_invariant=True)
    try:
        assert_alone_equals_batched(llm)
        assert_reprefill_equals_decode(llm)
    finally:
        llm.close()
    from phalanx.kernels.batch_invariant import batch_invariant_on

    assert batch_invariant_on()  # the engine's mode stays the process's until another engine sets it
    LLM(tiny_model, device="cuda", dtype="bfloat16", num_pages=64).close()
    assert not batch_invariant_on()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_invariant_prefill_rows_have_the_decode_bits_on_gpu(dtype):
    """kernels/gpu/invariant_prefill.py's row blocks give each row the bits of decode
    attention at its position (the row-by-row form), at the model's head shapes."""
    from phalanx.kernels import attention
    from phalanx.kernels.attention import AttentionMetadata
    from phalanx.kernels.batch_invariant import batch_invariant
    from phalanx.kernels.gpu.invariant_prefill import invariant_prefill_triton

    g = torch.Generator(device="cuda").manual_seed(9)
    dev, page, hd, nq, nkv = torch.device("cuda"), 16, 128, 32, 4
    specs = [(300, 0), (1, 700), (129, 520), (17, 3)]  # (new tokens, cached prefix)
    per_seq = max(-(-(n + c) // page) for n, c in specs)
    pages = len(specs) * per_seq
    kc = torch.randn(pages, nkv, page, hd, generator=g, device=dev).to(dtype)
    vc = torch.randn(pages, nkv, page, hd, generator=g, device=dev).to(dtype)
    tables = torch.randperm(pages, generator=g, device=dev).view(len(specs), per_seq).int()
    starts = [0]
    for n, _ in specs:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([n + c for n, c in specs], dtype=torch.int32, device=dev),
        block_tables=tables, slot_mapping=torch.full((starts[-1],), -1, dtype=torch.int64, device=dev),
        max_query_len=max(n for n, _ in specs), max_seq_len=max(n + c for n, c in specs))
    q = torch.randn(starts[-1], nq, hd, generator=g, device=dev).to(dtype)
    with batch_invariant(True):
        blocks = invariant_prefill_triton(q, kc, vc, meta, hd ** -0.5)
        rows = attention._rows_as_decode(q, kc, vc, meta, hd ** -0.5)
    assert torch.equal(blocks, rows), (blocks.float() - rows.float()).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_invariant_norm_and_linears_keep_a_rows_bits_on_gpu(dtype, monkeypatch):
    """In the mode a row's normed values, residual and projections have the same bits
    among 1..2048 rows: the norm folded into the GEMM at a few rows (one launch) equals
    the norm kernel in front of it at many, at the model's shapes."""
    from phalanx.kernels.batch_invariant import batch_invariant
    from phalanx.kernels.gpu import invariant_gemm
    from phalanx.kernels.linear import project
    from phalanx.kernels.norm import add_rms_norm
    from phalanx.kernels.norm_linear import norm_linear

    monkeypatch.setattr(invariant_gemm, "FOLD_MAX_M", 16)  # the fold on, off by default
    g = torch.Generator(device="cuda").manual_seed(11)
    dev = torch.device("cuda")

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dtype)

    x, res, xo = randn(2048, 2048), randn(2048, 2048), randn(2048, 4096)
    nw = (1 + randn(2048, scale=0.1))
    qkv, router, o = randn(5120, 2048, scale=0.02), randn(128, 2048, scale=0.02), randn(2048, 4096, scale=0.02)
    with batch_invariant(True):
        full = {name: norm_linear(x, res, nw, 1e-6, w, want_normed=True) for name, w in
                (("qkv", qkv), ("router", router))}
        full_o, full_norm = project(xo, o), add_rms_norm(x, res, nw, 1e-6)
        for m in (1, 2, 5, 16, 17, 64, 300):
            for name, w in (("qkv", qkv), ("router", router)):
                part = norm_linear(x[:m], res[:m], nw, 1e-6, w, want_normed=True)
                for what, a, b in zip(("y", "normed", "residual"), part, full[name]):
                    assert torch.equal(a, b[:m]), (name, what, m)
            assert torch.equal(project(xo[:m], o), full_o[:m]), m
            assert all(torch.equal(a, b[:m]) for a, b in zip(add_rms_norm(x[:m], res[:m], nw, 1e-6), full_norm))


def test_kv_pool_sized_from_free_memory(tiny_model):
    llm = LLM(tiny_model, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5)
    free, total = torch.cuda.mem_get_info()
    page_bytes = 4 * 2 * 2 * 16 * 16 * 2  # layers x (K, V) x kv_heads x page_size x head_dim x bf16
    assert llm.engine.num_pages * page_bytes > 0.3 * total, "about half the device for the KV cache"
    assert free > 0.3 * total, "and no more than that"


def test_small_batch_after_larger_graphs_keeps_its_tokens(tiny_model):
    """The CUDA graphs share one memory pool; replaying the larger ones must not disturb
    what the small ones keep across launches (the MoE small path's arrival counters)."""
    llm = LLM(tiny_model, device="cuda", dtype="bfloat16", page_size=16, num_pages=2000,
              max_num_seqs=16)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = list(range(50, 90))
    alone = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0].token_ids
    others = [list(range(i, i + 20 + 3 * i)) for i in range(16)]
    llm.generate(prompt_token_ids=others, sampling_params=params)
    again = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0].token_ids
    assert again == alone


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_model_shaped_kernels_launch_in_every_dtype(dtype):
    """Prefill attention (head_dim 128 and 256, queries longer than a tile, a cached
    prefix), decode attention over the same caches and the fused experts (hidden 2048,
    768 wide; 512 tokens and a decode-sized 3) at real model sizes:
    float32 tiles sized for bfloat16 asked the H200 for 256 KiB of shared memory and did
    not launch. Fresh random inputs; relative error against the torch references."""
    from phalanx.kernels.attention import (AttentionMetadata, decode_attention,
                                           decode_attention_ref, prefill_attention,
                                           prefill_attention_ref)
    from phalanx.kernels.moe import fused_experts, fused_experts_ref, route

    g = torch.Generator(device="cuda").manual_seed(7)
    dev, tol = torch.device("cuda"), (1e-4 if dtype == torch.float32 else 3e-2)
    for hd, page in [(128, 16), (256, 16)]:
        specs = [(200, 0), (130, 70), (1, 33)]  # (new tokens, cached prefix)
        lens = [n + c for n, c in specs]
        per_seq = max(-(-n // page) for n in lens)
        pages = len(lens) * per_seq
        kc = torch.randn(pages, 2, page, hd, generator=g, device=dev).to(dtype)
        vc = torch.randn(pages, 2, page, hd, generator=g, device=dev).to(dtype)
        tables = torch.randperm(pages, generator=g, device=dev).view(len(lens), per_seq).int()
        starts = [0]
        for n, _ in specs:
            starts.append(starts[-1] + n)
        q = torch.randn(starts[-1], 8, hd, generator=g, device=dev).to(dtype)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev), block_tables=tables,
            slot_mapping=torch.full((starts[-1],), -1, dtype=torch.int64, device=dev),
            max_query_len=max(n for n, _ in specs), max_seq_len=max(lens))
        err = _rel(prefill_attention(q, kc, vc, meta, hd ** -0.5),
                   prefill_attention_ref(q, kc, vc, meta, hd ** -0.5))
        assert err < tol, (hd, err)
        # As the model calls it: this step's rows read from k_new / v_new.
        rows = [(s, c + j) for s, (n, c) in enumerate(specs) for j in range(n)]
        pg = torch.tensor([int(tables[s, p // page]) for s, p in rows], device=dev)
        off = torch.tensor([p % page for _, p in rows], device=dev)
        err = _rel(prefill_attention(q, kc, vc, meta, hd ** -0.5, kc[pg, :, off], vc[pg, :, off]),
                   prefill_attention_ref(q, kc, vc, meta, hd ** -0.5))
        assert err < tol, ("k_new", hd, err)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        q1 = torch.randn(len(lens), 8, hd, generator=g, device=dev).to(dtype)
        err = _rel(decode_attention(q1, kc, vc, seq_lens, tables, hd ** -0.5),
                   decode_attention_ref(q1, kc, vc, seq_lens, tables, hd ** -0.5))
        assert err < tol, ("decode", hd, err)
    w13 = (torch.randn(16, 2 * 768, 2048, generator=g, device=dev) / 2048 ** 0.5).to(dtype)
    w2 = (torch.randn(16, 2048, 768, generator=g, device=dev) / 768 ** 0.5).to(dtype)
    for tokens in (512, 3):  # the general path and the small-batch decode path
        x = torch.randn(tokens, 2048, generator=g, device=dev).to(dtype)
        weights, ids = route(torch.randn(tokens, 16, generator=g, device=dev), 8, True, dtype)
        err = _rel(fused_experts(x, weights, ids, w13, w2),
                   fused_experts_ref(x, weights, ids, w13, w2))
        assert err < tol, (tokens, err)


def test_batched_sampler_draws_alike_on_gpu_and_cpu():
    """The counter-hash draws, penalties, bias, min_tokens and logprobs give the CPU's
    tokens on the GPU (a recovery may move a request between devices)."""
    from phalanx.engine.logits_processors import RowHistory
    from phalanx.engine.sampler import sample_batch

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 151936, generator=g) * 3
    rows = [RowHistory(SamplingParams(temperature=0.3 + 0.05 * i, top_k=(0, 50)[i % 2],
                                      top_p=(1.0, 0.9)[i % 3 == 0], seed=i, logprobs=3,
                                      frequency_penalty=0.5, repetition_penalty=1.1,
                                      logit_bias={7: 2.0}, min_tokens=3),
                       list(range(i, i + 20)), list(range(100, 100 + i % 5)))
            for i in range(64)]
    positions = list(range(20, 84))
    cpu = sample_batch(logits, rows, positions, (2,))
    gpu = sample_batch(logits.cuda(), rows, positions, (2,))
    assert gpu.tokens == cpu.tokens
    for a, b in zip(cpu.logprobs, gpu.logprobs):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_structured_output_and_logprobs_on_gpu(tiny_model):
    import json

    from phalanx.engine.structured_output import StructuredOutput

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 999},
                                               "s": {"enum": ["x", "y"]}},
              "required": ["n", "s"], "additionalProperties": False}
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=60, logprobs=2, prompt_logprobs=1,
                            structured=StructuredOutput.json_schema(schema))
    kw = dict(max_num_seqs=8, page_size=4, num_pages=200)
    prompts = make_prompts(2048, seed=12)[:6]
    cpu = LLM(tiny_model, device="cpu", **kw).generate(prompt_token_ids=prompts, sampling_params=params)
    gpu = LLM(tiny_model, device="cuda", dtype="float32", **kw).generate(
        prompt_token_ids=prompts, sampling_params=params)
    for a, b in zip(cpu, gpu):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert set(json.loads(b.outputs[0].text)) == {"n", "s"}
        assert [x.logprob for x in a.outputs[0].logprobs] == \
            pytest.approx([x.logprob for x in b.outputs[0].logprobs], abs=1e-3)


def test_nothing_compiles_after_ready(tiny_model):
    """The warm-up (engine/warmup.py) served before ready: a random workload it never
    saw (lengths, prefix hits and extensions, batch sizes, sampling paths) compiles no
    Triton kernel afterwards, in both dtypes the tiny model serves."""
    import random

    from phalanx.engine.compile_watch import compile_watch

    rng = random.Random(7)
    for dtype in ("float32", "bfloat16"):
        llm = LLM(tiny_model, device="cuda", dtype=dtype, max_num_seqs=48,
                  max_num_batched_tokens=256)
        stats = llm.engine.stats()
        assert stats["kernel_compiles"] > 0 and stats["kernel_compiles_after_ready"] == 0
        before = dict(compile_watch().by_kernel)
        vocab = llm.engine.config.model.vocab_size
        prompts = [[rng.randrange(8, vocab - 8) for _ in range(rng.randrange(1, 800))]
                   for _ in range(24)]
        prompts += [p + [rng.randrange(8, vocab - 8) for _ in range(rng.randrange(1, 90))]
                    for p in prompts[:8]]
        params = [SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0]),
                                 top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 0, 30]),
                                 logprobs=rng.choice([None, None, 3]), seed=i,
                                 max_tokens=rng.randrange(1, 40), ignore_eos=True)
                  for i in range(len(prompts))]
        for lo, hi in ((0, 1), (1, 5), (5, 32), (0, 32)):  # alone, small and large batches
            llm.generate(prompt_token_ids=prompts[lo:hi], sampling_params=params[lo:hi])
        after = llm.engine.stats()["kernel_compiles_after_ready"]
        new = {k: v - before.get(k, 0) for k, v in compile_watch().by_kernel.items()
               if v != before.get(k, 0)}
        llm.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        assert after == 0, (dtype, new)


def test_fp8_checkpoint_on_gpu_equals_cpu(tiny_model, tmp_path):
    """The tiny model's FP8 checkpoint (bench/fp8_checkpoint.py) on the GPU, CUDA graphs
    and the warm-up included, gives the CPU's greedy tokens (float32 compute)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
    from fp8_checkpoint import write_fp8_checkpoint

    fp8 = write_fp8_checkpoint(tiny_model, tmp_path / "fp8")
    prompts = make_prompts(2048, seed=13)[:6]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = dict(max_num_seqs=8, max_num_batched_tokens=96, page_size=4, num_pages=300)
    cpu = LLM(fp8, device="cpu", **kw).generate(prompt_token_ids=prompts, sampling_params=params)
    gpu_llm = LLM(fp8, device="cuda", dtype="float32", **kw)
    gpu = gpu_llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in gpu] == [o.outputs[0].token_ids for o in cpu]
    assert gpu_llm.engine.model.layers[1].mlp.w13.dtype == torch.float8_e4m3fn


def test_fp8_checkpoint_agrees_with_its_bf16_twin(tiny_model, tmp_path, capsys):
    """bf16 compute on the GPU: the FP8 checkpoint through the FP8 Triton kernels (FP8
    activations in prefill) against its dequantized twin through the bf16 path. Not equal
    (activation quantization, bf16 rounding): the agreement is printed, and a broken FP8
    kernel would show as streams diverging from the first token."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
    from decode_fp8 import token_agreement
    from fp8_checkpoint import write_dequantized_twin, write_fp8_checkpoint

    fp8 = write_fp8_checkpoint(tiny_model, tmp_path / "fp8")
    twin = write_dequantized_twin(fp8, tmp_path / "twin", dtype="bfloat16")
    prompts = make_prompts(2048, seed=21)[:16]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kw = dict(max_num_seqs=16, max_num_batched_tokens=512, page_size=4, num_pages=600,
              device="cuda", dtype="bfloat16")
    streams = {}
    for name, path in (("fp8", fp8), ("twin", twin)):
        llm = LLM(path, **kw)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        streams[name] = [list(o.outputs[0].token_ids) for o in outs]
        if name == "fp8":
            assert llm.engine.model.layers[1].mlp.w13.dtype == torch.float8_e4m3fn
            # loaded on the CPU, moved: the dense scales carry cuBLAS's N-major copy again
            scales = llm.engine.model.layers[0].attn.qkv_proj_scale
            assert torch.equal(scales.n_major, scales.t()), "keep_fp8_layouts"
        llm.close()
        del llm
        gc.collect()
    agreement = token_agreement(streams["fp8"], streams["twin"])
    with capsys.disabled():
        print(f"\nFP8 checkpoint vs its bf16 twin, tiny model, 16 prompts x 16 tokens: {agreement}")
    assert agreement["first_equal"] >= 0.75, agreement
