"""Correctness checks of `bench/kernels_gpu.py`, one per group (linear: in
kernels_gpu_linear.py): each kernel against its torch reference on fresh random inputs
at odd sizes (tiny ones under the interpreter, `c.small`).

Imports nothing GPU-specific (nor phalanx) at module import time.
"""

from __future__ import annotations

from kernels_gpu_inputs import HD, HID, NKV, NQ, Ctx, meta_for, moe_inputs, paged

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
        # + KV write in the same launch: the pages end as write_kv_ref of its k leaves them
        from phalanx.kernels.attention import write_kv_ref
        v, page = c.randn(T, nkv, hd), 16
        slots = c.torch.randperm(2 * T * page, generator=c.g, device=c.dev)[:T]
        slots[0] = -1
        caches = [c.randn(2 * T, nkv, page, hd) for _ in range(2)]
        want = [x.clone() for x in caches]
        q1, kr = rope.apply_and_cache(q, k, pos, kv_write=(v, *caches, slots))
        write_kv_ref(kr, v, *want, slots)
        rec("rope", f"T={T} + kv write == write_kv_ref", all(c.torch.equal(a, b) for a, b in zip(caches, want)))
        # keep_k=False (the model's call): no k comes back, q and the pages are the same
        again = [x.clone() for x in caches]
        q2, none = rope.apply_and_cache(q, k, pos, kv_write=(v, *again, slots), keep_k=False)
        rec("rope", f"T={T} keep_k=False: k None, q and pages equal", none is None
            and c.torch.equal(q2, q1) and all(c.torch.equal(a, b) for a, b in zip(again, want)))


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


def check_split(c: Ctx, rec):
    """Every partition of the `split` timing group against the reference (B=1 and 16)."""
    from phalanx.kernels import attention as at
    from phalanx.kernels.gpu.attention import decode_attention_triton
    from kernels_gpu_timing import SPLIT_PARTITIONS

    torch, (_, hd, nq, nkv, _) = c.torch, _dims(c)
    L = 100 if c.small else 1024
    for B in (1, 16):
        kc, vc, tables = paged(c, [L] * B, 16, nkv, hd, slack=8)
        q, sl = c.randn(B, nq, hd), torch.full((B,), L, dtype=torch.int32, device=c.dev)
        ref = at.decode_attention_ref(q, kc, vc, sl, tables, hd**-0.5)
        for part in SPLIT_PARTITIONS:
            c.poison(); rec("decode-split", f"B={B} ctx={L} part={part}",
                            decode_attention_triton(q, kc, vc, sl, tables, hd**-0.5,
                                                    partition=part), ref)


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
    check_moe_fp8_paths(c, rec)


def check_moe_paths(c: Ctx, rec):
    """Both fused_experts paths forced at decode sizes (general; small, its down projection
    merged in the launch, by a combine launch or per token), and the small path
    bit-identical to the general path (batch invariance across the
    dispatch threshold). Under the interpreter (dry run) that holds only with the general
    path's tiles (numpy's per-element order depends on the tile), so it uses them there."""
    from phalanx.kernels import moe
    from phalanx.kernels.gpu.moe import fused_experts_triton
    from phalanx.kernels.gpu.moe_decode import fused_experts_small_triton

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
            c.poison(); out = fused_experts_small_triton(x, w, ids, w13l, w2l, emap)
            rec("moe", case + " small-dot", out, ref)
            c.poison(); out = fused_experts_small_triton(x, w, ids, w13l, w2l, emap, cfg={"split": False})
            rec("moe", case + " small-dot-loop", out, ref)
            for split, merge in ((True, True), (True, False), (False, False)):
                c.poison(); out = fused_experts_small_triton(
                    x, w, ids, w13l, w2l, emap,
                    cfg={**(same_tiles or {}), "split": split, "merge": merge})
                rec("moe", case + f" small-dot split={split} merge={merge} bits == general",
                    c.torch.equal(out, gen))


def check_moe_fp8_paths(c: Ctx, rec):
    """FP8 stacks (128x128 block scales) at decode sizes: the small path and the general
    path's decode tile against the reference over the dequantized stacks, and the small
    path's bits equal to the general path's (each side of the dispatch threshold in the
    same mode, `moe_fp8.DECODE_F16`). Under the interpreter with the general tiles."""
    from phalanx.kernels.fp8 import dequantize, expand_block_scales, quantize_blocks
    from phalanx.kernels.gpu.moe_fp8 import fused_experts_fp8_triton
    from phalanx.kernels.moe import fused_experts_ref

    def fp8(w):
        q, blocks = quantize_blocks(w.float())
        return q, expand_block_scales(blocks, w.shape[-2])

    tiles = dict(N1=64, N2=64) if c.small else {}  # {} forces the general path, its own tiles
    for T in [1, 3] if c.small else [1, 2, 4]:
        x, w, ids, w13, w2 = moe_inputs(c, T, **(dict(ne=8, hid=256, inter=128, topk=4) if c.small else {}))
        (q13, s13), (q2, s2) = fp8(w13), fp8(w2)
        ref = fused_experts_ref(x, w, ids, dequantize(q13, s13, c.dtype), dequantize(q2, s2, c.dtype))
        c.poison(); small = fused_experts_fp8_triton(x, w, ids, q13, s13, q2, s2)
        c.poison(); general = fused_experts_fp8_triton(x, w, ids, q13, s13, q2, s2, config=tiles)
        rec("moe-fp8", f"T={T} small", small, ref)
        rec("moe-fp8", f"T={T} general", general, ref)
        rec("moe-fp8", f"T={T} small bits == general", c.torch.equal(small, general))
