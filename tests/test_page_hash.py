"""The C page hashing (`router/_page_hash.c`) against hashlib and struct, and its Python
fallback against both: the same bytes, the same chain hashes, the same early stop, the
same errors. The C module is built by the install the tests run from (`pip install -e`),
so its absence here is a failure, not a skip."""

from __future__ import annotations

import hashlib
import random
import struct

import numpy as np
import pytest

from phalanx.router import page_hash
from phalanx.router.page_hasher import page_hashes

IMPLS = {"c": (page_hash.pack, page_hash.chain), "python": (page_hash.pack_py,
                                                             page_hash.chain_py)}


def test_the_c_module_is_built_and_in_use():
    assert page_hash.NATIVE, "router/_page_hash.c was not built: pip install -e ."
    assert page_hash.chain.__module__.endswith("_page_hash")


def _blake8(parent, page: bytes) -> int:
    prefix = b"" if parent is None else parent.to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(prefix + page, digest_size=8).digest(), "little")


@pytest.mark.parametrize("impl", IMPLS)
def test_pack_equals_struct(impl):
    pack, _ = IMPLS[impl]
    rng = random.Random(0)
    for n in (0, 1, 7, 1000):
        t = [rng.randrange(-1 << 63, 1 << 63) for _ in range(n)]
        assert pack(t) == struct.pack(f"<{n}q", *t)
        assert pack(tuple(t)) == pack(t)
    edges = [0, -1, (1 << 63) - 1, -(1 << 63)]
    assert pack(edges) == struct.pack("<4q", *edges)


