"""Open a Hugging Face model folder and build one rank's shard of it."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Optional

import torch

from ..config import ModelConfig
from .checkpoint import Checkpoint, read_hf_config
from .fp8_weights import keep_fp8_layouts
from .parallel import ExpertParallel, ModelComm
from .qwen3_moe import CausalLM
from .random_weights import RandomWeights
from .shard import ModelShard
from .weights import load_weights


def read_model_config(path: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` of a model folder (raises FileNotFoundError / ValueError).

    End-of-sequence ids are the union of config.json's and generation_config.json's
    (chat models list their end-of-turn token only in the latter)."""
    cfg = ModelConfig.from_hf(read_hf_config(path))
    gen_path = Path(path) / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        merged = tuple(dict.fromkeys([*cfg.eos_token_ids, *extra]))
        cfg = dataclasses.replace(cfg, eos_token_ids=merged)
    return cfg


def load_model(path: str | os.PathLike, cfg: ModelConfig, shard: ModelShard,
               device: torch.device, dtype: torch.dtype,
               comm: Optional[ModelComm] = None, ep: Optional[ExpertParallel] = None,
               quantize: bool = False, load_format: str = "auto",
               tp_invariant_width: int = 1) -> CausalLM:
    """Build the shard's modules and fill them from the checkpoint (only the shard is
    read); `quantize`: projections to FP8 on load (an FP8 checkpoint is FP8 anyway).
    `load_format` "dummy": seeded random weights drawn on `device` (models/random_weights.py;
    the folder needs only config.json), the modules built there too.
    `tp_invariant_width`: CausalLM's (models/row_parallel.py)."""
    dummy = load_format == "dummy"
    ckpt = RandomWeights(path, seed=0, device=device) if dummy else Checkpoint(path)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device if dummy else "cpu"):
            model = CausalLM(cfg, shard, comm, ep, tp_invariant_width)
    finally:
        torch.set_default_dtype(prev)
    load_weights(model, ckpt, quantize)
    model = model.to(device).eval()
    keep_fp8_layouts(model)
    return model
