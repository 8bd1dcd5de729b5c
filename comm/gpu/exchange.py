"""Triton kernels of the peer exchange (comm/peer_exchange.py): an all-to-all whose
sends are stores into the peers' symmetric buffers and whose waits spin on signal words
on the device, each wait bounded by an abort word the host sets at its deadline.

Layouts (every rank the same, ``cap`` rows per (source, destination) pair, ``W``
elements per row, ``ROWS`` rows per program, ``C = cdiv(cap, ROWS)`` chunks):

- send ``[world * cap, W]``: block ``d`` (rows ``[d * cap, (d + 1) * cap)``) goes to
  rank ``d``; only its first ``counts[d]`` rows are sent (all ``cap`` without counts);
- data (symmetric) ``[world * cap, W]``: block ``s`` is what rank ``s`` sent here;
- flags (symmetric, int64) ``[world, max_chunks]``: ``flags[s, c] = seq << 32 | n``
  once rank ``s`` stored chunk ``c`` of its block for exchange ``seq``, ``n`` the rows
  of that block it sent.

Ordering: a program's stores, then a CTA barrier, then one release store of its flag at
system scope, so a receiver that sees the flag (and then loads with acquire) sees the
rows. Exchange numbers live in device memory, so a CUDA graph replays without new
arguments: ``seq[s]`` (int64 [world]) is the last exchange whose block from rank ``s``
this rank waited for; wait program ``s`` alone reads and advances ``seq[s]``, and a put
numbers its blocks ``seq[me] + 1`` (a rank sends to itself too, and its next put runs
after its previous wait on the same stream). Two launches per exchange, no third to
count.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...kernels.gpu.compiled_launch import CompiledLaunches

ROWS = 16          # rows per put program
BLOCK_W = 256      # elements per row tile
ABORT_EVERY = 64   # spins between two reads of the abort word (host memory on CUDA)


@triton.jit(do_not_specialize=["me", "cap", "W", "max_chunks"])
def _put_kernel(send, counts, peer_data, peer_flags, seq_ptr, me, cap, W, max_chunks,
                HAS_COUNTS: tl.constexpr, ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
                VEC: tl.constexpr):
    d = tl.program_id(0)
    c = tl.program_id(1)
    seq = tl.load(seq_ptr + me) + 1
    if HAS_COUNTS:
        n = tl.minimum(tl.load(counts + d).to(tl.int64), cap)
    else:
        n = seq * 0 + cap
    dst = tl.load(peer_data + d).to(tl.pointer_type(send.dtype.element_ty))
    dst = tl.multiple_of(dst, 16)  # symmetric buffers start 16-byte aligned
    rows = c * ROWS + tl.arange(0, ROWS)
    live = rows < n
    src_off = tl.multiple_of((d * cap + rows).to(tl.int64) * W, VEC)  # VEC divides W
    dst_off = tl.multiple_of((me * cap + rows).to(tl.int64) * W, VEC)
    for t in range(0, tl.cdiv(W, BLOCK_W)):
        cols = t * BLOCK_W + tl.arange(0, BLOCK_W)
        m = live[:, None] & ((cols // VEC) < (W // VEC))[None, :]  # = cols < W, VEC-wide
        v = tl.load(send + src_off[:, None] + cols[None, :], mask=m)
        tl.store(dst + dst_off[:, None] + cols[None, :], v, mask=m)
    tl.debug_barrier()
    flags = tl.load(peer_flags + d).to(tl.pointer_type(tl.int64))
    tl.atomic_xchg(flags + me * max_chunks + c, (seq << 32) | n, sem="release", scope="sys")


@triton.jit(do_not_specialize=["max_spins", "chunks", "max_chunks"])
def _wait_kernel(flags, seq_ptr, recv_counts, status, abort, max_spins, chunks, max_chunks,
                 ABORT_EVERY: tl.constexpr):
    s = tl.program_id(0)
    want = tl.load(seq_ptr + s) + 1
    spins = want.to(tl.int32) * 0
    aborted = tl.load(abort, volatile=True)
    bad = aborted * 0
    for c in range(chunks):
        ptr = flags + s * max_chunks + c
        v = tl.load(ptr, volatile=True)
        while ((v >> 32) != want) & (spins < max_spins) & (aborted == 0):
            spins += 1
            if spins % ABORT_EVERY == 0:
                aborted = tl.load(abort, volatile=True)
            v = tl.load(ptr, volatile=True)
        bad = bad | ((v >> 32) != want).to(tl.int32)
    # acquire: the rows stored before the flags' release are visible to what follows
    v0 = tl.atomic_add(flags + s * max_chunks, 0, sem="acquire", scope="sys")
    tl.store(recv_counts + s, v0 - ((v0 >> 32) << 32))
    tl.store(seq_ptr + s, want)
    if bad != 0:  # sticky: a failed wait stays failed until the exchange is rebuilt
        tl.store(status + s, 1)


_puts = CompiledLaunches(_put_kernel)
_waits = CompiledLaunches(_wait_kernel)


def put(send, counts, peer_data, peer_flags, seq, me: int, cap: int, max_chunks: int) -> None:
    """Store this rank's blocks into every peer's data and raise its flags (queued on the
    current stream). counts: int tensor [world] on send's device, or None (full blocks)."""
    world, W = send.shape[0] // cap, send.shape[1]
    vec = 16 // send.element_size()
    while W % vec:
        vec //= 2
    _puts((world, triton.cdiv(cap, ROWS)),
          (send, counts if counts is not None else seq, peer_data, peer_flags, seq, me, cap, W,
           max_chunks),
          (counts is not None, ROWS, min(BLOCK_W, triton.next_power_of_2(W)), max(vec, 1)))


def wait(flags, seq, recv_counts, status, abort, max_spins: int, cap: int,
         max_chunks: int) -> None:
    """Spin until every source's chunks of its next exchange (``seq[s] + 1``) are
    flagged, the abort word is set or ``max_spins`` pass (then ``status[s]`` becomes 1);
    writes the rows each source sent into ``recv_counts`` and advances ``seq``."""
    _waits((recv_counts.shape[0],),
           (flags, seq, recv_counts, status, abort, max_spins, triton.cdiv(cap, ROWS), max_chunks),
           (ABORT_EVERY,), num_warps=1)
