"""The transport's one-launch slab kernel (kv_transfer/transport/slab_copy.py) against its
per-granule-run torch path, on CPU under Triton's interpreter (in a subprocess, since
TRITON_INTERPRET must be set before triton is imported): for the resharding cases of
kv_cases (partial pages, mixed granules, different page sizes), blocks cut into
small messages, gather then scatter give bit-equal payloads and pools."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CASES = ["tp2_to_tp1", "tp1_to_tp2", "tp4_kv2_to_tp1"]


def _check(case: str, device: str = "cpu", ring_capacity: int = 0) -> dict:
    """ring_capacity (CUDA): the kernel pools' block rows go through a `DescRing` this
    small (laps every few launches) instead of the default one."""
    import numpy as np
    import torch
    from phalanx.kv_transfer.planning import messages as m
    from phalanx.kv_transfer.transport.staging import KVPools
    import kv_cases as t

    plan = t.case_plan(case)
    src_layout, dst_layout = t.case_layouts(case)
    stats = {"messages": 0, "granules": set()}
    for d in range(dst_layout.tp):
        def on(pools):  # one allocation on `device`
            buf = torch.stack([torch.stack(pair) for pair in pools]).to(device)
            return [(buf[i, 0], buf[i, 1]) for i in range(len(pools))]
        pools = {k: on(t.zero_pools(case, d)) for k in ("kernel", "torch")}
        dst = {"kernel": KVPools(pools["kernel"], slab_kernel=True),
               "torch": KVPools(pools["torch"], slab_kernel=False)}
        for s in range(src_layout.tp):
            table = m.encode_copies([c for c in plan if (c.src_rank, c.dst_rank) == (s, d)])
            src_pools = on(t.side_pools(case, "src", s, "noise"))
            src = {"kernel": KVPools(src_pools, slab_kernel=True),
                   "torch": KVPools(src_pools, slab_kernel=False)}
            if ring_capacity:
                from phalanx.kv_transfer.transport.slab_copy import DescRing
                for p in (src["kernel"], dst["kernel"]):
                    p._ring = DescRing(p.device, capacity=ring_capacity)
            for template, blocks in m.templates_of(table):
                tx = {k: p.template(template, "src") for k, p in src.items()}
                rx = {k: p.template(template, "dst") for k, p in dst.items()}
                stats["granules"].update(tx["torch"].granules + rx["torch"].granules)
                pieces = [p for b in blocks.tolist() for p, _ in tx["torch"].cut(b, 900)]
                for lo in range(0, len(pieces), 3):  # messages of up to 3 blocks
                    cut = np.array(pieces[lo:lo + 3], dtype=np.int32)
                    bufs = {}
                    for k in ("kernel", "torch"):
                        bufs[k] = torch.full((tx[k].nbytes(cut),), 7, dtype=torch.uint8,
                                             device=device)
                        if device == "cuda":  # the copy stream does not wait for the fill
                            torch.cuda.synchronize()
                        src[k].gather(tx[k], cut, bufs[k])
                        dst[k].scatter(rx[k], cut, bufs[k])
                        src[k].sync()
                        dst[k].sync()
                    if not torch.equal(bufs["kernel"], bufs["torch"]):
                        return {"error": f"payload differs, dst {d} src {s} blocks {cut.tolist()}"}
                    stats["messages"] += 1
        same = all(torch.equal(a, b) for pa, pb in zip(pools["kernel"], pools["torch"])
                   for a, b in zip(pa, pb))
        want = t.side_pools(case, "dst", d, "zero")
        right = all(torch.equal(want[l][k], pools["kernel"][l][k].cpu())
                    for l in range(len(want)) for k in range(2))
        if not (same and right):
            return {"error": f"dst {d}: pools differ (kernel vs torch {same}, vs plan {right})"}
    return {"messages": stats["messages"], "granules": sorted(stats["granules"])}


@pytest.fixture(scope="module")
def results() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True,
                          text=True, timeout=600, cwd=tests_dir)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1])


@pytest.mark.parametrize("case", CASES)
def test_slab_kernel_equals_the_torch_path(results, case):
    got = results[case]
    assert "error" not in got, got
    assert got["messages"] > 3 and len(got["granules"]) > 1  # mixed granules were covered


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", CASES)
def test_slab_kernel_equals_the_torch_path_on_gpu(case):
    """The compiled kernel on the GPU, float32 pools (bit-equal copies either way)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    got = _check(case, "cuda")
    assert "error" not in got, got
    assert got["messages"] > 3 and len(got["granules"]) > 1


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_slab_kernel_reading_rows_in_host_memory_over_ring_laps():
    """The block rows read in place from a small pinned ring (laps every few launches),
    through the compiled kernel after each shape's first launch: still bit-equal."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from phalanx.kv_transfer.transport import slab_copy

    slab_copy._launches._compiled.clear()
    got = _check("tp2_to_tp1", "cuda", ring_capacity=32)
    assert "error" not in got, got
    assert slab_copy._launches._compiled  # the later launches took the compiled kernel


def test_launch_choice_between_compiled_kernel_jit_and_device_rows(monkeypatch):
    """`SlabIndex._launch_mapped` through `CompiledLaunches`, with the kernel replaced by
    a recorder (CPU): a shape's first launch goes through the JIT and keeps the compiled
    kernel (pointers aligned), later ones go to it with the pointers as integers and a
    3-d grid; a compiled kernel that refuses its arguments turns compiled launches off
    for good (the launch goes through the JIT); a JIT that cannot address host memory
    turns in-place rows off (False)."""
    import numpy as np
    import torch

    from phalanx.kernels.gpu.compiled_launch import CompiledLaunches
    from phalanx.kv_transfer.transport import slab_copy

    calls = []

    class Compiled:
        def __init__(self, refuse=False):
            self.refuse = refuse

        def __getitem__(self, grid):
            def run(*args):
                if self.refuse:
                    raise TypeError("takes its arguments otherwise")
                calls.append(("compiled", grid, args))
            return run

    class Jit:
        error = None

        def __getitem__(self, grid):
            def run(*args, num_warps):
                if self.error is not None:
                    raise self.error
                calls.append(("jit", grid, args))
                return Compiled()
            return run

    class Ring:
        host = torch.zeros(8, dtype=torch.int64)
        mapped = True

    jit = Jit()
    launches = CompiledLaunches(jit)
    monkeypatch.setattr(slab_copy, "_launches", launches)
    index = slab_copy.SlabIndex([(0, 1, 1, np.array([0, 1]), np.array([0, 2]))], 1, 16,
                                torch.device("cpu"))
    pools, payload, ring = torch.zeros(64), torch.zeros(32), Ring()
    launch = lambda off: index._launch_mapped(pools, payload, ring, off, (1, 1),  # noqa: E731
                                              (True, 4, 16, 16, 16), 4)
    assert launch(0) and launch(2)
    assert [c[0] for c in calls] == ["jit", "compiled"]
    assert calls[1][1] == (1, 1, 1) and calls[1][2][-6:] == (2, True, 4, 16, 16, 16)
    assert all(isinstance(p, int) for p in calls[1][2][:6])  # pointers as integers
    assert calls[1][2][5] == ring.host.data_ptr()  # the rows read in host memory
    launches._compiled[next(iter(launches._compiled))] = Compiled(refuse=True)
    assert launch(4) and calls[-1][0] == "jit"
    assert not launches.enabled and not launches._compiled
    assert launch(6) and calls[-1][0] == "jit" and not launches._compiled
    jit.error = ValueError("Pointer argument cannot be accessed from Triton (cpu tensor?)")
    assert not launch(0) and not ring.mapped


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("how", ["upload", "in_place"])
def test_desc_ring_rows_survive_laps_behind_a_busy_stream(how):
    """`DescRing` over several laps while the stream is busy: each launch's rows, read on
    the stream right after they were placed (copied to the device by `upload`, or read
    from host memory by a kernel, as the slab kernel reads them), hold what was placed;
    a lap never overwrites rows that a queued copy or kernel has not read yet."""
    import numpy as np
    import torch
    import triton
    import triton.language as tl

    from phalanx.kv_transfer.transport.slab_copy import DescRing

    @triton.jit
    def read_rows(src_ptr, off, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(out_ptr + i, tl.load(src_ptr + off + i, mask=i < n), mask=i < n)

    def in_place(ring, rows):
        out = torch.empty(rows.size, dtype=torch.int64, device=dev)
        off = ring.place(rows)
        assert off % 2 == 0  # 16-byte aligned slots
        read_rows[(1,)](ring.host, off, out, rows.size, BLOCK=64)
        return out

    dev = torch.device("cuda", 0)
    read = in_place if how == "in_place" else lambda ring, rows: ring.upload(rows).clone()
    stream = torch.cuda.Stream(dev)
    rng = np.random.default_rng(5)
    ring, wanted, seen = DescRing(dev, capacity=256), [], []
    big = torch.randn(4096, 4096, device=dev)
    with torch.cuda.stream(stream):
        for i in range(200):
            if i % 20 == 0:
                big = big @ big / 64  # keeps the stream busy (ms of queued work)
            rows = rng.integers(0, 1 << 40, size=(int(rng.integers(1, 12)), 4))
            wanted.append(rows.reshape(-1))
            seen.append(read(ring, rows).view(-1))  # ordered after the placement
    stream.synchronize()
    assert all(np.array_equal(w, s.cpu().numpy()) for w, s in zip(wanted, seen))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    out = {}
    for case in CASES:
        try:
            out[case] = _check(case)
        except Exception as e:  # reported per case
            import traceback
            out[case] = {"error": "".join(traceback.format_exception(e))[-2000:]}
    print(json.dumps(out))
