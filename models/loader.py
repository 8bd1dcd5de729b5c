"""Open a Hugging Face model folder and build one rank's shard of it."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import torch

from ..config import ModelConfig
from .checkpoint import Checkpoint
from .parallel import ExpertParallel, ModelComm
from .qwen3_moe import CausalLM
from .shard import ModelShard
from .weights import load_weights


def read_model_config(path: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` of a model folder (raises FileNotFoundError / ValueError).

    End-of-sequence ids are the union of config.json's and generation_config.json's
    (chat models list their end-of-turn token only in the latter)."""
    ckpt = Checkpoint(path)
    cfg = ModelConfig.from_hf(ckpt.hf_config)
    gen_path = ckpt.folder / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        merged = tuple(dict.fromkeys([*cfg.eos_token_ids, *extra]))
        cfg = dataclasses.replace(cfg, eos_token_ids=merged)
    return cfg


def load_model(path: str | os.PathLike, cfg: ModelConfig, shard: ModelShard,
               device: torch.device, dtype: torch.dtype,
               comm: Optional[ModelComm] = None, ep: Optional[ExpertParallel] = None,
               quantize: bool = False) -> CausalLM:
    """Build the shard's modules and fill them from the checkpoint (only the shard is
    read); `quantize`: projections to FP8 on load (an FP8 checkpoint is FP8 anyway)."""
    ckpt = Checkpoint(path)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = CausalLM(cfg, shard, comm, ep)
    finally:
        torch.set_default_dtype(prev)
    load_weights(model, ckpt, quantize)
    return model.to(device).eval()
