"""Check and time phalanx's Triton kernels against the torch references, on one GPU.

For each kernel: correctness vs its ``_ref`` on fresh random inputs at odd sizes
(1 token, page boundaries, contexts up to 8k, batches 1..128), relative error
``||out - ref|| / ||ref||`` (bf16 must be < 1e-2; NaN fails; the allocator is poisoned
with NaN first, so an unwritten output element shows up), then timings with
``triton.testing.do_bench`` (median; L2 flushed between runs) of the Triton path
(eager, and replayed as a CUDA graph), the torch reference and an obvious torch
alternative where there is one, at the Qwen3-30B-A3B decode shapes (hidden 2048,
32/4 heads, head_dim 128, 128 experts top-8, moe_intermediate 768, context 1024),
against a floor: max(bytes / 4.0e12 B/s, FLOPs / 7.7e14 FLOP/s). The ``linear`` group
(skinny GEMM, M = 1/4/16 at the qkv, o and router shapes, default tiles then a sweep;
``linear-cublas`` rows time ``F.linear`` the same way) uses weight bytes / 4.2e12 B/s.

GPU machine (from the repository root)::

    python3 bench/kernels_gpu.py                 # all; JSON to $OUT/kernels_gpu.json
    python3 bench/kernels_gpu.py --only decode,moe --no-timing
    python3 bench/kernels_gpu.py --only linear   # skinny GEMM checks, timings, tile sweep

CPU smoke run of the script's own code (tiny float32 checks under the interpreter)::

    TRITON_INTERPRET=1 python bench/kernels_gpu.py --dry-run

Imports nothing GPU-specific at module import time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import traceback
from pathlib import Path

BW, PEAK = 4.0e12, 7.7e14  # B/s (device-to-device copy), bf16 dense FLOP/s
TOL = 1e-2
HID, NQ, NKV, HD, NE, TOPK, INTER, PAGE = 2048, 32, 4, 128, 128, 8, 768, 16
GROUPS = ["decode", "moe", "prefill", "attn", "norm", "rope", "linear"]


def _import_phalanx():
    """Import phalanx; if not installed, through a temporary link to this checkout."""
    try:
        import phalanx  # noqa: F401
    except ImportError:
        link_dir = Path(tempfile.mkdtemp(prefix="phalanx-bench-"))
        (link_dir / "phalanx").symlink_to(Path(__file__).resolve().parents[1])
        sys.path.insert(0, str(link_dir))


# ---------------------------------------------------------------- helpers


class Ctx:
    def __init__(self, device: str, dtype, small: bool, seed: int = 0):
        import torch

        self.torch, self.dev, self.dtype, self.small = torch, device, dtype, small
        self.g = torch.Generator(device=device).manual_seed(seed)

    def randn(self, *shape, scale: float = 1.0):
        t = self.torch.randn(*shape, generator=self.g, device=self.dev, dtype=self.torch.float32)
        return (t * scale).to(self.dtype)

    def poison(self):
        """Fill freed allocator blocks with NaN so unwritten outputs read as NaN."""
        if self.dev == "cuda":  # the large pool, then the small pool (blocks <= 1 MiB)
            self.torch.empty(256 << 20, dtype=self.torch.uint8, device="cuda").fill_(0xFF)
            small = [self.torch.empty(1 << 20, dtype=self.torch.uint8, device="cuda") for _ in range(32)]
            for t in small:
                t.fill_(0xFF)


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    if not bool(out.isfinite().all()):
        return float("nan")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def paged(c: Ctx, lens, ps=PAGE, kvh=NKV, hd=HD, slack=4):
    """Caches + shuffled block tables for sequences of ``lens`` tokens (extra table columns)."""
    torch = c.torch
    per = max(-(-n // ps) for n in lens) + slack
    pages = len(lens) * per + 1
    kc, vc = c.randn(pages, kvh, ps, hd), c.randn(pages, kvh, ps, hd)
    perm = torch.randperm(pages, generator=c.g, device=c.dev)[: len(lens) * per]
    return kc, vc, perm.view(len(lens), per).int()


def meta_for(c: Ctx, specs, tables):
    """AttentionMetadata for (new tokens, cached prefix) per sequence."""
    from phalanx.kernels.attention import AttentionMetadata

    torch = c.torch
    starts = [0]
    for n, _ in specs:
        starts.append(starts[-1] + n)
    lens = [n + p for n, p in specs]
    i32 = dict(dtype=torch.int32, device=c.dev)
    return AttentionMetadata(torch.tensor(starts, **i32), torch.tensor(lens, **i32), tables,
                             torch.full((starts[-1],), -1, dtype=torch.int64, device=c.dev),
                             max(n for n, _ in specs), max(lens))


def moe_inputs(c: Ctx, T, ne=NE, hid=HID, inter=INTER, topk=TOPK):
    from phalanx.kernels.moe import route

    x = c.randn(T, hid)
    w, ids = route(c.randn(T, ne).float(), topk, True, c.dtype)
    return x, w, ids, c.randn(ne, 2 * inter, hid, scale=hid**-0.5), c.randn(ne, hid, inter, scale=inter**-0.5)


# ---------------------------------------------------------------- correctness
# check_<group>(c, rec): rec(kernel, case, out, ref) records one relative error
# (rec(kernel, case, passed) an exact check).


def _dims(c: Ctx):
    """(hidden, head_dim, q heads, kv heads, token counts) of the checks."""
    return (64, 16, 8, 2, [1, 7, 33]) if c.small else (HID, HD, NQ, NKV, [1, 7, 128, 4097])


def check_norm(c: Ctx, rec):
    from phalanx.kernels import activation as act, norm

    hid, _, _, _, tokens = _dims(c)
    for T in tokens:
        x, r, w = c.randn(T, hid), c.randn(T, hid), c.randn(hid, scale=0.1) + 1
        c.poison(); rec("rms_norm", f"T={T}", norm.rms_norm(x, w, 1e-6), norm.rms_norm_ref(x, w, 1e-6))
        c.poison(); out = norm.add_rms_norm(x, r, w, 1e-6)
        rec("add_rms_norm", f"T={T}", c.torch.cat(out, 1), c.torch.cat(norm.add_rms_norm_ref(x, r, w, 1e-6), 1))
        y = c.randn(T, 3 * hid)
        c.poison(); rec("silu_and_mul", f"T={T}", act.silu_and_mul(y), act.silu_and_mul_ref(y))


def check_rope(c: Ctx, rec):
    from phalanx.kernels.rope import RotaryEmbedding, apply_rope_ref

    _, hd, nq, nkv, tokens = _dims(c)
    rope = RotaryEmbedding(hd, 40960, 1e6, device=c.dev)
    for T in tokens:
        q, k = c.randn(T, nq, hd), c.randn(T, nkv, hd)
        pos = c.torch.randint(0, 40960, (T,), generator=c.g, device=c.dev)
        c.poison(); out = rope.apply(q, k, pos)
        ref = apply_rope_ref(q, k, pos, rope.cos_cache, rope.sin_cache)
        rec("rope", f"T={T}", c.torch.cat([o.flatten() for o in out]), c.torch.cat([o.flatten() for o in ref]))


def check_attn(c: Ctx, rec):
    """write_kv: exact equality, padding slots (-1) skipped."""
    from phalanx.kernels import attention as at

    torch, (_, hd, _, nkv, _) = c.torch, _dims(c)
    for ps in [1, 16] if c.small else [1, 16, 64]:
        kc, vc, _ = paged(c, [ps * 3 + 1] * 5, ps, nkv, hd)
        k, v = c.randn(9, nkv, hd), c.randn(9, nkv, hd)
        slots = torch.randperm(kc.shape[0] * ps, generator=c.g, device=c.dev)[:9]
        slots[[0, 4]] = -1
        k2, v2 = kc.clone(), vc.clone()
        at.write_kv(k, v, kc, vc, slots)
        at.write_kv_ref(k, v, k2, v2, slots)
        rec("write_kv", f"page={ps}", torch.equal(kc, k2) and torch.equal(vc, v2))


def check_decode(c: Ctx, rec):
    from phalanx.kernels import attention as at
    from phalanx.kernels.gpu.attention import decode_attention_triton

    torch, (_, hd, nq, nkv, _) = c.torch, _dims(c)
    long = 1000 if c.small else 8192
    for B in [1, 5, 16] if c.small else [1, 5, 16, 64, 128]:
        for ps in [1, 16] if c.small else [16, 1, 64]:
            # 1 token, page boundaries, a long context, then random lengths up to `long`.
            base = [1, max(2, ps - 1), ps, ps + 1, long]
            rand = torch.randint(1, long + 1, (max(0, B - 5),), generator=c.g, device=c.dev).tolist()
            lens = [long] if B == 1 else base + rand
            kc, vc, tables = paged(c, lens, ps, nkv, hd, slack=64)
            q, sl = c.randn(B, nq, hd), torch.tensor(lens, dtype=torch.int32, device=c.dev)
            ref = at.decode_attention_ref(q, kc, vc, sl, tables, hd**-0.5)
            case = f"B={B} page={ps} max={max(lens)}"
            c.poison(); rec("decode", case, at.decode_attention(q, kc, vc, sl, tables, hd**-0.5), ref)
            c.poison(); rec("decode", case + " part=64",
                            decode_attention_triton(q, kc, vc, sl, tables, hd**-0.5, partition=64), ref)


def check_prefill(c: Ctx, rec):
    from phalanx.kernels import attention as at

    _, hd, nq, nkv, _ = _dims(c)
    big = [(300, 0), (64, 40), (70, 90)] if c.small else [(300, 0), (64, 4000), (1000, 7000)]
    for specs in [[(1, 0)], [(17, 0), (15, 16), (1, 33), (0, 5)], big]:  # (new tokens, prefix)
        for ps in [16] if c.small else [16, 1]:
            kc, vc, tables = paged(c, [n + p for n, p in specs], ps, nkv, hd)
            meta = meta_for(c, specs, tables)
            q = c.randn(int(meta.query_start_loc[-1]), nq, hd)
            ref = at.prefill_attention_ref(q, kc, vc, meta, hd**-0.5)
            c.poison(); rec("prefill", f"{specs} page={ps}", at.prefill_attention(q, kc, vc, meta, hd**-0.5), ref)


def check_moe(c: Ctx, rec):
    """fused_experts, all experts local and half of them (expert_map), T = 0 included."""
    from phalanx.kernels import moe

    for T in [0, 1, 5, 40] if c.small else [0, 1, 3, 16, 64, 128, 1000]:
        x, w, ids, w13, w2 = moe_inputs(c, T, **(dict(ne=8, hid=64, inter=32, topk=2) if c.small else {}))
        ne = w13.shape[0]
        for emap in (None, moe.make_expert_map(ne, list(range(0, ne, 2)), device=c.dev)):
            w13l, w2l = (w13, w2) if emap is None else (w13[::2].contiguous(), w2[::2].contiguous())
            c.poison(); out = moe.fused_experts(x, w, ids, w13l, w2l, emap)
            ref = moe.fused_experts_ref(x, w, ids, w13l, w2l, emap)
            case = f"T={T} map={emap is not None}"
            rec("moe", case, out.shape == ref.shape) if T == 0 else rec("moe", case, out, ref)
    check_moe_paths(c, rec)


def check_moe_paths(c: Ctx, rec):
    """Both fused_experts paths forced at decode sizes (general; small in each mode), and
    the small "dot" mode bit-identical to the general path (batch invariance across the
    dispatch threshold). Under the interpreter (dry run) that holds only with the general
    path's tiles (numpy's per-element order depends on the tile), so it uses them there."""
    from phalanx.kernels import moe
    from phalanx.kernels.gpu.moe import fused_experts_triton
    from phalanx.kernels.gpu.moe_decode import SMALL_MODES, fused_experts_small_triton

    same_tiles = dict(N1=64, K1=128, N2=64, K2=128) if c.small else None
    for T in [1, 2, 3] if c.small else [1, 2, 4, 8, 16]:
        x, w, ids, w13, w2 = moe_inputs(c, T, **(dict(ne=8, hid=64, inter=32, topk=4) if c.small else {}))
        ne = w13.shape[0]
        for emap in (None, moe.make_expert_map(ne, list(range(1, ne, 2)), device=c.dev)):
            w13l, w2l = (w13, w2) if emap is None else (w13[1::2].contiguous(), w2[1::2].contiguous())
            ref = moe.fused_experts_ref(x, w, ids, w13l, w2l, emap)
            case = f"T={T} map={emap is not None}"
            c.poison(); gen = fused_experts_triton(x, w, ids, w13l, w2l, emap, path="general")
            rec("moe", case + " general", gen, ref)
            for mode in SMALL_MODES:
                c.poison(); out = fused_experts_small_triton(x, w, ids, w13l, w2l, emap, mode=mode)
                rec("moe", case + f" small-{mode}", out, ref)
            c.poison(); out = fused_experts_small_triton(x, w, ids, w13l, w2l, emap, mode="dot",
                                                         cfg={"split": False})
            rec("moe", case + " small-dot-loop", out, ref)
            for split in (True, False):
                c.poison(); out = fused_experts_small_triton(x, w, ids, w13l, w2l, emap, mode="dot",
                                                             cfg={**(same_tiles or {}), "split": split})
                rec("moe", case + f" small-dot split={split} bits == general", c.torch.equal(out, gen))


# ---------------------------------------------------------------- timing
# time_<group>(c, row): row(kernel, shape, triton_fn, ref_fn, alt_fn, nbytes=, flops=).


def _bench(fn, graph: bool):
    import torch
    import triton.testing as tt

    fn()
    torch.cuda.synchronize()  # do_bench_cudagraph runs fn on a side stream: inputs must be ready
    if graph:
        try:
            return tt.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
        except Exception as exc:  # e.g. a host sync inside fn
            print(f"  cuda graph failed: {type(exc).__name__}: {str(exc)[:120]}")
            return None
    return tt.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def time_decode(c: Ctx, row, L=1024):
    import torch.nn.functional as F

    from phalanx.kernels import attention as at

    # Last case: block tables as wide as a 32k max_model_len (the CUDA-graph buffers).
    for B, slack in [(1, 0), (16, 0), (64, 0), (128, 0), (64, 32768 // PAGE - L // PAGE)]:
        kc, vc, tables = paged(c, [L] * B, slack=slack)
        q, sl = c.randn(B, NQ, HD), c.torch.full((B,), L, dtype=c.torch.int32, device=c.dev)
        kd, vd = c.randn(B, NKV, L, HD), c.randn(B, NKV, L, HD)
        qd = q.view(B, NQ, 1, HD)
        row("decode", f"B={B} ctx={L}" + (" tbl=32k" if slack else ""),
            lambda: at.decode_attention(q, kc, vc, sl, tables, HD**-0.5),
            lambda: at.decode_attention_ref(q, kc, vc, sl, tables, HD**-0.5),
            lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True),
            nbytes=(B * L * NKV * HD * 2 + 2 * q.numel()) * 2)


def time_prefill(c: Ctx, row, n=2048):
    import torch.nn.functional as F

    from phalanx.kernels import attention as at

    kc, vc, tables = paged(c, [n], slack=0)
    meta = meta_for(c, [(n, 0)], tables)
    q = c.randn(n, NQ, HD)
    qd, kd, vd = q.transpose(0, 1)[None], c.randn(1, NKV, n, HD), c.randn(1, NKV, n, HD)
    row("prefill", f"1x{n} causal", lambda: at.prefill_attention(q, kc, vc, meta, HD**-0.5),
        lambda: at.prefill_attention_ref(q, kc, vc, meta, HD**-0.5),
        lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True),
        flops=4 * NQ * HD * n * (n + 1) / 2)


def time_attn(c: Ctx, row):
    from phalanx.kernels import attention as at

    for T in [1, 16, 64, 128]:
        kc, vc, _ = paged(c, [T * 8], slack=0)
        kn, vn = c.randn(T, NKV, HD), c.randn(T, NKV, HD)
        slots = c.torch.randperm(kc.shape[0] * PAGE, device=c.dev)[:T]
        row("write_kv", f"T={T}", lambda: at.write_kv(kn, vn, kc, vc, slots),
            lambda: at.write_kv_ref(kn, vn, kc, vc, slots), None, nbytes=4 * kn.numel() * 2)


def time_moe(c: Ctx, row):
    from phalanx.kernels import moe

    for T in [1, 16, 64, 128]:
        x, w, ids, w13, w2 = moe_inputs(c, T)
        touched = int(ids.unique().numel())
        row("moe", f"T={T} experts={touched}", lambda: moe.fused_experts(x, w, ids, w13, w2),
            lambda: moe.fused_experts_ref(x, w, ids, w13, w2), None,
            nbytes=(touched * 3 * INTER * HID + 2 * x.numel()) * 2, flops=T * TOPK * 6 * INTER * HID)
    time_moe_paths(c, row)


# Extra small-path tiles timed at T=1 (defaults: moe_decode.small_config).
MOE_SMALL_SWEEP = {
    "dot": [dict(N1=16, K1=128, N2=16, K2=128), dict(N1=64, K1=128, N2=64, K2=128),
            dict(N1=32, K1=256, N2=32, K2=256, warps=8)],
    "gemv": [dict(N1=8, K1=256, N2=8, K2=256), dict(N1=32, K1=128, N2=16, K2=128),
             dict(N1=16, K1=512, N2=16, K2=512, warps=8)],
}


def time_moe_paths(c: Ctx, row):
    """Both fused_experts paths forced at T = 1, 2, 4, 8 (the dispatch threshold is
    kernels.gpu.moe.SMALL_MAX_PAIRS pairs, T = 4 at top-8), then small-path tiles at T=1."""
    from phalanx.kernels import moe
    from phalanx.kernels.gpu.moe import fused_experts_triton
    from phalanx.kernels.gpu.moe_decode import SMALL_MODES, fused_experts_small_triton, small_config

    for T in [1, 2, 4, 8]:
        x, w, ids, w13, w2 = moe_inputs(c, T)
        touched = int(ids.unique().numel())
        kw = dict(nbytes=(touched * 3 * INTER * HID + 2 * x.numel()) * 2, flops=T * TOPK * 6 * INTER * HID)
        ref = lambda: moe.fused_experts_ref(x, w, ids, w13, w2)  # noqa: E731
        row("moe", f"T={T} e={touched} general",
            lambda: fused_experts_triton(x, w, ids, w13, w2, path="general"), ref, None, **kw)
        for mode in SMALL_MODES:
            row("moe", f"T={T} e={touched} small-{mode}",
                lambda: fused_experts_small_triton(x, w, ids, w13, w2, mode=mode), ref, None, **kw)
        row("moe", f"T={T} e={touched} small-dot-loop",
            lambda: fused_experts_small_triton(x, w, ids, w13, w2, mode="dot", cfg={"split": False}),
            ref, None, **kw)
        if T == 1:
            for mode, cfgs in MOE_SMALL_SWEEP.items():
                for cfg in cfgs:
                    f = {**small_config(mode), **cfg}
                    tiles = f"{f['N1']}/{f['K1']},{f['N2']}/{f['K2']}w{f['warps']}"
                    row("moe", f"T=1 {mode} {tiles}",
                        lambda: fused_experts_small_triton(x, w, ids, w13, w2, mode=mode, cfg=cfg), ref, None, **kw)


# ---------------------------------------------------------------- linear (skinny GEMM)

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
    """linear (skinny path) vs F.linear in float32 on the same bf16 inputs, M = 1/4/16
    (3 for the odd shape), bias at M = 4; every swept tile at M = 16; split-K twice the
    same bits; on the GPU a row's bits alone equal its bits in a 16-row batch."""
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
            full = linear(x, w)
            rec("linear", f"{name} row bits M=1 == M=16",
                all(torch.equal(full[i:i + 1], linear(x[i:i + 1], w)) for i in (0, 5, 15)))


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


