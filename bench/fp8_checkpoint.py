"""FP8 checkpoints for checks and benchmarks (issue 33): a model folder's projections
written as block-scaled FP8 the way Qwen3/DeepSeek FP8 checkpoints store them
(``<name>.weight`` float8_e4m3fn, ``<name>.weight_scale_inv`` per 128 x 128 block,
``quantization_config = {quant_method: fp8, weight_block_size: [128, 128]}``), and the
dequantized twin of such a folder (the same numbers as plain weights), the oracle an FP8
path is compared with.

    python bench/fp8_checkpoint.py SRC DST            # FP8 version of SRC
    python bench/fp8_checkpoint.py --twin FP8 DST     # its dequantized twin (float32)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from phalanx.kernels.fp8 import dequantize, expand_block_scales, quantize_blocks
from phalanx.models.checkpoint import Checkpoint

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def is_projection(name: str) -> bool:
    """Attention and MLP/expert projections (the router `mlp.gate`, embeddings, norms and
    the LM head stay unquantized, as in the published FP8 checkpoints)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in PROJECTIONS


def _write(dst: Path, tensors: dict, config: dict, src: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    for f in _FILES:
        if (src / f).is_file():
            shutil.copy(src / f, dst / f)
    return dst


def write_fp8_checkpoint(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """SRC's projections quantized per 128 x 128 block; everything else as it was."""
    src, ckpt = Path(src), Checkpoint(src)
    tensors = {}
    for name in sorted(ckpt.keys()):
        t = ckpt.load(name)
        if is_projection(name):
            q, scales = quantize_blocks(t)
            tensors[name], tensors[f"{name}_scale_inv"] = q, scales
        else:
            tensors[name] = t
    config = {**ckpt.hf_config, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128]}}
    return _write(Path(dst), tensors, config, src)


def write_dequantized_twin(fp8: str | os.PathLike, dst: str | os.PathLike,
                           dtype: str = "float32") -> Path:
    """The FP8 folder's weights as plain `dtype` tensors (q x scale, per block)."""
    fp8, ckpt = Path(fp8), Checkpoint(fp8)
    out_dtype = getattr(torch, dtype)
    tensors = {}
    for name in sorted(ckpt.keys()):
        if name.endswith("_scale_inv"):
            continue
        t = ckpt.load(name)
        if ckpt.has(f"{name}_scale_inv"):
            scales = expand_block_scales(ckpt.load(f"{name}_scale_inv"), t.shape[0])
            t = dequantize(t, scales, out_dtype)
        elif t.is_floating_point():
            t = t.to(out_dtype)
        tensors[name] = t
    config = {k: v for k, v in ckpt.hf_config.items() if k != "quantization_config"}
    config["torch_dtype"] = config["dtype"] = dtype
    return _write(Path(dst), tensors, config, fp8)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--twin", action="store_true", help="SRC is FP8: write its dequantized twin")
    ap.add_argument("--dtype", default="float32", help="the twin's dtype")
    args = ap.parse_args(argv)
    out = (write_dequantized_twin(args.src, args.dst, args.dtype) if args.twin
           else write_fp8_checkpoint(args.src, args.dst))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
