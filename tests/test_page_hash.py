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
    assert pack([0, -1, (1 << 63) - 1, -(1 << 63)]) == struct.pack("<4q", 0, -1, (1 << 63) - 1,
                                                                   -(1 << 63))


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
