"""The `gemv` group of `bench/kernels_gpu.py`: the few-row GEMV and the norm folded into
a projection (kernels/gpu/gemv.py, kernels/norm_linear.py), and the routing folded into
the router's (kernels/gpu/norm_route.py), checked against the torch references and timed
against cuBLAS + the norm kernel, alone and as a chain of layers in one CUDA graph with
programmatic dependent launch on and off.

Imports nothing GPU-specific (nor phalanx) at module import time.
"""

from __future__ import annotations

from kernels_gpu_inputs import HD, HID, NE, NKV, NQ, TOPK, Ctx

GEMV_BW = 4.2e12  # B/s: the floor of a row is its weight bytes / GEMV_BW
QKV, O, ROUTER = (NQ * HD + 2 * NKV * HD, HID), (HID, NQ * HD), (NE, HID)  # (N, K)
CHAIN_LAYERS = 48
# Tiles tried on the M = 1 chain (defaults: qkv 16 rows, o 8, router 1; 4 warps).
# The first runs (bench/NOTES.md) chose 4 warps; these try the router's tile and 2 warps.
CHAIN_SWEEP = {
    "router2": {"router": dict(BLOCK_N=2)},
    "router4": {"router": dict(BLOCK_N=4)},
    "router8": {"router": dict(BLOCK_N=8)},
    "router1w2": {"router": dict(BLOCK_N=1, warps=2)},
    "qkv16w2 o8w2": {"qkv": dict(BLOCK_N=16, warps=2), "o": dict(BLOCK_N=8, warps=2)},
    "qkv8w2 o4w2": {"qkv": dict(BLOCK_N=8, warps=2), "o": dict(BLOCK_N=4, warps=2)},
}
# Tiles tried on the FP8 chain (defaults, `FP8_HALF_ROWS`: qkv 8 rows, o 4; the 64 KiB
# tile's rows, qkv 16 / o 16, ran one 4-warp program an SM at 255 registers).
CHAIN_SWEEP_FP8 = {
    "qkv16 o16": {"qkv": dict(BLOCK_N=16), "o": dict(BLOCK_N=16)},
    "qkv16 o8": {"qkv": dict(BLOCK_N=16), "o": dict(BLOCK_N=8)},
    "qkv8w8 o8w8": {"qkv": dict(BLOCK_N=8, warps=8), "o": dict(BLOCK_N=8, warps=8)},
    "qkv16w8 o16w8": {"qkv": dict(BLOCK_N=16, warps=8), "o": dict(BLOCK_N=16, warps=8)},
    "qkv4 o4": {"qkv": dict(BLOCK_N=4), "o": dict(BLOCK_N=4)},
}


def _shapes(c: Ctx) -> dict:
    if c.small:
        return {"qkv": (96, 64), "o": (64, 128), "router": (16, 64), "odd": (100, 72)}
    return {"qkv": QKV, "o": O, "router": ROUTER, "odd": (100, 72)}


def check_gemv(c: Ctx, rec):
    """The GEMV and its folded norm (`gemv_triton`, M = 1..4; the model dispatches M = 1)
    vs float32 references on the same inputs, residual or none, bias on the odd shape; on
    the GPU a row's bits alone equal its bits among 4 rows, and PDL on and off give the
    same bits."""
    import torch.nn.functional as F

    from phalanx.kernels.gpu.gemv import gemv_triton
    from phalanx.kernels.gpu.pdl import set_pdl
    from phalanx.kernels.norm_linear import norm_linear_ref

    def linear(x, w, b=None):
        return gemv_triton(x, w, b)[0]

    def norm_linear(x, res, nw, eps, w, b=None, want_normed=False):
        return gemv_triton(x, w, b, norm=(res, nw, eps), want_normed=want_normed)

    torch = c.torch
    for name, (N, K) in _shapes(c).items():
        w, b = c.randn(N, K, scale=K**-0.5), c.randn(N) if name == "odd" else None
        nw = 1 + 0.1 * c.randn(K)
        for M in (1, 2, 3, 4):
            x, r = c.randn(M, K), c.randn(M, K)
            ref = F.linear(x.float(), w.float(), None if b is None else b.float())
            c.poison(); rec("gemv", f"{name} {N}x{K} M={M}", linear(x, w, b), ref)
            for res in (None, r):
                ry, rn, rr = norm_linear_ref(x.float(), None if res is None else res.float(), nw.float(),
                                             1e-6, w.float(), None if b is None else b.float())
                c.poison()
                y, n, nr = norm_linear(x, res, nw, 1e-6, w, b, want_normed=True)
                case = f"{name} M={M} {'add+' if res is not None else ''}norm"
                rec("norm_linear", case + " y", y, ry)
                rec("norm_linear", case + " normed", n, rn)
                rec("norm_linear", case + " residual", nr, rr)
        if not c.small:
            x = c.randn(4, K)
            full = linear(x, w, b)
            rec("gemv", f"{name} row bits M=1 == M=4",
                all(torch.equal(full[i:i + 1], linear(x[i:i + 1], w, b)) for i in range(4)))
            old = set_pdl(False)
            try:
                rec("gemv", f"{name} PDL off == on", torch.equal(full, linear(x, w, b)))
            finally:
                set_pdl(old)
    _check_norm_route(c, rec)
    _check_fp8_forms(c, rec)


