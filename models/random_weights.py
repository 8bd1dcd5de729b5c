"""Random weights in place of a checkpoint's (`load_format="dummy"`, vLLM's name).

A model folder with config.json (and a tokenizer) but no weights serves as if its
safetensors held seeded noise: `RandomWeights` answers the reads `models/weights.py`
makes of a `Checkpoint` (``shape``, ``has``, ``load`` with a slice, ``load_experts``),
drawing each tensor whole on the given device and slicing it, so every rank of every
layout sees the same full tensor whatever part it reads. Benchmarks use it for shapes
whose checkpoint would not fit a disk (48 layers of Qwen3-30B-A3B: 61 GB in bf16).

Tensor `name` is `draw(name, shape, seed, device, dtype)`: standard normal noise from a
generator seeded by (seed, name), scaled as the tiny model's (`tiny.scale_noise`), rounded
to the config's dtype. `bench/disagg_checkpoint.py` writes the same tensors to disk, so a
folder written with seed s on device d loads equal to `RandomWeights(.., s, d)`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from .checkpoint import read_hf_config
from .tiny import checkpoint_shapes, scale_noise

__all__ = ["RandomWeights", "draw", "tensor_seed"]

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}|{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def draw(name: str, shape: Sequence[int], seed: int, device: torch.device,
         dtype: torch.dtype) -> torch.Tensor:
    """Tensor `name` of `shape` (see the module docstring), on `device`."""
    gen = torch.Generator(device=device)
    gen.manual_seed(tensor_seed(seed, name))
    noise = torch.randn(tuple(shape), generator=gen, device=device, dtype=torch.float32)
    return scale_noise(name, noise).to(dtype)


class RandomWeights:
    """A `Checkpoint` look-alike over config.json whose tensors are drawn, not read.

    ``bytes_read`` counts the bytes handed out (as a checkpoint's reads)."""

    def __init__(self, folder: str | os.PathLike, seed: int = 0,
                 device: torch.device | str = "cpu") -> None:
        self.folder = Path(folder)
        self.hf_config: dict = read_hf_config(self.folder)
        self._shapes = checkpoint_shapes(self.hf_config)
        self._dtype = _DTYPES.get(self.hf_config.get("dtype") or self.hf_config.get("torch_dtype")
                                  or "float32", torch.float32)
        self.seed = seed
        self.device = torch.device(device)
        self.bytes_read = 0

    def keys(self) -> set[str]:
        return set(self._shapes)

    def has(self, name: str) -> bool:
        return name in self._shapes

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._shapes:
            raise KeyError(f"tensor {name!r} is not in the model of {self.folder}")
        return tuple(self._shapes[name])

    def load(self, name: str, dim: int | None = None, start: int | None = None,
             stop: int | None = None) -> torch.Tensor:
        """Tensor `name`, or `[start:stop]` along `dim` (bounds checked as a checkpoint's)."""
        full = draw(name, self.shape(name), self.seed, self.device, self._dtype)
        if dim is None:
            if start is not None or stop is not None:
                raise ValueError(f"load({name!r}): start/stop given without dim")
            part = full
        else:
            dim %= full.dim()
            start = 0 if start is None else start
            stop = full.shape[dim] if stop is None else stop
            if not 0 <= start <= stop <= full.shape[dim]:
                raise ValueError(f"load({name!r}): slice [{start}:{stop}] out of range for dim "
                                 f"{dim} of size {full.shape[dim]}")
            part = full.narrow(dim, start, stop - start).contiguous()
        self.bytes_read += part.nbytes
        return part

    def load_experts(self, layer: int, expert_ids: Sequence[int]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [n, 2I, H], w2 [n, H, I]) of `expert_ids`, as `Checkpoint.load_experts`."""
        prefix = f"model.layers.{layer}.mlp.experts"
        if not self.has(f"{prefix}.0.gate_proj.weight"):
            raise KeyError(f"layer {layer} has no routed experts")
        if not expert_ids:
            (inter, hidden), dt = self.shape(f"{prefix}.0.gate_proj.weight"), self._dtype
            return (torch.empty((0, 2 * inter, hidden), dtype=dt, device=self.device),
                    torch.empty((0, hidden, inter), dtype=dt, device=self.device))
        w13 = [torch.cat([self.load(f"{prefix}.{e}.gate_proj.weight"),
                          self.load(f"{prefix}.{e}.up_proj.weight")]) for e in expert_ids]
        w2 = [self.load(f"{prefix}.{e}.down_proj.weight") for e in expert_ids]
        return torch.stack(w13), torch.stack(w2)

    def close(self) -> None:
        """Nothing is held open (as `Checkpoint.close`)."""
