"""Baseline rows for `bench/decode_gpu.py --baselines`: the same model and batches with one
few-row part turned off, in the same process, tokens checked against the main rows.

* ``nopdl``: kernels launched without programmatic dependent launch
  (`kernels/gpu/pdl.py` ``set_pdl(False)``); the arithmetic is the same, so the greedy
  tokens must equal the main rows' exactly. Every batch.
* ``pdlgemv``: PDL for the projections' GEMVs only (the other kernels of the layer
  launched plainly). Every batch.
* ``cublas``: no few-row GEMV (``kernels.linear.GEMV_MAX_M = 0``): cuBLAS projections and
  the norm kernels on their own, as before the GEMV; tokens agree within bf16 rounding.
  The batches the GEMV takes (at most ``GEMV_MAX_M``).
* ``moe32``: the small MoE path's gate_up with 32-row tiles instead of 64 (twice the
  programs); an MMA's result does not depend on the N tiling, so tokens equal.
* ``part128`` / ``part32``: decode attention with 128 / 32 positions per split at batch 1
  (64 by default).
* ``moew8`` / ``moes<N>``: the small MoE path with 8 warps / N pipeline stages at every
  batch (default 4 warps; 4 stages at batch 1, 3 above).
* ``attnreduce``: decode attention's splits merged by a second launch (the reduce
  kernel) instead of by the last split to arrive; the same merge, so tokens equal.
* ``attn64``: decode attention with 64 positions a tile at every batch (32 past 64
  sequences by default); the softmax sums run in another order, so tokens agree within
  rounding.
* ``attnahead``: decode attention's page ids loaded a tile ahead with 3 pipeline stages
  (`kernels.gpu.attention.PAGE_PREFETCH` on; off by default until measured), so the next
  tile's K/V copies stay in flight while a tile computes; the same tiles in the same
  order, so tokens equal.
* ``attnwide``: decode attention with a program for every split of the block table
  (`kernels.gpu.decode_plan.GRID_POSITIONS = None`), as before the grid was capped; with
  tables wider than 4096 positions (`decode_gpu.py --max-model-len`) the positions per
  split can differ too, so tokens agree within rounding.
* ``invariant``: the batch-invariant mode (kernels/batch_invariant.py: every linear one
  Triton GEMM, decode attention's fixed split plan); its cost in speed. Other kernels and
  sums, so tokens agree within rounding. Every batch.
* ``invfold`` / ``invpdl``: the mode with the residual add + RMSNorm folded into its GEMM
  at a few rows (``invariant_gemm.FOLD_MAX_M`` 16; the same bits as the norm kernel, so
  tokens equal ``invariant``'s) / with the GEMM launched under PDL ("gemm",
  kernels/gpu/pdl.py; the same arithmetic). Both off by default until measured each alone
  (together they ran batch 1 at 0.55x the mode's speed on one H100). Every batch.
* ``invw2`` / ``invw8``: the mode with the row-parallel sums of a layout whose widest TP
  group is 2 / 8 (``tp_invariant_width``, models/row_parallel.py): this one-rank engine's o
  projection sums K in 2 / 8 chunks added as a tree in its GEMM's launch; the cost a TP1
  decode rank pays for a TP2 / TP8 prefill side's bits. Other sums, so tokens agree with
  ``invariant``'s within rounding. Every batch.
* ``routefold``: the routing folded into the router's GEMV at batch 1
  (`kernels.norm_linear.ROUTE_FOLD` on; off by default until measured); ties aside, the
  top-k ids are the route kernel's, so tokens equal.

Each baseline builds a fresh engine (its graphs are captured with the part off).
"""

from __future__ import annotations

import gc

import torch

from phalanx.kernels.linear import GEMV_MAX_M as _GEMV_MAX_M

BASELINES = ("nopdl", "pdlgemv", "cublas", "moe32", "part128", "part32", "moew8", "moes2", "moes3",
             "moes4", "moes5", "moes6", "routefold", "attnreduce", "attn64", "attnahead", "attnwide", "invariant",
             "invfold", "invpdl", "invw2", "invw8")
_SAVED: dict = {}
_WIDTH = [1]


def baseline_width() -> int:
    """The ``tp_invariant_width`` of the model the switched-on baseline builds."""
    return _WIDTH[0]


def _switch(name: str, on: bool) -> None:
    from phalanx.kernels import linear

    if name == "nopdl":
        _pdl(on, lambda now: frozenset())
    elif name == "pdlgemv":
        _pdl(on, lambda now: frozenset({"gemv"}))
    elif name == "cublas":
        linear.GEMV_MAX_M = 0 if on else _GEMV_MAX_M
    elif name.startswith(("part", "attn")):
        _switch_attention(name, on)
    elif name.startswith("inv"):
        _switch_invariant(name, on)
    elif name == "routefold":
        from phalanx.kernels import norm_linear
        norm_linear.ROUTE_FOLD = on
    elif name.startswith("moe"):
        _switch_moe(name, on)


