"""`load_format="dummy"`: a folder with config.json and a tokenizer only serves seeded
random weights, equal tensor by tensor (whole, sliced, per expert, per TP shard) to the
checkpoint `bench/disagg_checkpoint.py` writes with the same seed, and so with the same
greedy tokens; bad values and folders without weights are refused by name."""

from __future__ import annotations

import os
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch

from phalanx import LLM, SamplingParams
from phalanx.config import EngineConfig
from phalanx.llm import engine_config
from phalanx.models.checkpoint import Checkpoint
from phalanx.models.loader import load_model, read_model_config
from phalanx.models.random_weights import RandomWeights
from phalanx.models.shard import ModelShard
from phalanx.models.tiny import TINY_HF_CONFIG, default_model_dir

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
from disagg_checkpoint import write_checkpoint, write_config  # noqa: E402

CPU = torch.device("cpu")


def _config_only(folder, hf_config: dict):
    """A model folder with the tiny model's tokenizer and `hf_config`, no weights."""
    write_config(folder, hf_config)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(default_model_dir() / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(written, config only) for the tiny shape stored in bfloat16 (draws rounded)."""
    cfg = {k: v for k, v in TINY_HF_CONFIG.items() if k != "architectures"}
    cfg["dtype"] = "bfloat16"
    root = tmp_path_factory.mktemp("dummy")
    written, _ = write_checkpoint(root / "written", cfg, 0, CPU)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(default_model_dir() / name, written / name)
    return written, _config_only(root / "bare", cfg)


def test_tensors_equal_the_written_checkpoint(folders):
    written, bare = folders
    ckpt, dummy = Checkpoint(written), RandomWeights(bare, seed=0)
    assert dummy.keys() == ckpt.keys()
    for name in sorted(ckpt.keys()):
        got = dummy.load(name)
        assert got.dtype == torch.bfloat16 and torch.equal(got, ckpt.load(name)), name
    name = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(dummy.load(name, dim=0, start=8, stop=24),
                       ckpt.load(name, dim=0, start=8, stop=24))
    assert torch.equal(dummy.load(name, dim=1, start=4, stop=9),
                       ckpt.load(name, dim=1, start=4, stop=9))
    for got, want in zip(dummy.load_experts(2, [5, 1, 2]), ckpt.load_experts(2, [5, 1, 2])):
        assert torch.equal(got, want)
    assert [t.shape[0] for t in dummy.load_experts(2, [])] == [0, 0]
    assert not torch.equal(dummy.load("model.layers.1.mlp.experts.3.up_proj.weight"),
                           dummy.load("model.layers.1.mlp.experts.2.up_proj.weight"))
    with pytest.raises(ValueError, match="out of range"):
        dummy.load(name, dim=0, start=0, stop=10_000)
    with pytest.raises(KeyError, match="not in the model"):
        dummy.load("model.layers.99.mlp.gate.weight")


@pytest.mark.parametrize("shard", [ModelShard(1, 2, (3, 0, 9)), ModelShard(0, 4)])
def test_a_shard_loads_the_same_parameters(folders, shard):
    written, bare = folders
    cfg = read_model_config(written)
    comm = SimpleNamespace(tp_rank=shard.tp_rank, tp_size=shard.tp_size)  # shapes only
    ours = load_model(bare, cfg, shard, CPU, torch.bfloat16, comm, load_format="dummy")
    theirs = load_model(written, cfg, shard, CPU, torch.bfloat16, comm)
    mine = dict(ours.named_parameters())
    for name, p in theirs.named_parameters():
        assert torch.equal(mine[name], p), name


def test_greedy_tokens_equal_the_written_checkpoint(folders):
    written, bare = folders
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], list(range(40, 77))]
    outs = []
    for folder, fmt in ((written, "auto"), (bare, "dummy")):
        llm = LLM(str(folder), load_format=fmt, num_pages=64)
        try:
            outs.append([o.outputs[0].token_ids
                         for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)])
        finally:
            llm.close()
    assert outs[0] == outs[1] and len(outs[0][1]) == 12


def test_refused_by_name(folders):
    _, bare = folders
    with pytest.raises(ValueError, match="model: .*safetensors"):
        engine_config(str(bare))  # no weights and not dummy
    cfg = engine_config(str(bare), load_format="dummy")
    assert cfg.load_format == "dummy"
    with pytest.raises(ValueError, match="load_format"):
        EngineConfig(model_path=cfg.model_path, model=cfg.model, load_format="zeros")
