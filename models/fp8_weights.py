"""Reading projection weights as FP8 (kernels/fp8.py's format) for one rank's shard.

Two sources, one result: an FP8 checkpoint (``<name>.weight`` in float8_e4m3fn with
``<name>.weight_scale_inv`` per 128 x 128 block, `quantization_config.quant_method ==
"fp8"`), or a bf16/float32 checkpoint quantized on load (`quantize`). Either way a
tensor is quantized as the whole checkpoint tensor would be: block bounds are the full
tensor's, so a shard's rows carry the same codes and scales in every layout. On load the
reader takes only the shard's rows, widened to whole 128-row blocks where it quantizes
(a block's scale needs all its rows); a cut of the columns must fall on block bounds.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels.fp8 import (BLOCK, FP8, check_k_cut, expand_block_scales, quantize_blocks,
                           slice_k_blocks)
from ..kernels.fp8_cublas import block_scaled_gemm_error, keep_n_major
from ..log import get_logger
from .checkpoint import Checkpoint

__all__ = ["Fp8Weight", "check_fp8_tp", "fp8_scales", "is_fp8_checkpoint", "keep_fp8_layouts",
           "read_fp8", "read_fp8_experts", "use_fp8"]

log = get_logger(__name__)

Fp8Weight = tuple[torch.Tensor, torch.Tensor]  # (codes [.., N, K] fp8, scales [.., N, KB])


def is_fp8_checkpoint(hf_config: dict) -> bool:
    """Whether config.json says the projections are stored as block-scaled FP8."""
    q = hf_config.get("quantization_config") or {}
    if q.get("quant_method") != "fp8":
        return False
    block = q.get("weight_block_size")
    if block is not None and list(block) != [BLOCK, BLOCK]:
        raise ValueError(f"quantization_config.weight_block_size {block}: only "
                         f"[{BLOCK}, {BLOCK}] blocks are supported")
    return True


def check_fp8_tp(cfg, tp: int, what: str = "tp") -> None:
    """ValueError naming `what` unless every column cut a TP size of `tp` makes in FP8
    weights (the attention output's heads, the dense and shared-expert MLPs' rows of
    down) falls on 128-column blocks. `cfg`: a `ModelConfig`."""
    if tp <= 1:
        return
    cuts = {"attention heads": cfg.num_attention_heads // tp * cfg.head_dim}
    if cfg.intermediate_size:
        cuts["MLP intermediate"] = cfg.intermediate_size // tp
    if cfg.shared_expert_intermediate_size:
        cuts["shared expert intermediate"] = cfg.shared_expert_intermediate_size // tp
    bad = {k: v for k, v in cuts.items() if v % BLOCK}
    if bad:
        raise ValueError(f"{what}: {what}={tp} cuts FP8 weights off their {BLOCK}-column "
                         f"blocks ({', '.join(f'{k} {v} per rank' for k, v in bad.items())}); "
                         f"choose a TP size whose shards are multiples of {BLOCK}")


def read_fp8(ckpt: Checkpoint, name: str, rows: Optional[range] = None,
             cols: Optional[range] = None) -> Fp8Weight:
    """`name` (without ``.weight``) rows `rows` and columns `cols` (default all) as FP8:
    read as stored when the checkpoint has its scales, else quantized from its values."""
    n, k = ckpt.shape(f"{name}.weight")
    rows = rows if rows is not None else range(n)
    cols = cols if cols is not None else range(k)
    if ckpt.has(f"{name}.weight_scale_inv"):
        q = _read(ckpt, f"{name}.weight", rows, cols)
        blocks = ckpt.load(f"{name}.weight_scale_inv", dim=0, start=rows.start // BLOCK,
                           stop=-(-rows.stop // BLOCK))
        scales = expand_block_scales(blocks, len(range(rows.start // BLOCK * BLOCK, rows.stop)))
        scales = scales[rows.start % BLOCK:]
        return q.to(FP8), slice_k_blocks(scales, k, cols.start, cols.stop)
    wide = range(rows.start // BLOCK * BLOCK, min(n, -(-rows.stop // BLOCK) * BLOCK))
    check_k_cut(k, cols.start, cols.stop)
    q, blocks = quantize_blocks(_read(ckpt, f"{name}.weight", wide, cols))
    lo = rows.start - wide.start
    return (q[lo:lo + len(rows)].contiguous(),
            expand_block_scales(blocks, len(wide))[lo:lo + len(rows)].contiguous())


def _read(ckpt: Checkpoint, name: str, rows: range, cols: range) -> torch.Tensor:
    """Only the bytes of `rows` x `cols` where one of them is whole."""
    n, k = ckpt.shape(name)
    if len(rows) == n:
        return ckpt.load(name, dim=1, start=cols.start, stop=cols.stop)
    t = ckpt.load(name, dim=0, start=rows.start, stop=rows.stop)
    return t if len(cols) == k else t[:, cols.start:cols.stop].contiguous()


def read_fp8_experts(ckpt: Checkpoint, layer: int, expert_ids: list[int]
                     ) -> tuple[Fp8Weight, Fp8Weight]:
    """The experts' (w13, w2) as FP8 stacks: gate, up and down each quantized (or read)
    as its own checkpoint tensor, gate and up joined along N."""
    prefix = f"model.layers.{layer}.mlp.experts"
    w13, s13, w2, s2 = [], [], [], []
    for e in expert_ids:
        gate, up = (read_fp8(ckpt, f"{prefix}.{e}.{p}") for p in ("gate_proj", "up_proj"))
        down = read_fp8(ckpt, f"{prefix}.{e}.down_proj")
        w13.append(torch.cat([gate[0], up[0]]))
        s13.append(torch.cat([gate[1], up[1]]))
        w2.append(down[0])
        s2.append(down[1])
    if not expert_ids:
        raise ValueError("FP8 experts: no expert to read")
    return (torch.stack(w13), torch.stack(s13)), (torch.stack(w2), torch.stack(s2))


def use_fp8(module: torch.nn.Module, name: str, weight: Fp8Weight) -> None:
    """Put FP8 `weight` into `module.<name>` (the parameter's data, shape checked) and
    its scales into `module.<name>_scale` (a 2-D weight's on a GPU also N-major,
    `keep_n_major`)."""
    param = getattr(module, name)
    q, scales = weight
    if tuple(param.shape) != tuple(q.shape):
        raise ValueError(f"{name}: FP8 weight {tuple(q.shape)} != expected {tuple(param.shape)}")
    param.data = q
    setattr(module, f"{name}_scale", keep_n_major(scales.to(torch.float32)))


def fp8_scales(model: torch.nn.Module) -> list[torch.Tensor]:
    """The scales of every FP8 weight in `model` (the `<name>_scale` buffers that are set)."""
    return [buf for module in model.modules() for name, buf in module.named_buffers(recurse=False)
            if name.endswith("_scale") and buf is not None]


def keep_fp8_layouts(model: torch.nn.Module) -> None:
    """Once `model` is on its device (moving it copies its buffers, and a copy does not
    carry `keep_n_major`'s layout): every 2-D FP8 weight's scales get their N-major copy,
    where that GPU runs cuBLAS's block-scaled GEMM at its shape; a shape it refuses is
    logged once (those weights keep the Triton FP8 linears)."""
    refused = set()
    for scales in fp8_scales(model):
        if keep_n_major(scales).is_cuda and scales.dim() == 2 and not hasattr(scales, "n_major"):
            refused.add((scales.device.index, *scales.shape))
    for index, n, kb in sorted(refused):  # these keep the Triton FP8 linears
        log.warning("fp8.cublas_block_scaled_unavailable", device=index, rows=n, k_blocks=kb,
                    error=block_scaled_gemm_error(index, n, kb))
