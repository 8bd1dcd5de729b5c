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
    python3 bench/kernels_gpu.py --only gemv     # few-row GEMV + folded norms, 48-layer chains

CPU smoke run of the script's own code (tiny float32 checks under the interpreter)::

    TRITON_INTERPRET=1 python bench/kernels_gpu.py --dry-run

Code: this file runs the groups and reports; shapes and inputs are in
kernels_gpu_inputs.py, the checks in kernels_gpu_checks.py, the timings in
kernels_gpu_timing.py, the linear group in kernels_gpu_linear.py, the gemv group in
kernels_gpu_gemv.py.
Imports nothing GPU-specific at module import time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernels_gpu_checks  # noqa: E402
import kernels_gpu_gemv  # noqa: E402
import kernels_gpu_linear  # noqa: E402
import kernels_gpu_timing  # noqa: E402
from kernels_gpu_inputs import Ctx  # noqa: E402

BW, PEAK = 4.0e12, 7.7e14  # B/s (device-to-device copy), bf16 dense FLOP/s
TOL = 1e-2
GROUPS = ["decode", "moe", "prefill", "attn", "norm", "rope", "linear", "gemv", "split"]


def _import_phalanx():
    """Import phalanx; if not installed, through a temporary link to this checkout."""
    try:
        import phalanx  # noqa: F401
    except ImportError:
        link_dir = Path(tempfile.mkdtemp(prefix="phalanx-bench-"))
        (link_dir / "phalanx").symlink_to(Path(__file__).resolve().parents[1])
        sys.path.insert(0, str(link_dir))


# ---------------------------------------------------------------- one group


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    if not bool(out.isfinite().all()):
        return float("nan")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


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


def _group_fn(kind: str, group: str):
    """`<kind>_<group>` (kind: check or time) of the group modules; KeyError if none."""
    name = f"{kind}_{group}"
    for mod in (kernels_gpu_checks, kernels_gpu_timing, kernels_gpu_linear, kernels_gpu_gemv):
        if hasattr(mod, name):
            return getattr(mod, name)
    raise KeyError(name)


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
        _group_fn("check", group)(c, rec)
    except Exception as exc:
        traceback.print_exc()
        checks.append(dict(kernel=group, case=f"raised {type(exc).__name__}", err=float("nan")))
    if timing:
        try:
            _group_fn("time", group)(c, row)
        except Exception:
            traceback.print_exc()
    return checks, times


# ---------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="all",
                    help="comma list of: " + ", ".join(GROUPS) + " (attn = write_kv; norm includes silu_and_mul;"
                         " linear = skinny GEMM vs cuBLAS; gemv = few-row GEMV, folded norms, PDL chains)")
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
