"""How fast an SM turns FP8 weight codes into the bf16 tile an MMA takes, against how fast
the memory delivers them (issue 33 point 5: the FP8 experts at batch 64 read their weights
at 0.81 of the copy rate on one H200).

    python bench/probes/fp8_dequant_rate.py [--iters 512] [--programs-per-sm 4]
    TRITON_INTERPRET=1 python bench/probes/fp8_dequant_rate.py --check-only   # on CPU

The experts' decode kernels dequantize in registers as the reference does,
``(code.float() * scale).to(bf16)``. Compiled for sm_90 (`kernel_resources.py`, SASS)
that is per code one F2FP (e4m3x2 -> f16x2, shared by two codes), one HADD2.F32 (f16 ->
f32), one FMUL and half an F2FP (f32x2 -> bf16x2): if F2FP issues at a quarter of the
FP32 rate, conversion alone takes 16 codes per clock per SM, ~4.2 T codes/s on 132 SMs
at 1.98 GHz: the H200's copy rate. Two ways to the same bits:

* ``cvt``: today's (`kernels/gpu/moe_decode._dequant`, `moe_fp8`);
* ``bits``: the float32 built from the code's bits with integer ops (sign to bit 31, the
  7 magnitude bits to bits 26..20: the code's value times 2^-120, exact, an e4m3
  subnormal becoming a float32 subnormal), then times 2^64 and times ``scale * 2^56``:
  one rounding, the reference's (no F2FP but the bf16 pack).

Compiled for sm_90 (8 warps; `offline_sm90`), per 64 codes a thread: ``cvt`` 64 F2FP + 64
HADD2 + 64 FMUL + 142 IMAD + 129 LOP3 + 64 PRMT (664 instructions a loop), ``bits`` 32 F2FP
+ 144 FMUL + 226 IMAD + 162 LOP3 + 129 PRMT (848): it trades F2FP for integer work on the
FMA pipe, so only the device can say which is faster. This loop is not the experts' (its
tile goes through shared memory to the MMA's layout, and the bit flip costs LOP3s): its
``cvt`` row bounds how fast the dequantization alone can go; if that is well above the
copy rate, the experts are not conversion-bound.

Each program holds one 128 x 128 code tile in registers and, ``--iters`` times, flips its
codes' lowest bit (so nothing is hoisted; codes are drawn so that both stay finite),
dequantizes it and feeds a 16-row MMA as the kernels do. Printed: codes per second per
mode against the measured copy rate (bytes per second = codes per second), and the bit
check of both modes against the reference over all 254 finite codes and scales from
2^-140 to 2^60 (products in the float32 subnormal range included). JSON to
$OUT/fp8_dequant_rate.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

MODES = ("cvt", "bits")
BLOCK = 128
ROWS = 16


@triton.jit
def _scaled(w, s, MODE: tl.constexpr):
    """codes ``w [K, N]`` (float8e4nv) times per-column scales ``s [N]`` (float32), in
    float32: exactly ``w.float() * s`` in both modes."""
    if MODE == 0:
        return w.to(tl.float32) * s[None, :]
    u = w.to(tl.uint8, bitcast=True).to(tl.uint32)
    f = (((u & 0x80) << 24) | ((u & 0x7F) << 20)).to(tl.float32, bitcast=True)  # value * 2^-120
    return (f * 18446744073709551616.0) * (s * 72057594037927936.0)[None, :]  # 2^64, 2^56


@triton.jit
def _dequant(w, s, MODE: tl.constexpr):
    """``(w.float() * s).to(bf16)``."""
    return _scaled(w, s, MODE).to(tl.bfloat16)


@triton.jit
def _tile_kernel(w_ptr, s_ptr, out_ptr, MODE: tl.constexpr, BLOCK_C: tl.constexpr):
    # out: float32 products, or their bf16 rounding when out is bf16
    k = tl.arange(0, BLOCK_C)
    n = tl.arange(0, BLOCK_C)
    w = tl.load(w_ptr + k[:, None] * BLOCK_C + n[None, :])
    v = _scaled(w, tl.load(s_ptr + n), MODE)
    tl.store(out_ptr + k[:, None] * BLOCK_C + n[None, :], v.to(out_ptr.dtype.element_ty))


@triton.jit
def _rate_kernel(w_ptr, s_ptr, a_ptr, out_ptr, ITERS, MODE: tl.constexpr, BLOCK_C: tl.constexpr,
                 ROWS_C: tl.constexpr):
    pid = tl.program_id(0)
    k = tl.arange(0, BLOCK_C)
    n = tl.arange(0, BLOCK_C)
    r = tl.arange(0, ROWS_C)
    codes = tl.load(w_ptr + pid * BLOCK_C * BLOCK_C + k[:, None] * BLOCK_C + n[None, :])
    codes = codes.to(tl.uint8, bitcast=True)
    s = tl.load(s_ptr + pid * BLOCK_C + n)
    a = tl.load(a_ptr + r[:, None] * BLOCK_C + k[None, :])
    acc = tl.zeros([ROWS_C, BLOCK_C], tl.float32)
    for i in range(ITERS):
        w = (codes ^ (i & 1).to(tl.uint8)).to(tl.float8e4nv, bitcast=True)
        acc = tl.dot(a, _dequant(w, s, MODE), acc=acc)
    tl.store(out_ptr + pid * ROWS_C * BLOCK_C + r[:, None] * BLOCK_C + n[None, :], acc)


def finite_codes(n: int, g: torch.Generator, device) -> torch.Tensor:
    """Codes whose value and whose lowest-bit flip are finite (magnitude <= 0x7D)."""
    mag = torch.randint(0, 0x7E, (n,), generator=g, device="cpu", dtype=torch.int32)
    sign = torch.randint(0, 2, (n,), generator=g, device="cpu", dtype=torch.int32) << 7
    return (mag | sign).to(torch.uint8).view(torch.float8_e4m3fn).to(device)


def bit_check(device) -> dict:
    """Both modes against ``code.float() * scale`` (float32 products) and, on a GPU, its
    bf16 rounding (Triton's interpreter rounds float32 to bf16 by truncation, so there
    only the products): every finite code (0x7F and 0xFF are NaN in e4m3fn) in every
    column, a scale per column from 2^-140 to 2^60 (subnormal products included)."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    col = torch.arange(BLOCK)
    w = codes[(torch.arange(BLOCK)[:, None] * 7 + col[None, :]) % codes.numel()]
    w = w.view(torch.float8_e4m3fn).to(device)
    s = torch.pow(2.0, torch.linspace(-140, 60, BLOCK)) * (1 + torch.rand(BLOCK, generator=torch.Generator().manual_seed(0)))
    s = s.float().to(device)
    ref = w.float() * s[None, :]
    out = {}
    for dtype, bits in [(torch.float32, torch.int32)] + ([(torch.bfloat16, torch.int16)] if device == "cuda" else []):
        want = ref.to(dtype).view(bits)
        for i, mode in enumerate(MODES):
            got = torch.empty(BLOCK, BLOCK, dtype=dtype, device=device)
            _tile_kernel[(1,)](w, s, got, MODE=i, BLOCK_C=BLOCK)
            out[f"{mode} {str(dtype)[6:]}"] = int((got.view(bits) != want).sum())
    return out  # values whose bits differ, per mode and dtype


def copy_rate() -> float:
    from cuda_timing import median_ms

    a = torch.empty(1 << 28, device="cuda", dtype=torch.uint8)
    b = torch.empty_like(a)
    return 2 * a.numel() / (median_ms(lambda: b.copy_(a), 10) / 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=512)
    ap.add_argument("--programs-per-sm", type=int, default=4)
    ap.add_argument("--check-only", action="store_true", help="the bit check alone (CPU: TRITON_INTERPRET=1)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    device = "cpu" if args.check_only and not torch.cuda.is_available() else "cuda"
    differ = bit_check(device)
    print(f"bits differing from the reference (of {BLOCK * BLOCK}): {differ}")
    result = dict(bit_check=differ)
    if not args.check_only:
        from cuda_timing import median_ms

        sms = torch.cuda.get_device_properties(0).multi_processor_count
        programs = sms * args.programs_per_sm
        g = torch.Generator().manual_seed(0)
        w = finite_codes(programs * BLOCK * BLOCK, g, "cuda")
        s = torch.rand(programs * BLOCK, generator=g).cuda() * 1e-3
        a = torch.randn(ROWS, BLOCK, generator=g).to(torch.bfloat16).cuda()
        out = torch.empty(programs, ROWS, BLOCK, device="cuda")
        rate = copy_rate()
        rows = []
        for i, mode in enumerate(MODES):
            ms = median_ms(lambda: _rate_kernel[(programs,)](w, s, a, out, args.iters, MODE=i, BLOCK_C=BLOCK,
                                                             ROWS_C=ROWS, num_warps=8), 10)
            codes_s = programs * args.iters * BLOCK * BLOCK / (ms / 1e3)
            rows.append(dict(mode=mode, ms=ms, codes_per_s=codes_s, of_copy=codes_s / rate))
        result.update(copy_bytes_per_s=rate, sms=sms, programs=programs, iters=args.iters, rows=rows)
        print(f"copy {rate / 1e12:.2f} TB/s, {sms} SMs, {programs} programs x {args.iters} tiles of "
              f"{BLOCK}x{BLOCK}")
        print("| mode | ms | T codes/s | x copy rate (bytes/s) |")
        print("|---|---|---|---|")
        for r in rows:
            print(f"| {r['mode']} | {r['ms']:.2f} | {r['codes_per_s'] / 1e12:.2f} | {r['of_copy']:.2f} |")
    with open(os.path.join(os.environ.get("OUT", "."), "fp8_dequant_rate.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
