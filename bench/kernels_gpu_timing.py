"""Timings of `bench/kernels_gpu.py`, one per group (linear: in kernels_gpu_linear.py):
the Triton path, the torch reference and an obvious alternative at the Qwen3-30B-A3B
decode shapes, each handed to `row` (which times them) with its bytes / FLOPs floor.

Imports nothing GPU-specific (nor phalanx) at module import time.
"""

from __future__ import annotations

from kernels_gpu_inputs import HD, HID, INTER, NKV, NQ, PAGE, TOPK, Ctx, meta_for, moe_inputs, paged

# ---------------------------------------------------------------- timing
# time_<group>(c, row): row(kernel, shape, triton_fn, ref_fn, alt_fn, nbytes=, flops=).


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


SPLIT_PARTITIONS = (32, 64, 128, 256)


def time_split(c: Ctx, row, L=1024):
    """Decode attention per split size (positions per program), block tables as wide as
    the decode bench's CUDA graphs (max_model_len 4096): which partition the heuristic
    should pick at small batches."""
    from phalanx.kernels import attention as at
    from phalanx.kernels.gpu.attention import decode_attention_triton

    for B in (1, 4, 16, 64):
        kc, vc, tables = paged(c, [L] * B, slack=4096 // PAGE - L // PAGE)
        q, sl = c.randn(B, NQ, HD), c.torch.full((B,), L, dtype=c.torch.int32, device=c.dev)
        for part in SPLIT_PARTITIONS + (None,):
            row("decode-split", f"B={B} part={part or 'auto'}",
                lambda part=part: decode_attention_triton(q, kc, vc, sl, tables, HD**-0.5,
                                                          partition=part),
                lambda: at.decode_attention_ref(q, kc, vc, sl, tables, HD**-0.5),
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
MOE_SMALL_SWEEP = [dict(N1=16, K1=128, N2=16, K2=128), dict(N1=64, K1=128, N2=64, K2=128),
                   dict(N1=32, K1=256, N2=32, K2=256, warps=8)]


def time_moe_paths(c: Ctx, row):
    """Both fused_experts paths forced at T = 1, 2, 4, 8 (the dispatch threshold is
    kernels.gpu.moe.SMALL_MAX_PAIRS pairs, T = 4 at top-8), then small-path tiles at T=1."""
    from phalanx.kernels import moe
    from phalanx.kernels.gpu.moe import fused_experts_triton
    from phalanx.kernels.gpu.moe_decode import fused_experts_small_triton, small_config

    for T in [1, 2, 4, 8]:
        x, w, ids, w13, w2 = moe_inputs(c, T)
        touched = int(ids.unique().numel())
        kw = dict(nbytes=(touched * 3 * INTER * HID + 2 * x.numel()) * 2, flops=T * TOPK * 6 * INTER * HID)
        ref = lambda: moe.fused_experts_ref(x, w, ids, w13, w2)  # noqa: E731
        row("moe", f"T={T} e={touched} general",
            lambda: fused_experts_triton(x, w, ids, w13, w2, path="general"), ref, None, **kw)
        row("moe", f"T={T} e={touched} small-dot",
            lambda: fused_experts_small_triton(x, w, ids, w13, w2), ref, None, **kw)
        row("moe", f"T={T} e={touched} small-dot-loop",
            lambda: fused_experts_small_triton(x, w, ids, w13, w2, cfg={"split": False}), ref, None, **kw)
        if T == 1:
            for cfg in MOE_SMALL_SWEEP:
                f = {**small_config(), **cfg}
                tiles = (f"{f['N1']}/{f['K1']},{f['N2']}/{f['K2']}w{f['warps']}"
                         f"{'' if f.get('split') else ' loop'}")
                row("moe", f"T=1 dot {tiles}",
                    lambda cfg=cfg: fused_experts_small_triton(x, w, ids, w13, w2, cfg=cfg), ref, None, **kw)


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
