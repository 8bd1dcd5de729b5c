"""Tiny model builder (models/tiny.py), Checkpoint reader (models/checkpoint.py), envs.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from phalanx.envs import envs
from phalanx.models import tiny
from phalanx.models.checkpoint import Checkpoint

KINDS = ("qwen3_moe", "qwen3", "qwen2_moe", "llama")
CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "qwen2_moe": "Qwen2MoeForCausalLM", "llama": "LlamaForCausalLM"}
MOE_LAYER = 1  # layer 0 is dense (mlp_only_layers=[0])


@pytest.fixture(scope="session")
def variant_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("variants")
    return {kind: tiny.build_variant(root / kind, kind, seed=0) for kind in KINDS}


@pytest.fixture(scope="session")
def tiny_dir(variant_dirs) -> Path:
    return variant_dirs["qwen3_moe"]


@pytest.fixture(scope="session")
def hf_model(tiny_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_dir)


@pytest.fixture(scope="session")
def hf_saved_dir(hf_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf_saved")
    hf_model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def fused_dir(tiny_dir, tmp_path_factory) -> Path:
    """The tiny model rewritten in the fused expert layout of transformers 5 parameters."""
    out = tmp_path_factory.mktemp("fused")
    shutil.copy(tiny_dir / "config.json", out / "config.json")
    sd = load_file(tiny_dir / "model.safetensors")
    fused = {k: v for k, v in sd.items() if ".mlp.experts." not in k}
    cfg = tiny.TINY_HF_CONFIG
    for layer in range(cfg["num_hidden_layers"]):
        if not tiny.is_moe_layer(cfg, layer):
            continue
        p = f"model.layers.{layer}.mlp.experts"
        experts = range(cfg["num_experts"])
        fused[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat([sd[f"{p}.{e}.gate_proj.weight"], sd[f"{p}.{e}.up_proj.weight"]]) for e in experts])
        fused[f"{p}.down_proj"] = torch.stack([sd[f"{p}.{e}.down_proj.weight"] for e in experts])
    save_file(fused, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def sharded_dir(tiny_dir, tmp_path_factory) -> Path:
    """The tiny model split into two shards plus model.safetensors.index.json."""
    out = tmp_path_factory.mktemp("sharded")
    shutil.copy(tiny_dir / "config.json", out / "config.json")
    sd = load_file(tiny_dir / "model.safetensors")
    names = sorted(sd)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in halves.items():
        save_file({k: sd[k] for k in keys}, out / file, metadata={"format": "pt"})
        weight_map.update({k: file for k in keys})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


# ------------------------------------------------------------ transformers compatibility


def _top2_gaps(logits: torch.Tensor) -> torch.Tensor:
    top = logits.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


@pytest.mark.parametrize("kind", KINDS)
def test_variant_loads_in_transformers(kind, variant_dirs, tmp_path):
    from transformers import AutoModelForCausalLM
    folder = variant_dirs[kind]
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert type(model).__name__ == CLASSES[kind]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    # what transformers writes back is exactly our key set and shapes (hub per-expert layout)
    model.save_pretrained(tmp_path)
    ours, theirs = Checkpoint(folder), Checkpoint(tmp_path)
    assert ours.keys() == theirs.keys()
    assert all(ours.shape(k) == theirs.shape(k) for k in ours.keys())

    prompts = torch.randint(0, tiny.BPE_VOCAB_SIZE, (16, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(prompts).logits[:, -1].float()
    median_gap = _top2_gaps(logits).median().item()
    print(f"{kind}: median top1-top2 last-position logit gap {median_gap:.3f}")
    assert median_gap > 0.1
    out = model.generate(prompts[:2], attention_mask=torch.ones_like(prompts[:2]),
                         max_new_tokens=5, do_sample=False)
    assert out.shape[0] == 2 and 12 < out.shape[1] <= 12 + 5  # may stop early on eos


def test_hf_config_reads_tiny_config(tiny_dir):
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(tiny_dir)
    assert cfg.num_experts == 16 and cfg.num_experts_per_tok == 4
    assert cfg.mlp_only_layers == [0] and cfg.norm_topk_prob is True
    assert cfg.rope_parameters["rope_theta"] == 10000.0 and cfg.head_dim == 16
    assert cfg.vocab_size == tiny.VOCAB_SIZE == 2048


def test_tied_embeddings_checkpoint_loads(tmp_path):
    from transformers import AutoModelForCausalLM
    cfg = {**tiny.tiny_variant_config("qwen3"), "tie_word_embeddings": True}
    tiny.write_random_checkpoint(tmp_path, cfg, seed=3)
    assert not Checkpoint(tmp_path).has("lm_head.weight")
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_build_is_deterministic(tiny_dir, tmp_path):
    again = tiny.build_tiny_model(tmp_path / "again", seed=0)
    a, b = load_file(tiny_dir / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tiny_dir / name).read_bytes() == (again / name).read_bytes(), name
    other = tiny.write_random_checkpoint(tmp_path / "seed1", tiny.TINY_HF_CONFIG, seed=1)
    c = load_file(other / "model.safetensors")
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


def test_unknown_variant_rejected():
    with pytest.raises(ValueError, match="mixtral"):
        tiny.tiny_variant_config("mixtral")


# ------------------------------------------------------------ tokenizer


def test_tokenizer_round_trip_and_chat_template(tiny_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert len(tok) == tiny.VOCAB_SIZE
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == tok.pad_token_id == tiny.ENDOFTEXT_ID
    text = "def f(x):\n    return x ** 2  # ünïcødé 🙂 and the quick brown fox"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and all(0 <= i < tiny.BPE_VOCAB_SIZE for i in ids)
    assert tok.convert_tokens_to_ids("<|im_end|>") == tiny.IM_END_ID
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n"
                        "<|im_start|>assistant\n")
    ids = tok(rendered)["input_ids"]
    assert ids[0] == tiny.IM_START_ID and ids.count(tiny.IM_END_ID) == 2
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tiny.ENDOFTEXT_ID, tiny.IM_END_ID]


# ------------------------------------------------------------ Checkpoint


def test_checkpoint_load_full_and_sliced(tiny_dir):
    ckpt = Checkpoint(tiny_dir)
    reference = load_file(tiny_dir / "model.safetensors")
    assert ckpt.keys() == set(reference) and ckpt.hf_config == tiny.TINY_HF_CONFIG
    name = "model.layers.0.self_attn.q_proj.weight"  # [128, 128]
    assert ckpt.has(name) and not ckpt.has("nope") and ckpt.shape(name) == (128, 128)
    assert ckpt.bytes_read == 0  # shape() reads headers only
    assert torch.equal(ckpt.load(name), reference[name])
    assert ckpt.bytes_read == 128 * 128 * 4
    for dim, start, stop in [(0, 16, 48), (1, 5, 9), (-1, 0, 128), (0, 7, 7)]:
        before = ckpt.bytes_read
        part = ckpt.load(name, dim=dim, start=start, stop=stop)
        assert torch.equal(part, reference[name].narrow(dim, start, stop - start))
        assert part.is_contiguous()
        assert ckpt.bytes_read - before == part.nbytes == (stop - start) * 128 * 4
    assert torch.equal(ckpt.load(name, dim=1, start=100), reference[name][:, 100:])


def test_checkpoint_load_returns_owned_tensor(tiny_dir):
    ckpt = Checkpoint(tiny_dir)
    name = "model.norm.weight"
    first = ckpt.load(name)
    first.zero_()
    assert torch.equal(ckpt.load(name), load_file(tiny_dir / "model.safetensors")[name])


def test_checkpoint_bad_requests(tiny_dir):
    ckpt = Checkpoint(tiny_dir)
    with pytest.raises(KeyError, match="model.layers.99.mlp.gate.weight"):
        ckpt.load("model.layers.99.mlp.gate.weight")
    name = "model.norm.weight"
    with pytest.raises(ValueError, match="out of range"):
        ckpt.load(name, dim=0, start=0, stop=129)
    with pytest.raises(ValueError, match="dim 1"):
        ckpt.load(name, dim=1, start=0, stop=1)
    with pytest.raises(ValueError, match="without dim"):
        ckpt.load(name, start=0)
    with pytest.raises(KeyError, match="layer 0 has no routed experts"):
        ckpt.load_experts(0, [0])
    with pytest.raises(ValueError, match=r"\[16\]"):
        ckpt.load_experts(MOE_LAYER, [1, 16])


def test_sharded_checkpoint(tiny_dir, sharded_dir):
    single, sharded = Checkpoint(tiny_dir), Checkpoint(sharded_dir)
    assert single.keys() == sharded.keys()
    for name in sorted(single.keys())[::7]:
        assert torch.equal(single.load(name), sharded.load(name)), name
        rows = dict(dim=0, start=1, stop=3)
        assert torch.equal(single.load(name, **rows), sharded.load(name, **rows))
    ids = [3, 0, 9]
    for a, b in zip(single.load_experts(MOE_LAYER, ids), sharded.load_experts(MOE_LAYER, ids)):
        assert torch.equal(a, b)


EXPERT_IDS = [5, 6, 7, 2, 0, 15, 3, 4]  # out of order, with contiguous runs


def test_load_experts_matches_transformers_parameters(tiny_dir, hf_model):
    ckpt = Checkpoint(tiny_dir)
    assert ckpt.num_experts_in_file(MOE_LAYER) == 16 and ckpt.num_experts_in_file(0) == 0
    w13, w2 = ckpt.load_experts(MOE_LAYER, EXPERT_IDS)
    assert w13.shape == (8, 2 * 64, 128) and w2.shape == (8, 128, 64)
    experts = hf_model.model.layers[MOE_LAYER].mlp.experts  # fused [E, 2I, H] / [E, H, I]
    assert torch.equal(w13, experts.gate_up_proj.data[EXPERT_IDS])
    assert torch.equal(w2, experts.down_proj.data[EXPERT_IDS])
    gate = ckpt.load(f"model.layers.{MOE_LAYER}.mlp.experts.5.gate_proj.weight")
    assert torch.equal(w13[0, :64], gate)  # gate rows first, then up


@pytest.mark.parametrize("layout", ["hf_saved", "fused", "sharded"])
def test_load_experts_same_across_layouts(layout, tiny_dir, hf_saved_dir, fused_dir, sharded_dir):
    folder = {"hf_saved": hf_saved_dir, "fused": fused_dir, "sharded": sharded_dir}[layout]
    reference, other = Checkpoint(tiny_dir), Checkpoint(folder)
    for layer in (1, 2, 3):
        assert other.num_experts_in_file(layer) == 16
        for ref, got in zip(reference.load_experts(layer, EXPERT_IDS), other.load_experts(layer, EXPERT_IDS)):
            assert torch.equal(ref, got)
    empty13, empty2 = other.load_experts(MOE_LAYER, [])
    assert empty13.shape == (0, 128, 128) and empty2.shape == (0, 128, 64)


def test_fused_load_experts_reads_only_requested(fused_dir):
    ckpt = Checkpoint(fused_dir)
    assert ckpt.has(f"model.layers.{MOE_LAYER}.mlp.experts.gate_up_proj")
    w13, w2 = ckpt.load_experts(MOE_LAYER, [4, 5, 6, 11])
    per_expert = (2 * 64 * 128 + 128 * 64) * 4
    assert ckpt.bytes_read == 4 * per_expert == w13.nbytes + w2.nbytes


def test_missing_files_raise_file_not_found(tiny_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Checkpoint(tmp_path / "absent")
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        Checkpoint(tmp_path / "a_file")
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    shutil.copy(tiny_dir / "model.safetensors", no_config / "model.safetensors")
    with pytest.raises(FileNotFoundError, match=r"no_config has no config\.json"):
        Checkpoint(no_config)
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(tiny_dir / "config.json", no_weights / "config.json")
    with pytest.raises(FileNotFoundError, match=r"no_weights has neither model\.safetensors"):
        Checkpoint(no_weights)
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00001.safetensors"}}
    (no_weights / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="shard model-00001-of-00001.safetensors"):
        Checkpoint(no_weights)


# ------------------------------------------------------------ envs / default model dir


def test_envs_defaults_and_overrides(monkeypatch, tmp_path):
    monkeypatch.delenv("PHALANX_CACHE_DIR", raising=False)
    monkeypatch.delenv("PHALANX_LOG_LEVEL", raising=False)
    assert envs().cache_dir == Path.home() / ".cache" / "phalanx"
    assert envs().log_level == "WARNING"
    monkeypatch.setenv("PHALANX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PHALANX_LOG_LEVEL", "debug")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert envs().cache_dir == tmp_path and envs().log_level == "DEBUG"
    assert envs().triton_cache_path == tmp_path / "triton"  # compiled kernels kept with ours
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert envs().triton_cache_path == tmp_path / "mine"  # the user's choice wins
    monkeypatch.setenv("PHALANX_LOG_LEVEL", "LOUD")
    with pytest.raises(ValueError, match="PHALANX_LOG_LEVEL"):
        envs()


def test_default_model_dir_builds_once(monkeypatch, tmp_path, tiny_dir):
    monkeypatch.setenv("PHALANX_CACHE_DIR", str(tmp_path / "cache"))
    folder = tiny.default_model_dir()
    assert folder == tmp_path / "cache" / "tiny-qwen3-moe-v2"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["tiny-qwen3-moe-v2"]  # no temp left
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (folder / name).read_bytes() == (tiny_dir / name).read_bytes()
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert tiny.default_model_dir() == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime
