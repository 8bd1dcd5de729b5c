"""Read Hugging Face model folders tensor by tensor, slice by slice.

A ``Checkpoint`` maps every tensor name to the safetensors file holding it
(``model.safetensors``, or the shards listed in
``model.safetensors.index.json``) and reads only the bytes asked for, via
``safe_open(...).get_slice``; nothing is loaded up front.

MoE expert weights may be stored in either of two layouts, both read by
``load_experts``:
  per-expert (hub layout, also what transformers 5 ``save_pretrained`` writes):
    model.layers.{L}.mlp.experts.{E}.gate_proj.weight  [I, H]
    model.layers.{L}.mlp.experts.{E}.up_proj.weight    [I, H]
    model.layers.{L}.mlp.experts.{E}.down_proj.weight  [H, I]
  fused (transformers 5 in-memory parameters):
    model.layers.{L}.mlp.experts.gate_up_proj  [E, 2I, H]  rows: gate then up
    model.layers.{L}.mlp.experts.down_proj     [E, H, I]
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


def read_hf_config(folder: str | os.PathLike) -> dict:
    """config.json of a model folder (FileNotFoundError naming what is missing)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist or is not a directory")
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"model folder {folder} has no {CONFIG_FILE}")
    return json.loads(config_path.read_text())