def _check_fp8_forms(c: Ctx, rec):
    """FP8 codes (qkv and o, M = 1 and 4) in both forms of `gemv_rows`: dequantized in
    registers (1) and block sums scaled once (2, `FP8_SUM_AFTER`), against float32 over
    the exact products ``x * q * s``."""
    from phalanx.kernels.fp8 import dequantize
    from phalanx.kernels.gpu import gemv

    for name in ("qkv", "o"):
        N, K = _shapes(c)[name]
        q, s = _fp8(c.randn(N, K, scale=K**-0.5))
        wf = dequantize(q, s, c.torch.float32)
        for M in (1, 4):
            x = c.randn(M, K)
            ref = x.float() @ wf.T
            for form in (1, 2):
                c.poison()
                y = _fp8_form(lambda: gemv.gemv_triton(x, q, scales=s)[0], form)()
                rec("gemv", f"{name} fp8 form {form} M={M}", y, ref)


def _fp8_form(fn, form: int):
    """``fn`` with the FP8 GEMVs in ``form`` (1 dequantize, 2 block sums scaled once:
    `FP8_SUM_AFTER`) while it runs (and is captured)."""
    from phalanx.kernels.gpu import gemv

    def run():
        default = gemv.FP8_SUM_AFTER
        gemv.FP8_SUM_AFTER = form == 2
        try:
            return fn()
        finally:
            gemv.FP8_SUM_AFTER = default
    return run


