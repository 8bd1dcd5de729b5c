"""The C page hashing (`router/_page_hash.c`) against hashlib and struct, and its Python
fallback against both: the same bytes, the same chain hashes, the same early stop, the
same errors. The C module is built by the install the tests run from (`pip install -e`),
so its absence here is a failure, not a skip."""

from __future__ import annotations

import hashlib
import random
import struct
from array import array

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


WALKS = (page_hash.walk, page_hash.walk_py)


def _index(*runs):
    """A PageIndex mapping every hash of each run to it (later runs win)."""
    ix = page_hash.PageIndex()
    for run in runs:
        ix.set_range(run.hashes, 0, len(run.hashes), run)
    return ix


def _walk(walk, data, n, pb, parent, first_page, at):
    """(hashes as a list, fresh, touched, reused) of one walk."""
    out = array("Q", [0]) * n
    fresh, touched, reused = walk(data, n, pb, parent, first_page, at, out)
    return list(out), fresh, touched, reused


def test_walk_takes_hashes_from_runs_and_reports_the_cut():
    """One run holding pages 0-5 of a sequence: a prompt equal to its first 3 pages and
    then different is hashed as 1 page (to find the run) + 2 taken + the rest, and the
    run is reported cut at page 3; both implementations agree, run by identity."""
    ps, pb = 4, 32
    rng = random.Random(3)
    seq = [rng.randrange(100) for _ in range(ps * 6)]
    hs = page_hashes(seq, ps)
    run = _Run(0, array("Q", hs), bytearray(page_hash.pack_py(seq)))
    at = _index(run)
    prompt = seq[:ps * 3] + [rng.randrange(100, 200) for _ in range(ps * 2)]
    for walk in WALKS:
        out, fresh, touched, reused = _walk(walk, page_hash.pack(prompt), 5, pb, None, 0, at)
        assert out == page_hashes(prompt, ps)
        assert fresh == [(3, 5)] and reused == 2
        assert len(touched) == 1 and touched[0][0] is run and touched[0][1] == 3
        # all of the run and beyond: no cut; a continuation from page 2 (first_page)
        longer = seq + [1] * ps * 2
        out, fresh, touched, reused = _walk(walk, page_hash.pack(longer), 8, pb, None, 0, at)
        assert out == page_hashes(longer, ps) and fresh == [(6, 8)] and reused == 5
        assert touched == [(run, -1)]
        tail = longer[ps * 2:]
        out, fresh, touched, reused = _walk(walk, page_hash.pack(tail), 6, pb, hs[1], 2, at)
        assert out == page_hashes(longer, ps)[2:] and fresh == [(4, 6)] and reused == 3
        # a run found at the wrong position (start off by one) is not taken
        moved = _Run(1, array("Q", hs), run.data)
        out, fresh, touched, reused = _walk(walk, page_hash.pack(seq), 6, pb, None, 0,
                                            _index(moved))
        assert out == hs and fresh == [(0, 6)] and touched == [] and reused == 0


def test_walk_looks_up_no_run_past_a_page_none_holds():
    """Two runs of one sequence, pages 0-1 and 2-5: both are taken while the first is
    there; without it, page 0 is new and every later page is hashed without a lookup
    (the second run is not taken), with the same hashes."""
    ps, pb = 2, 16
    seq = list(range(ps * 6))
    hs = page_hashes(seq, ps)
    data = page_hash.pack_py(seq)
    head = _Run(0, array("Q", hs[:2]), bytearray(data[:2 * pb]))
    rest = _Run(2, array("Q", hs[2:]), bytearray(data[2 * pb:]))
    both, only_rest = _index(head, rest), _index(rest)
    for walk in WALKS:
        out, fresh, touched, reused = _walk(walk, data, 6, pb, None, 0, both)
        assert out == hs and fresh == [] and reused == 4
        assert touched == [(head, -1), (rest, -1)]
        out, fresh, touched, reused = _walk(walk, data, 6, pb, None, 0, only_rest)
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
        got = _walk(page_hash.walk, data, n, 8 * ps, None, 0, h._at)
        want = _walk(page_hash.walk_py, data, n, 8 * ps, None, 0, h._at)
        assert got[0] == want[0] == page_hashes(t, ps)
        assert got[1:] == want[1:]
        h.hashes(t)
        base[rng.randrange(5)] = t


