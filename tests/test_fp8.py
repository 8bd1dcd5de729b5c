"""FP8 weights (issue 33) on CPU: the block format (kernels/fp8.py), a shard's rows read as
the whole tensor's (models/fp8_weights.py), and the tiny model's FP8 checkpoint giving the
same greedy tokens as its dequantized float32 twin, alone and quantized on load."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from phalanx import LLM, SamplingParams
from phalanx.kernels.fp8 import (BLOCK, FP8, FP8_MAX, dequantize, expand_block_scales,
                                 fp8_linear, quantize_blocks, quantize_groups, slice_k_blocks)
from phalanx.models.checkpoint import Checkpoint
from phalanx.models.fp8_weights import read_fp8

from test_hf_oracle import make_prompts

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
from fp8_checkpoint import write_dequantized_twin, write_fp8_checkpoint  # noqa: E402


def test_blocks_round_trip_within_fp8_precision():
    g = torch.Generator().manual_seed(0)
    for shape in ((300, 200), (64, 64), (2, 130, 257)):
        w = torch.randn(shape, generator=g) * torch.rand(shape, generator=g) * 3
        q, blocks = quantize_blocks(w)
        assert q.dtype == FP8 and q.shape == w.shape
        assert blocks.shape == (*shape[:-2], -(-shape[-2] // BLOCK), -(-shape[-1] // BLOCK))
        back = dequantize(q, expand_block_scales(blocks, shape[-2]), torch.float32)
        err = ((back - w).norm() / w.norm()).item()
        assert 0 < err < 0.04, err  # e4m3: 3 mantissa bits
        assert q.float().abs().max() <= FP8_MAX
    q, blocks = quantize_blocks(torch.zeros(10, 20))
    assert torch.equal(blocks, torch.ones(1, 1)) and not q.float().any()


def test_each_block_gets_its_own_scale():
    w = torch.ones(256, 256)
    w[128:, :128] *= 1000
    _, blocks = quantize_blocks(w)
    assert blocks[1, 0] == pytest.approx(1000 / FP8_MAX) and blocks[0, 0] == pytest.approx(1 / FP8_MAX)


def test_fp8_linear_is_linear_over_the_dequantized_weight():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 300, generator=g), torch.randn(70, 300, generator=g)
    q, blocks = quantize_blocks(w)
    s = expand_block_scales(blocks, 70)
    ref = x @ dequantize(q, s, torch.float32).T
    torch.testing.assert_close(fp8_linear(x, q, s), ref, rtol=1e-6, atol=1e-5)  # rows padded: kernels/linear.py
    xq, xs = quantize_groups(x)  # what the GPU kernels do to activations
    assert xq.dtype == FP8 and xs.shape == (5, 3)
    assert (dequantize(xq, xs, torch.float32) - x).norm() / x.norm() < 0.04


def test_columns_cut_only_on_block_bounds():
    s = torch.arange(12.0).view(2, 6)
    assert torch.equal(slice_k_blocks(s, 700, 128, 384), s[:, 1:3])
    assert torch.equal(slice_k_blocks(s, 700, 640, 700), s[:, 5:6])
    with pytest.raises(ValueError, match="128-column blocks"):
        slice_k_blocks(s, 700, 64, 128)


@pytest.fixture(scope="module")
def fp8_dirs(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    fp8 = write_fp8_checkpoint(tiny_model, root / "fp8")
    return fp8, write_dequantized_twin(fp8, root / "twin")


def test_a_shard_reads_the_whole_tensors_codes(tiny_model, fp8_dirs):
    """Rows cut anywhere, from an FP8 checkpoint or quantized on load: the codes and
    scales of the whole tensor's quantization, those rows."""
    name = "model.layers.1.mlp.experts.3.up_proj"
    full = Checkpoint(tiny_model).load(f"{name}.weight")
    q, blocks = quantize_blocks(full)
    scales = expand_block_scales(blocks, full.shape[0])
    for rows in (range(0, full.shape[0]), range(5, 19), range(17, full.shape[0])):
        for ckpt in (Checkpoint(tiny_model), Checkpoint(fp8_dirs[0])):
            got_q, got_s = read_fp8(ckpt, name, rows=rows)
            assert torch.equal(got_q.float(), q[rows.start:rows.stop].float())
            assert torch.equal(got_s, scales[rows.start:rows.stop])


def _tokens(folder, **kw) -> list[list[int]]:
    prompts = make_prompts(2048, seed=3)[:6]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(folder, max_num_seqs=8, max_num_batched_tokens=64, page_size=4, num_pages=400, **kw)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts,
                                                             sampling_params=params)]
    finally:
        llm.close()


def test_fp8_checkpoint_tokens_equal_its_dequantized_twin(tiny_model, fp8_dirs):
    fp8, twin = fp8_dirs
    llm = LLM(fp8, max_num_seqs=2, num_pages=50, page_size=4)
    attn = llm.engine.model.layers[0].attn
    assert attn.qkv_proj.dtype == FP8 and attn.qkv_proj_scale is not None
    assert llm.engine.model.layers[1].mlp.w13.dtype == FP8
    expected = _tokens(twin)
    assert _tokens(fp8) == expected
    assert _tokens(tiny_model, quantization="fp8") == expected  # quantized on load alike


@pytest.mark.slow
def test_fp8_in_a_dp_ep_group_equals_its_twin(fp8_dirs):
    fp8, twin = fp8_dirs
    assert _tokens(fp8, dp=2) == _tokens(twin)


def test_a_tp_size_that_cuts_blocks_is_refused_before_any_rank_starts(fp8_dirs, tiny_model):
    """The tiny model's heads: TP=2 cuts the attention output off a 128-column block."""
    for model, kw in ((fp8_dirs[0], {}), (tiny_model, {"quantization": "fp8"})):
        with pytest.raises(ValueError,
                           match=r"tp: tp=2 cuts FP8 weights.*attention heads \d+ per rank"):
            LLM(model, tp=2, **kw)
        with pytest.raises(ValueError, match="prefill_tp: prefill_tp=2"):
            LLM(model, prefill_tp=2, decode_dp=1, **kw)



def test_fp8_scales_lists_every_fp8_weight_of_a_loaded_model(tiny_model, tmp_path):
    """`fp8_scales` (which `keep_fp8_layouts` walks after the model moves to its device)
    finds each FP8 projection's scales: qkv, o and the expert stacks of every layer."""
    from phalanx.models.fp8_weights import fp8_scales

    fp8 = write_fp8_checkpoint(tiny_model, tmp_path / "fp8")
    model = LLM(fp8, device="cpu", num_pages=64).engine.model
    want = []
    for layer in model.layers:
        want += [layer.attn.qkv_proj_scale, layer.attn.o_proj_scale]
        mlp = layer.mlp
        want += [mlp.w13_scale, mlp.w2_scale] if hasattr(mlp, "w13_scale") else \
            [mlp.gate_up_proj_scale, mlp.down_proj_scale]
    got = fp8_scales(model)
    assert all(w is not None for w in want)
    assert len(got) == len(want) and all(any(g is w for g in got) for w in want)