def _check_norm_route(c: Ctx, rec):
    """The folded routing (M = 1) vs the unfolded kernels (the norm folded into the router
    GEMV, then the route kernel): ids equal, weights within float32 rounding, the normed
    rows and the residual bit-equal; with and without a residual; ties to the lower id."""
    from phalanx.kernels.gpu.gemv import gemv_triton
    from phalanx.kernels.gpu.norm_route import norm_route_triton
    from phalanx.kernels.gpu.route import route_triton

    torch = c.torch
    E, K = _shapes(c)["router"]
    k = min(TOPK, E)
    for res, ties in ((True, False), (False, False), (True, True)):
        w, nw = c.randn(E, K, scale=K**-0.5), 1 + 0.1 * c.randn(K)
        x, r = c.randn(1, K), (c.randn(1, K) if res else None)
        if ties:  # three experts share the largest logit
            w[3] = w[E - 1] = w[E // 2] = 4 * w[3]
            w[:3] = w[4:E // 2] = w[E // 2 + 1:E - 1] = -0.01 * w[3]
            if float(gemv_triton(x, w, norm=(r, nw, 1e-6))[0][0, 3]) < 0:
                w = -w
        logits, rn, rr = gemv_triton(x, w, norm=(r, nw, 1e-6), want_normed=True)
        rw, rid = route_triton(logits, k, True, x.dtype)
        c.poison()
        (fw, fid), n, nr = norm_route_triton(x, r, nw, 1e-6, w, k, True)
        case = f"router {E}x{K} k={k} {'add+' if res else ''}norm{' ties' if ties else ''}"
        rec("norm_route", case + " ids", torch.equal(fid, rid))
        rec("norm_route", case + " weights", fw, rw)
        rec("norm_route", case + " normed, residual", torch.equal(n, rn) and torch.equal(nr, rr))


def _fp8(w):
    """FP8 codes and per-row scales of ``w`` (128x128 blocks, kernels/fp8.py)."""
    from phalanx.kernels.fp8 import expand_block_scales, quantize_blocks

    q, blocks = quantize_blocks(w.float())
    return q, expand_block_scales(blocks, w.shape[0])


def _chain(c: Ctx, M: int, cfg: dict | None = None, route: str | None = None, fp8: bool = False):
    """Per layer: (x, residual) -> norm_linear(qkv) -> o on the q columns -> norm_linear
    (router, normed rows kept), as the decode step chains them; distinct weights per layer
    (nothing stays in L2). Returns (fused, unfused) callables over the same buffers.
    ``cfg``: {"qkv": tiles, "o": tiles} for the GEMVs (`gemv_triton`'s cfg). ``route``:
    the fused chain also routes, by the route kernel after the router GEMV ("kernel") or
    folded into it ("fold"). ``fp8``: qkv and o as FP8 codes (the router stays bf16, as in
    the FP8 checkpoints); the unfused chain then runs their dequantized twins."""
    import torch.nn.functional as F

    from phalanx.kernels.gpu.gemv import gemv_triton
    from phalanx.kernels.gpu.norm_route import norm_route_triton
    from phalanx.kernels.gpu.route import route_triton
    from phalanx.kernels.norm import add_rms_norm

    layers = [dict(qkv=c.randn(*QKV, scale=QKV[1] ** -0.5), o=c.randn(*O, scale=O[1] ** -0.5),
                   router=c.randn(*ROUTER, scale=HID ** -0.5), n1=1 + 0.1 * c.randn(HID),
                   n2=1 + 0.1 * c.randn(HID)) for _ in range(CHAIN_LAYERS)]
    scales = {}
    if fp8:
        from phalanx.kernels.fp8 import dequantize

        for i, w in enumerate(layers):
            for name in ("qkv", "o"):
                w[name], scales[i, name] = _fp8(w[name])
                w[name + "_deq"] = dequantize(w[name], scales[i, name], c.dtype)
    x0, r0 = c.randn(M, HID), c.randn(M, HID)

    def fused():
        x, r = x0, r0
        for i, w in enumerate(layers):
            qkv, _, r = gemv_triton(x, w["qkv"], norm=(r, w["n1"], 1e-6), cfg=(cfg or {}).get("qkv"),
                                    scales=scales.get((i, "qkv")))
            x = gemv_triton(qkv[:, : NQ * HD], w["o"], cfg=(cfg or {}).get("o"), scales=scales.get((i, "o")))[0]
            if route == "fold":
                _, x, r = norm_route_triton(x, r, w["n2"], 1e-6, w["router"], TOPK, True)
                continue
            logits, x, r = gemv_triton(x, w["router"], norm=(r, w["n2"], 1e-6), want_normed=True,
                                       cfg=(cfg or {}).get("router"))
            if route == "kernel":
                route_triton(logits, TOPK, True, x.dtype)
        return x

    def unfused():
        x, r = x0, r0
        for w in layers:
            h, r = add_rms_norm(x, r, w["n1"], 1e-6)
            qkv = F.linear(h, w.get("qkv_deq", w["qkv"]))
            x = F.linear(qkv[:, : NQ * HD], w.get("o_deq", w["o"]))
            x, r = add_rms_norm(x, r, w["n2"], 1e-6)
            F.linear(x, w["router"])
        return x

    nbytes = CHAIN_LAYERS * sum(w[k].numel() * w[k].element_size() for w in layers[:1]
                                for k in ("qkv", "o", "router"))
    nbytes += CHAIN_LAYERS * sum(v.numel() * 4 for (i, _), v in scales.items() if i == 0)
    return fused, unfused, nbytes


def time_gemv(c: Ctx, row):
    """Each projection alone (GEMV vs cuBLAS, M = 1; single kernels replayed in a graph
    read from L2), then the 48-layer chain as one graph (1.9 GB of weights): fused (norms
    folded, GEMVs) with PDL, the same without PDL, and cuBLAS + norm kernels."""
    import torch.nn.functional as F

    from phalanx.kernels.gpu.gemv import gemv_triton
    from phalanx.kernels.gpu.pdl import set_pdl

    for M in (1,):
        for name, (N, K) in {"qkv": QKV, "o": O, "router": ROUTER}.items():
            x, w = c.randn(M, K), c.randn(N, K, scale=K**-0.5)
            row("gemv", f"{name} M={M}", lambda: gemv_triton(x, w)[0], lambda: F.linear(x, w), None,
                nbytes=N * K * 2, bw=GEMV_BW)
    for M in (1,):
        fused, unfused, nbytes = _chain(c, M)
        row("chain-pdl", f"48 layers M={M}", fused, unfused, None, nbytes=nbytes, bw=GEMV_BW)
        old = set_pdl(False)
        try:
            row("chain-nopdl", f"48 layers M={M}", fused, unfused, None, nbytes=nbytes, bw=GEMV_BW)
        finally:
            set_pdl(old)
        row("chain-cublas", f"48 layers M={M}", unfused, unfused, None, nbytes=nbytes, bw=GEMV_BW)
    kernel, fold = _chain(c, 1, route="kernel")[0], _chain(c, 1, route="fold")[0]
    row("chain-route", "M=1 route kernel / folded", fold, kernel, None, nbytes=nbytes, bw=GEMV_BW)
    fused8, unfused8, nbytes8 = _chain(c, 1, fp8=True)  # FP8 qkv and o
    row("chain-fp8", "M=1 / cuBLAS deq", fused8, unfused8, None, nbytes=nbytes8, bw=GEMV_BW)
    # form 2 (block sums scaled once, the default) against form 1, the same weights and tiles
    row("chain-fp8", "M=1 form 2 / form 1", _fp8_form(fused8, 2), _fp8_form(fused8, 1), None,
        nbytes=nbytes8, bw=GEMV_BW)
    for name, cfg in CHAIN_SWEEP_FP8.items():  # M = 1, PDL on
        fused8, _, nbytes8 = _chain(c, 1, cfg, fp8=True)
        row("chain-fp8", f"M=1 {name}", fused8, fused8, None, nbytes=nbytes8, bw=GEMV_BW)
    for name, cfg in CHAIN_SWEEP.items():  # M = 1, PDL on
        fused, _, nbytes = _chain(c, 1, cfg)
        row("chain-pdl", f"M=1 {name}", fused, fused, None, nbytes=nbytes, bw=GEMV_BW)
