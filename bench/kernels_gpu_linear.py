"""The `linear` group of `bench/kernels_gpu.py` (skinny GEMM): its shapes and tile
sweep, the correctness check against F.linear and the timings against cuBLAS.

Imports nothing GPU-specific (nor phalanx) at module import time.
"""

from __future__ import annotations

from kernels_gpu_inputs import HD, HID, NE, NKV, NQ, Ctx

LINEAR_BW = 4.2e12  # B/s, the floor of the linear rows: weight bytes / LINEAR_BW
LINEAR_SHAPES = {"qkv": (NQ * HD + 2 * NKV * HD, HID), "o": (HID, NQ * HD), "router": (NE, HID)}  # (N, K)
# Tile overrides timed at M = 1 and 16 on top of the defaults (gpu.linear.linear_config).
LINEAR_SWEEP = {
    "qkv": [dict(BLOCK_N=32), dict(BLOCK_K=512), dict(BLOCK_K=128), dict(warps=8), dict(stages=3),
            dict(BLOCK_N=64, BLOCK_K=128)],
    "o": [dict(BLOCK_K=256), dict(BLOCK_K=256, SPLIT_K=2), dict(warps=8), dict(stages=3),
          dict(BLOCK_N=32, BLOCK_K=256)],
    "router": [dict(SPLIT_K=2), dict(SPLIT_K=4, BLOCK_K=256), dict(SPLIT_K=8, BLOCK_K=256),
               dict(BLOCK_K=1024, stages=3), dict(BLOCK_K=256), dict(warps=8)],
}


def _linear_shapes(c: Ctx) -> dict:
    """(N, K) per case: the decode shapes (tiny ones in a dry run) and an odd one."""
    small = {"qkv": (96, 64), "o": (64, 128), "router": (16, 64)}
    return {**(small if c.small else LINEAR_SHAPES), "odd": (100, 72)}


def _tiles(cfg: dict) -> str:
    return f"{cfg['BLOCK_N']}/{cfg['BLOCK_K']} w{cfg['warps']}s{cfg['stages']} k{cfg['SPLIT_K']}"


def check_linear(c: Ctx, rec):
    """linear (the GEMV at M <= 4, else the skinny GEMM) vs F.linear in float32 on the
    same bf16 inputs, M = 1/4/16 (3 for the odd shape), bias at M = 4; every swept tile
    at M = 16; split-K twice the same bits; on the GPU a row's bits alone equal its bits
    in a 16-row batch of the skinny GEMM."""
    import torch.nn.functional as F

    from phalanx.kernels.gpu.linear import skinny_linear_triton
    from phalanx.kernels.linear import linear

    torch = c.torch
    for name, (N, K) in _linear_shapes(c).items():
        w, b = c.randn(N, K, scale=K**-0.5), c.randn(N)
        for M in [3] if name == "odd" else [1, 4, 16]:
            x = c.randn(M, K)
            bias = b if M in (3, 4) else None
            ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
            c.poison(); rec("linear", f"{name} {N}x{K} M={M} bias={bias is not None}", linear(x, w, bias), ref)
        x = c.randn(16, K)
        ref = F.linear(x.float(), w.float())
        for cfg in LINEAR_SWEEP.get(name, [dict(BLOCK_K=16, SPLIT_K=3)]):
            c.poison(); rec("linear", f"{name} M=16 {cfg}", skinny_linear_triton(x, w, cfg=cfg), ref)
        split = dict(SPLIT_K=4, BLOCK_K=16)
        rec("linear", f"{name} split-K deterministic",
            torch.equal(skinny_linear_triton(x, w, b, cfg=split), skinny_linear_triton(x, w, b, cfg=split)))
        if not c.small:  # under the interpreter tl.dot is numpy's BLAS: not row-invariant
            full = skinny_linear_triton(x, w)  # (linear takes the GEMV at M <= 4)
            rec("linear", f"{name} row bits M=1 == M=16",
                all(torch.equal(full[i:i + 1], skinny_linear_triton(x[i:i + 1], w)) for i in (0, 5, 15)))


def time_linear(c: Ctx, row):
    """Default tiles (and cuBLAS) at M = 1/4/16, qkv + o + router together, then the sweep."""
    import torch.nn.functional as F

    from phalanx.kernels.gpu.linear import linear_config, skinny_linear_triton
    from phalanx.kernels.linear import linear

    ws = {name: c.randn(N, K, scale=K**-0.5) for name, (N, K) in LINEAR_SHAPES.items()}
    for M in [1, 4, 16]:
        xs = {name: c.randn(M, K) for name, (_, K) in LINEAR_SHAPES.items()}
        for name, (N, K) in LINEAR_SHAPES.items():
            x, w = xs[name], ws[name]
            shape = f"{name} M={M} {_tiles(linear_config(N, K, 2))}"
            kw = dict(nbytes=N * K * 2, bw=LINEAR_BW)
            row("linear", shape, lambda: linear(x, w), lambda: F.linear(x, w), None, **kw)
            row("linear-cublas", f"{name} M={M}", lambda: F.linear(x, w), lambda: F.linear(x, w), None, **kw)
        pairs = [(xs[name], ws[name]) for name in LINEAR_SHAPES]
        kw = dict(nbytes=sum(w.numel() for w in ws.values()) * 2, bw=LINEAR_BW)
        row("linear", f"qkv+o+router M={M}", lambda: [linear(x, w) for x, w in pairs],
            lambda: [F.linear(x, w) for x, w in pairs], None, **kw)
        row("linear-cublas", f"qkv+o+router M={M}", lambda: [F.linear(x, w) for x, w in pairs],
            lambda: [F.linear(x, w) for x, w in pairs], None, **kw)
    for M in [1, 16]:
        for name, cfgs in LINEAR_SWEEP.items():
            N, K = LINEAR_SHAPES[name]
            x, w = c.randn(M, K), ws[name]
            for cfg in cfgs:
                shape = f"{name} M={M} {_tiles({**linear_config(N, K, 2), **cfg})}"
                row("linear", shape, lambda: skinny_linear_triton(x, w, cfg=cfg), lambda: F.linear(x, w), None,
                    nbytes=N * K * 2, bw=LINEAR_BW)