def test_walk_refuses_bad_runs_and_ranges():
    data = page_hash.pack(list(range(8)))
    hs = page_hashes(list(range(8)), 4)
    out = array("Q", [0, 0])

    def walk(n, at, into=out):
        return page_hash.walk(data, n, 32, None, 0, at, into)

    def at_first(run):
        ix = page_hash.PageIndex()
        ix.set_range(array("Q", hs[:1]), 0, 1, run)
        return ix

    with pytest.raises(ValueError, match="range"):
        walk(3, page_hash.PageIndex())
    with pytest.raises(ValueError, match="uint64"):
        walk(2, page_hash.PageIndex(), array("Q", [0]))
    with pytest.raises(TypeError):
        walk(2, {})  # a dict is no PageIndex
    for hashes in (tuple(hs), list(hs), array("q", [1, 2])):
        with pytest.raises(TypeError, match="array"):
            walk(2, at_first(_Run(0, hashes, bytearray(data))))
    with pytest.raises(TypeError, match="bytearray"):
        walk(2, at_first(_Run(0, array("Q", hs), bytes(data))))
    with pytest.raises(AttributeError):
        walk(2, at_first(object()))
    with pytest.raises(TypeError):
        page_hash.walk(data, 2, 32, None, 0, page_hash.PageIndex(), bytes(16))  # read-only


@pytest.mark.parametrize("index", [page_hash.PageIndex, page_hash.PageIndexPy])
def test_page_index_maps_hashes_to_runs_and_unindexes_only_a_runs_own(index):
    """set_range maps (a later run takes a hash over), unindex removes only the entries
    still naming the run, a range at a time; the full uint64 range; bad input refused."""
    dropped, later = object(), object()
    ix = index()
    hs = array("Q", [5, 1 << 63, 7, (1 << 64) - 1, 9])
    ix.set_range(hs, 0, 4, dropped)
    ix.set_range(array("Q", [1 << 63, 11]), 0, 2, later)
    assert len(ix) == 5 and ix.get(1 << 63) is later and ix.get(7) is dropped
    assert ix.get(9) is None and ix.get(9, "none") == "none" and ix.get(-1) is None
    assert ix.unindex(hs, 0, 3, dropped) == 2  # 1 << 63 is `later`'s now
    assert ix.get(5) is None and ix.get(1 << 63) is later and len(ix) == 3
    assert ix.unindex(hs, 3, 5, dropped) == 1  # 9 was never in
    assert ix.unindex(hs, 5, 5, dropped) == 0 and len(ix) == 2
    for bad in ((hs, 2, 6), (hs, 3, 2), (hs, -1, 2)):
        with pytest.raises(ValueError, match="range"):
            ix.unindex(*bad, dropped)
        with pytest.raises(ValueError, match="range"):
            ix.set_range(*bad, dropped)
    with pytest.raises(TypeError, match="array"):
        ix.set_range([1, 2], 0, 2, later)
    ix.clear()
    assert len(ix) == 0 and ix.get(11) is None


def test_page_index_grows_and_reuses_deleted_slots_like_a_dict():
    """Random inserts, replacements and deletions against a dict, through growth and
    many deleted slots: the same mapping throughout, runs referenced while mapped."""
    import sys
    rng = random.Random(7)
    ix, want = page_hash.PageIndex(), {}
    runs = [object() for _ in range(4)]
    keys = [rng.getrandbits(64) for _ in range(3000)]
    for step in range(20000):
        k, run = rng.choice(keys), rng.choice(runs)
        one = array("Q", [k])
        if rng.random() < 0.6:
            ix.set_range(one, 0, 1, run)
            want[k] = run
        elif ix.unindex(one, 0, 1, run):
            assert want.pop(k) is run
        else:
            assert want.get(k) is not run
    assert len(ix) == len(want)
    assert all(ix.get(k) is want.get(k) for k in keys)
    refs = [sys.getrefcount(r) for r in runs]
    del ix
    assert [sys.getrefcount(r) for r in runs] == [n - sum(v is r for v in want.values())
                                                   for n, r in zip(refs, runs)]