@pytest.mark.parametrize("impl", IMPLS)
def test_chain_equals_blake2b_across_block_boundaries(impl):
    """Messages of 8 + 8 * ps bytes fall on both sides of BLAKE2b's 128-byte blocks
    (ps = 15: 128 with a parent, 16: 128 without one and 136 with, 31/32/33: 2-3 blocks)."""
    pack, chain = IMPLS[impl]
    rng = random.Random(1)
    for ps in (1, 2, 15, 16, 17, 31, 32, 33, 100):
        for parent in (None, 0, 1, (1 << 64) - 1, rng.randrange(1 << 64)):
            t = [rng.randrange(1 << 20) for _ in range(ps * 5 + ps // 2)]
            data = pack(t)
            got = chain(data, 0, 5, 8 * ps, parent, None)
            want, prev = [], parent
            for p in range(5):
                prev = _blake8(prev, data[8 * ps * p:8 * ps * (p + 1)])
                want.append(prev)
            assert got == want
            assert got == page_hashes(t, ps, parent)
            # from the middle: page 2 chained to page 1's hash
            assert chain(data, 2, 5, 8 * ps, got[1], None) == got[2:]


@pytest.mark.parametrize("impl", IMPLS)
def test_chain_stops_after_the_first_hash_named_in_stop_at(impl):
    pack, chain = IMPLS[impl]
    t = list(range(16 * 6))
    data = pack(t)
    full = chain(data, 0, 6, 128, None, None)
    assert chain(data, 0, 6, 128, None, {full[3]: "run"}) == full[:4]
    assert chain(data, 0, 6, 128, None, {full[4]: 1, full[1]: 2}) == full[:2]
    assert chain(data, 0, 6, 128, None, {12345: 1}) == full
    assert chain(data, 0, 6, 128, None, {}) == full
    assert chain(data, 3, 3, 128, full[2], None) == []
    assert chain(bytearray(data), 0, 6, 128, None, None) == full


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_input_is_refused(impl):
    pack, chain = IMPLS[impl]
    with pytest.raises((TypeError, struct.error)):
        pack([1, "2"])
    with pytest.raises((TypeError, struct.error)):
        pack([1.0])
    assert pack([np.int64(5), np.int32(-2)]) == pack([5, -2])
    with pytest.raises((OverflowError, struct.error)):
        pack([1 << 63])
    data = pack(list(range(32)))
    for first, stop, pb in ((0, 3, 128), (-1, 1, 128), (2, 1, 128), (0, 1, 0)):
        with pytest.raises(ValueError, match="range"):
            chain(data, first, stop, pb, None, None)
    with pytest.raises((OverflowError, TypeError)):
        chain(data, 0, 1, 128, -1, None)


class _Run:
    __slots__ = ("start", "hashes", "data")

    def __init__(self, start, hashes, data):
        self.start, self.hashes, self.data = start, hashes, data


def test_walk_takes_hashes_from_runs_and_reports_the_cut():
    """One run holding pages 0-5 of a sequence: a prompt equal to its first 3 pages and
    then different is hashed as 1 page (to find the run) + 2 taken + the rest, and the
    run is reported cut at page 3; both implementations agree, run by identity."""
    ps, pb = 4, 32
    rng = random.Random(3)
    seq = [rng.randrange(100) for _ in range(ps * 6)]
    hs = page_hashes(seq, ps)
    run = _Run(0, list(hs), bytearray(page_hash.pack_py(seq)))
    at = dict.fromkeys(hs, run)
    prompt = seq[:ps * 3] + [rng.randrange(100, 200) for _ in range(ps * 2)]
    for walk in (page_hash.walk, page_hash.walk_py):
        out, fresh, touched, reused = walk(page_hash.pack(prompt), 5, pb, None, 0, at)
        assert out == page_hashes(prompt, ps)
        assert fresh == [(3, 5)] and reused == 2
        assert len(touched) == 1 and touched[0][0] is run and touched[0][1] == 3
        # all of the run and beyond: no cut; a continuation from page 2 (first_page)
        longer = seq + [1] * ps * 2
        out, fresh, touched, reused = walk(page_hash.pack(longer), 8, pb, None, 0, at)
        assert out == page_hashes(longer, ps) and fresh == [(6, 8)] and reused == 5
        assert touched == [(run, -1)]
        tail = longer[ps * 2:]
        out, fresh, touched, reused = walk(page_hash.pack(tail), 6, pb, hs[1], 2, at)
        assert out == page_hashes(longer, ps)[2:] and fresh == [(4, 6)] and reused == 3
        # a run found at the wrong position (start off by one) is not taken
        moved = _Run(1, list(hs), run.data)
        out, fresh, touched, reused = walk(page_hash.pack(seq), 6, pb, None, 0,
                                           dict.fromkeys(hs, moved))
        assert out == hs and fresh == [(0, 6)] and touched == [] and reused == 0


@pytest.mark.parametrize("seed", range(20))
def test_walk_in_c_equals_the_python_walk(seed):
    """Random sequences over a small alphabet against the runs of a PageHasher fed
    similar ones: the same hashes, fresh ranges, runs touched and cuts."""
    from phalanx.router.page_hasher import PageHasher
    rng = random.Random(seed)
    ps = rng.choice([1, 2, 4, 16])
    h = PageHasher(ps, budget=rng.choice([8, 64, 1 << 16]))
    base = [[rng.randrange(3) for _ in range(rng.randrange(0, 12 * ps))] for _ in range(5)]
    for _ in range(60):
        t = list(rng.choice(base))
        t += [rng.randrange(3) for _ in range(rng.randrange(3 * ps))]
        n = len(t) // ps
        data = page_hash.pack(t)
        got = page_hash.walk(data, n, 8 * ps, None, 0, h._at)
        want = page_hash.walk_py(data, n, 8 * ps, None, 0, h._at)
        assert got[0] == want[0] == page_hashes(t, ps)
        assert got[1:] == want[1:]
        h.hashes(t)
        base[rng.randrange(5)] = t


def test_walk_refuses_bad_runs_and_ranges():
    data = page_hash.pack(list(range(8)))
    hs = page_hashes(list(range(8)), 4)
    with pytest.raises(ValueError, match="range"):
        page_hash.walk(data, 3, 32, None, 0, {})
    with pytest.raises(TypeError):
        page_hash.walk(data, 2, 32, None, 0, [])
    with pytest.raises(TypeError, match="list"):
        page_hash.walk(data, 2, 32, None, 0, {hs[0]: _Run(0, tuple(hs), bytearray(data))})
    with pytest.raises(TypeError, match="bytearray"):
        page_hash.walk(data, 2, 32, None, 0, {hs[0]: _Run(0, list(hs), bytes(data))})
    with pytest.raises(AttributeError):
        page_hash.walk(data, 2, 32, None, 0, {hs[0]: object()})