def time_norm(c: Ctx, row):
    import torch.nn.functional as F

    from phalanx.kernels import activation as act, norm

    for T in [1, 16, 64, 128]:
        x, r, wn = c.randn(T, HID), c.randn(T, HID), c.randn(HID, scale=0.1) + 1
        row("rms_norm", f"T={T} H={HID}", lambda: norm.rms_norm(x, wn, 1e-6),
            lambda: norm.rms_norm_ref(x, wn, 1e-6), lambda: F.rms_norm(x, (HID,), wn, 1e-6),
            nbytes=2 * x.numel() * 2)
        row("add_rms_norm", f"T={T} H={HID}", lambda: norm.add_rms_norm(x, r, wn, 1e-6),
            lambda: norm.add_rms_norm_ref(x, r, wn, 1e-6), None, nbytes=4 * x.numel() * 2)
        y = c.randn(T, 2 * INTER * 8)
        row("silu_and_mul", f"T={T} I={INTER * 8}", lambda: act.silu_and_mul(y),
            lambda: act.silu_and_mul_ref(y), None, nbytes=1.5 * y.numel() * 2)


def time_rope(c: Ctx, row):
    from phalanx.kernels.rope import RotaryEmbedding, apply_rope_ref

    rope = RotaryEmbedding(HD, 40960, 1e6, device=c.dev)
    for T in [1, 16, 64, 128]:
        q, k = c.randn(T, NQ, HD), c.randn(T, NKV, HD)
        pos = c.torch.randint(0, 4096, (T,), device=c.dev)
        # Eager rope.apply includes its range check (two host syncs); the graph skips it.
        row("rope", f"T={T}", lambda: rope.apply(q, k, pos),
            lambda: apply_rope_ref(q, k, pos, rope.cos_cache, rope.sin_cache), None,
            nbytes=2 * (q.numel() + k.numel()) * 2 + T * HD * 4)


