"""A random-weight checkpoint of a Qwen3-MoE shape for `bench/disagg.py`: a Hugging Face
folder (config.json, one safetensors shard per layer plus one for the embeddings and
head, model.safetensors.index.json) that every phalanx layout loads like a real model.

Every tensor is `models.random_weights.draw` (its own generator seeded by (seed, name), on
the given device: a GPU draws the Qwen3-30B-A3B shape's ~0.75 B parameters per layer in
well under a second; scaled as the tiny model's are, so activations stay O(1) and the
router's and the head's margins clear), stored in the config's dtype: the folder loads
equal to `load_format="dummy"` with that seed and device. One shard is in host memory at
a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from phalanx.models.random_weights import draw
from phalanx.models.tiny import checkpoint_shapes

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def _shard_of(name: str) -> str:
    """Layer i's tensors go to `layer-{i}.safetensors`, the rest to `outer.safetensors`."""
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        return f"layer-{int(parts[2]):03d}.safetensors"
    return "outer.safetensors"


def write_checkpoint(folder: str | Path, hf_config: dict, seed: int,
                     device: torch.device) -> tuple[Path, int]:
    """Write the folder; (folder, bytes of weights written)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = DTYPES[hf_config["dtype"]]
    shapes = checkpoint_shapes(hf_config)
    by_shard: dict[str, list[str]] = {}
    for name in sorted(shapes):
        by_shard.setdefault(_shard_of(name), []).append(name)
    total = 0
    for shard, names in sorted(by_shard.items()):
        tensors = {}
        for name in names:
            tensors[name] = draw(name, shapes[name], seed, device, dtype).cpu()
            total += tensors[name].nbytes
        save_file(tensors, str(folder / shard), metadata={"format": "pt"})
    weight_map = {name: shard for shard, names in by_shard.items() for name in names}
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    write_config(folder, hf_config)
    return folder, total


def write_config(folder: Path, hf_config: dict) -> None:
    """config.json alone: with `load_format="dummy"` the folder serves the same weights
    as `write_checkpoint` with seed 0 on the device that loads it."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["Qwen3MoeForCausalLM"], **hf_config}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