class Checkpoint:
    """Lazy reader of one Hugging Face model folder.

    Attributes: ``folder`` (Path), ``hf_config`` (parsed config.json),
    ``bytes_read`` (sum of nbytes of every tensor or slice read by ``load``/``load_experts``).
    Open file handles are cached per file; call ``close()`` (or use the
    object as a context manager) to drop them.
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.hf_config: dict = read_hf_config(self.folder)
        self._handles: dict[str, object] = {}
        self._file_of: dict[str, str] = self._map_tensors()
        self.bytes_read = 0

    def _map_tensors(self) -> dict[str, str]:
        """tensor name -> file name (relative to the folder)."""
        index_path = self.folder / INDEX_FILE
        if index_path.is_file():
            weight_map = json.loads(index_path.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index_path} has no 'weight_map' object")
            for file in sorted(set(weight_map.values())):
                if not (self.folder / file).is_file():
                    raise FileNotFoundError(
                        f"model folder {self.folder}: shard {file} listed in {INDEX_FILE} is missing")
            return dict(weight_map)
        if (self.folder / SINGLE_FILE).is_file():
            return {name: SINGLE_FILE for name in self._handle(SINGLE_FILE).keys()}
        raise FileNotFoundError(f"model folder {self.folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")

    def _handle(self, file: str):
        handle = self._handles.get(file)
        if handle is None:
            handle = safe_open(str(self.folder / file), framework="pt")
            self._handles[file] = handle
        return handle

    def _file_handle(self, name: str):
        file = self._file_of.get(name)
        if file is None:
            raise KeyError(f"tensor {name!r} not found in checkpoint {self.folder}")
        return self._handle(file)

    def _slice_reader(self, name: str):
        return self._file_handle(name).get_slice(name)

    def close(self) -> None:
        """Drop the cached file handles (they are reopened on demand)."""
        self._handles.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def keys(self) -> set[str]:
        """All tensor names in the checkpoint."""
        return set(self._file_of)

    def has(self, name: str) -> bool:
        return name in self._file_of

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor ``name`` from the safetensors header (no data read)."""
        return tuple(self._slice_reader(name).get_shape())

    def load(
        self, name: str, dim: int | None = None, start: int | None = None, stop: int | None = None
    ) -> torch.Tensor:
        """Read tensor ``name``, or only ``[start:stop]`` along ``dim``.

        Only the requested bytes are read. ``start``/``stop`` default to the
        whole extent of ``dim`` and must satisfy 0 <= start <= stop <= size.
        Returns an owned, contiguous tensor (never a view of the file mapping,
        so callers may modify it). Raises KeyError for an unknown name,
        ValueError for a bad slice.
        """
        return self._read(name, dim, start, stop).clone(memory_format=torch.contiguous_format)

    def _read(self, name: str, dim: int | None = None, start: int | None = None, stop: int | None = None):
        """Like ``load`` but returns a read-only-by-contract view into the mmapped file.

        safetensors (>= 0.8) hands out views sharing one private mapping per
        open handle: writing into one would alter later reads, hence ``load``
        copies. Internal callers here only copy out of these views.
        """
        if dim is None:
            if start is not None or stop is not None:
                raise ValueError(f"load({name!r}): start/stop given without dim")
            tensor = self._file_handle(name).get_tensor(name)
        else:
            reader = self._slice_reader(name)
            index = self._slice_index(name, reader.get_shape(), dim, start, stop)
            tensor = reader[index]
        self.bytes_read += tensor.nbytes
        return tensor

    @staticmethod
    def _slice_index(name: str, shape: Sequence[int], dim: int, start: int | None, stop: int | None):
        ndim = len(shape)
        if not -ndim <= dim < ndim:
            raise ValueError(f"load({name!r}): dim {dim} out of range for shape {tuple(shape)}")
        dim %= ndim
        start = 0 if start is None else start
        stop = shape[dim] if stop is None else stop
        if not 0 <= start <= stop <= shape[dim]:
            raise ValueError(
                f"load({name!r}): slice [{start}:{stop}] out of range for dim {dim} of size {shape[dim]}")
        return (slice(None),) * dim + (slice(start, stop),)

    # ------------------------------------------------------------ experts

    @staticmethod
    def _expert_prefix(layer: int) -> str:
        return f"model.layers.{layer}.mlp.experts"

    def _is_fused(self, layer: int) -> bool:
        return self.has(f"{self._expert_prefix(layer)}.gate_up_proj")

    def num_experts_in_file(self, layer: int) -> int:
        """Number of routed experts stored for ``layer`` (0 for a dense layer)."""
        prefix = self._expert_prefix(layer)
        if self._is_fused(layer):
            return self.shape(f"{prefix}.gate_up_proj")[0]
        count = 0
        while self.has(f"{prefix}.{count}.gate_proj.weight"):
            count += 1
        return count

    def load_experts(self, layer: int, expert_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights of experts ``expert_ids`` (in that order) of MoE layer ``layer``.

        Returns ``(w13 [n, 2I, H], w2 [n, H, I])`` where w13[i] is
        cat(gate_proj.weight, up_proj.weight, dim=0) of expert expert_ids[i]
        and w2[i] its down_proj.weight. Reads only the requested experts.
        Raises KeyError if the layer has no experts, ValueError for a bad id.
        """
        expert_ids = [int(e) for e in expert_ids]
        num_experts = self.num_experts_in_file(layer)
        if num_experts == 0:
            raise KeyError(f"layer {layer} has no routed experts in checkpoint {self.folder}")
        bad = [e for e in expert_ids if not 0 <= e < num_experts]
        if bad:
            raise ValueError(f"expert ids {bad} out of range for layer {layer} with {num_experts} experts")
        if self._is_fused(layer):
            return self._load_fused_experts(layer, expert_ids)
        return self._load_per_expert(layer, expert_ids)

    def _load_fused_experts(self, layer: int, expert_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        prefix = self._expert_prefix(layer)
        w13_parts, w2_parts = [], []
        for first, stop in _consecutive_runs(expert_ids):
            w13_parts.append(self._read(f"{prefix}.gate_up_proj", dim=0, start=first, stop=stop))
            w2_parts.append(self._read(f"{prefix}.down_proj", dim=0, start=first, stop=stop))
        if not expert_ids:
            w13_shape, w2_shape = self.shape(f"{prefix}.gate_up_proj"), self.shape(f"{prefix}.down_proj")
            dtype = self._slice_reader(f"{prefix}.gate_up_proj").get_dtype()
            return _empty_like_rows(w13_shape, dtype), _empty_like_rows(w2_shape, dtype)
        return torch.cat(w13_parts), torch.cat(w2_parts)

    def _load_per_expert(self, layer: int, expert_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        prefix = self._expert_prefix(layer)
        inter, hidden = self.shape(f"{prefix}.0.gate_proj.weight")
        dtype = _TORCH_DTYPES[self._slice_reader(f"{prefix}.0.gate_proj.weight").get_dtype()]
        n = len(expert_ids)
        w13 = torch.empty((n, 2 * inter, hidden), dtype=dtype)
        w2 = torch.empty((n, hidden, inter), dtype=dtype)
        for i, e in enumerate(expert_ids):
            w13[i, :inter] = self._read(f"{prefix}.{e}.gate_proj.weight")
            w13[i, inter:] = self._read(f"{prefix}.{e}.up_proj.weight")
            w2[i] = self._read(f"{prefix}.{e}.down_proj.weight")
        return w13, w2


def _consecutive_runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """Split ``ids`` (in order) into maximal runs e, e+1, ...; returns [start, stop) pairs."""
    runs: list[tuple[int, int]] = []
    for e in ids:
        if runs and runs[-1][1] == e:
            runs[-1] = (runs[-1][0], e + 1)
        else:
            runs.append((e, e + 1))
    return runs


# safetensors dtype strings -> torch dtypes
_TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def _empty_like_rows(shape: Sequence[int], dtype: str) -> torch.Tensor:
    return torch.empty((0, *shape[1:]), dtype=_TORCH_DTYPES[dtype])