def _switch_attention(name: str, on: bool) -> None:
    """part128 / part32, attnreduce, attn64, attnahead, attnwide."""
    from phalanx.kernels.gpu import attention, decode_plan

    if name in ("part128", "part32"):
        if on:
            real = _SAVED["part"] = decode_plan._decode_partition
            want = int(name[4:])
            decode_plan._decode_partition = lambda s, *a: want if s == 1 else real(s, *a)
        else:
            decode_plan._decode_partition = _SAVED.pop("part")
    elif name == "attnreduce":
        if on:
            _SAVED["counts"] = attention.arrival_counts
            attention.arrival_counts = lambda *a, **k: None
        else:
            attention.arrival_counts = _SAVED.pop("counts")
    elif name == "attn64":
        if on:
            _SAVED["bn"] = decode_plan._decode_block_n
            decode_plan._decode_block_n = lambda s, d: 64 if d <= 128 else 32
        else:
            decode_plan._decode_block_n = _SAVED.pop("bn")
    elif name == "attnahead":
        attention.PAGE_PREFETCH = on
    elif name == "attnwide":
        if on:
            _SAVED["grid"] = decode_plan.GRID_POSITIONS
            decode_plan.GRID_POSITIONS = None
        else:
            decode_plan.GRID_POSITIONS = _SAVED.pop("grid")


def _switch_invariant(name: str, on: bool) -> None:
    """invariant, invfold, invpdl, invw<N> (decode_gpu.make_engine takes the process's mode)."""
    from phalanx.kernels.batch_invariant import batch_invariant
    from phalanx.kernels.gpu import invariant_gemm

    batch_invariant(on)
    if name == "invfold":
        if on:
            _SAVED["fold"], invariant_gemm.FOLD_MAX_M = invariant_gemm.FOLD_MAX_M, 16
        else:
            invariant_gemm.FOLD_MAX_M = _SAVED.pop("fold")
    elif name == "invpdl":
        _pdl(on, lambda now: now | {"gemm"})
    elif name.startswith("invw"):
        _WIDTH[0] = int(name[4:]) if on else 1


def _switch_moe(name: str, on: bool) -> None:
    """moe32, moew8, moes<N>: the small MoE path's tiles, warps or stages."""
    from phalanx.kernels.gpu import moe_decode

    dot = moe_decode._CONFIG
    if name == "moe32":
        dot["N1"] = 32 if on else 64
        return
    keys = ("warps",) if name == "moew8" else ("stages", "stages1")
    value = 8 if name == "moew8" else int(name[4:])
    for key in keys:
        if on:
            _SAVED[key] = dot[key]
            dot[key] = value
        else:
            dot[key] = _SAVED.pop(key)


def _pdl(on: bool, chosen) -> None:
    """Turn PDL's kernel set to ``chosen(current)`` (on) or back (off)."""
    from phalanx.kernels.gpu.pdl import set_pdl
    if on:
        _SAVED["pdl"] = set_pdl(True)
        set_pdl(chosen(_SAVED["pdl"]))
    else:
        set_pdl(_SAVED.pop("pdl"))


def baseline_rows(names: list[str], build_engine, decode_rows, main_rows: list[dict],
                  batches: list[int], prefill_row=None) -> list[dict]:
    """Rows ``decode-<name>`` for each baseline; ``build_engine()`` makes a new engine,
    ``decode_rows(engine, kind, batches)`` measures it. Tokens: `token_agreement` with
    the main rows of the same batch. With ``prefill_row(engine, kind)``, the
    ``invariant`` baseline adds its ``prefill-invariant`` row (``main_over_this`` against
    the main prefill row)."""
    from decode_fp8 import token_agreement

    rows = []
    for name in names:
        if name not in BASELINES:
            raise SystemExit(f"--baselines: {name!r} is not one of {BASELINES}")
        _switch(name, True)
        try:
            engine = build_engine()
            got = decode_rows(engine, f"decode-{name}",
                              [b for b in batches if name != "cublas" or b <= _GEMV_MAX_M])
            if prefill_row is not None and name.startswith("inv"):
                pf = prefill_row(engine, f"prefill-{name}")
                main_pf = next(o for o in main_rows if o["kind"] == "prefill")
                rows.append(dict(pf, main_over_this=main_pf["tok_s"] / pf["tok_s"]))
        finally:
            _switch(name, False)
            engine = None
            gc.collect()
            torch.cuda.empty_cache()
        for r in got:
            main = next(o for o in main_rows if o["kind"] == "decode" and o["batch"] == r["batch"])
            r["agreement"] = token_agreement(main["tokens"], r["tokens"])
            r["main_over_this"] = main["tok_s"] / r["tok_s"]
        rows += got
    return rows
