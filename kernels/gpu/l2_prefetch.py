"""Weight bytes fetched into L2 ahead of their use: a hint, never a dependency.

A PDL-launched kernel (`pdl.py`) may start while the kernel before it is still running,
and before its ``gdc_wait`` it may *read* only what no kernel of the step writes. A
prefetch into L2 is not a read that any value depends on: the program later loads the
same bytes through the normal path, after its wait, so a prefetch may take its address
from a buffer another kernel has written (or is writing). A stale or wrong address costs
bandwidth only, as long as it stays inside the tensor (callers check the range).

Use: a decode kernel whose weight rows are picked by an index an earlier launch computed
(the MoE down projection's expert, chosen by the route kernel two launches back) issues
the prefetch of its tile's rows at its start, before its PDL wait, so those bytes stream
from HBM while the kernel before it still runs; after the wait its loop reads them from
L2.

sm_90's ``cp.async.bulk.prefetch.L2.global [addr], size`` fetches ``size`` bytes (a
multiple of 16, ``addr`` 16-byte aligned) in one instruction (`prefetch_rows`);
``prefetch.global.L2 [addr]`` fetches the line holding one address (`prefetch_lines`).
Callers compile them only for CUDA (Triton's interpreter runs no inline assembly:
`prefetch_lines` takes ``ON``, `prefetch_rows` sits under the caller's own switch); a tensor element held by several threads is prefetched by each, which
the L2 merges.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["prefetch_rows", "prefetch_lines", "prefetch_paged_rows", "bulk_rows_ok", "prefetch_capable"]


@triton.jit
def prefetch_rows(row_ptrs, nbytes, mask, KEEP: tl.constexpr):
    """Prefetch ``nbytes`` (a multiple of 16) from each 16-byte-aligned pointer of
    ``row_ptrs`` where ``mask``. KEEP: the lines marked evict-last (a streaming kernel
    running meanwhile evicts its own lines first)."""
    if KEEP:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b64 pol; setp.ne.b32 p, $2, 0; "
            "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $3, pol; mov.u32 $0, 0; }",
            "=r,l,r,r", [row_ptrs, mask.to(tl.int32), nbytes + mask.to(tl.int32) * 0],
            dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
            "=r,l,r,r", [row_ptrs, mask.to(tl.int32), nbytes + mask.to(tl.int32) * 0],
            dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_lines(ptrs, mask, ON: tl.constexpr):
    """Prefetch the L2 line holding each pointer of ``ptrs`` where ``mask``."""
    if ON:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_paged_rows(bt_row, start, end, base, s_page, s_pos, PAGE, ROW_BYTES, BLOCK_N: tl.constexpr):
    """Prefetch the rows (``ROW_BYTES`` each, at ``base + page * s_page + offset * s_pos``)
    of positions [start, end) of a paged cache whose pages are listed at ``bt_row``
    (int32 page ids, one per PAGE positions), BLOCK_N positions at a time."""
    nn = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + nn
        m = pos < end
        page = tl.load(bt_row + pos // PAGE, mask=m, other=0).to(tl.int64)
        prefetch_rows(base + page * s_page + (pos % PAGE).to(tl.int64) * s_pos, ROW_BYTES, m, False)


def prefetch_capable(device) -> bool:
    """Whether kernels on ``device`` may compile the prefetches: CUDA, sm_90 or newer."""
    if device.type != "cuda":
        return False
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index) >= (9, 0)


def bulk_rows_ok(t, row_bytes: int) -> bool:
    """Whether `prefetch_rows` can take rows of ``row_bytes`` of tensor ``t`` (any row of
    any leading index): 16-byte aligned base and strides, ``row_bytes`` a multiple of 16.
    (The device is `prefetch_capable`'s question.)"""
    es = t.element_size()
    return (t.data_ptr() % 16 == 0 and row_bytes % 16 == 0
            and all((s * es) % 16 == 0 for s in t.stride()[:-1]))