def run_group(c: Ctx, group: str, timing: bool) -> tuple[list, list]:
    """Correctness rows (kernel, case, err) and, if timing, timing rows of one group."""
    checks, times = [], []

    def rec(kernel, case, out, ref=None):
        """ref None: out is a bool, exact check passed (err 0) or not (NaN)."""
        err = rel_err(out, ref) if ref is not None else (0.0 if out else float("nan"))
        checks.append(dict(kernel=kernel, case=case, err=err))

    def row(kernel, shape, fast, ref, alt=None, nbytes=0, flops=0, bw=BW):
        r = dict(kernel=kernel, shape=shape, triton_us=_bench(fast, False), graph_us=_bench(fast, True),
                 ref_us=_bench(ref, False), alt_us=_bench(alt, False) if alt else None,
                 floor_us=max(nbytes / bw, flops / PEAK) * 1e6)
        r["pct_floor"] = 100 * r["floor_us"] / min(t for t in (r["triton_us"], r["graph_us"]) if t)
        times.append(r)
        print(f"  {kernel:13s} {shape:22s} triton {r['triton_us']:8.1f}  graph {r['graph_us'] or 0:8.1f}"
              f"  ref {r['ref_us']:9.1f}  floor {r['floor_us']:7.1f}  {r['pct_floor']:5.1f}%", flush=True)

    try:  # one group's failure (e.g. a compile error) spares the others
        globals()[f"check_{group}"](c, rec)
    except Exception as exc:
        traceback.print_exc()
        checks.append(dict(kernel=group, case=f"raised {type(exc).__name__}", err=float("nan")))
    if timing:
        try:
            globals()[f"time_{group}"](c, row)
        except Exception:
            traceback.print_exc()
    return checks, times


# ---------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="all",
                    help="comma list of: " + ", ".join(GROUPS) + " (attn = write_kv; norm includes silu_and_mul;"
                         " linear = skinny GEMM vs cuBLAS)")
    ap.add_argument("--no-timing", action="store_true", help="correctness checks only")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU smoke run: tiny float32 checks through the Triton interpreter, no timing")
    args = ap.parse_args()
    _import_phalanx()
    import torch

    from phalanx.kernels.backend import force_triton

    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--dry-run needs TRITON_INTERPRET=1 in the environment")
            return 2
        force_triton(True)
        c = Ctx("cpu", torch.float32, small=True)
    else:
        if not torch.cuda.is_available():
            print("no CUDA device (use --dry-run on CPU)")
            return 2
        c = Ctx("cuda", torch.bfloat16, small=False)
    import triton

    info = dict(device=torch.cuda.get_device_name() if c.dev == "cuda" else "cpu",
                torch=torch.__version__, triton=triton.__version__)
    print(info, flush=True)
    checks, timing = [], []
    for group in GROUPS if args.only == "all" else args.only.split(","):
        ch, ti = run_group(c, group, timing=not (args.dry_run or args.no_timing))
        checks += ch
        timing += ti
    bad = [r for r in checks if not r["err"] < TOL]
    print("\ncorrectness (rel err, bf16 tol 1e-2):")
    for r in checks:
        print(f"  {'FAIL' if r in bad else 'ok  '} {r['kernel']:13s} {r['case']:48s} {r['err']:.2e}")
    if timing:
        print(f"\n{'kernel':13s} {'shape':22s} {'triton':>8s} {'graph':>8s} {'ref':>9s} {'alt':>8s} {'floor':>7s} {'%floor':>6s}  (µs)")
        for r in timing:
            alt = f"{r['alt_us']:8.1f}" if r["alt_us"] else "       -"
            print(f"{r['kernel']:13s} {r['shape']:22s} {r['triton_us']:8.1f} {r['graph_us'] or float('nan'):8.1f} "
                  f"{r['ref_us']:9.1f} {alt} {r['floor_us']:7.1f} {r['pct_floor']:6.1f}")
    print(f"\n{len(checks) - len(bad)}/{len(checks)} correctness cases pass" + (f"; FAILED: {len(bad)}" if bad else ""))
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "kernels_gpu.json"
        path.write_text(json.dumps(dict(info=info, correctness=checks, timing=timing), indent=1, default=str))
        print(f"wrote {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
