"""Compile the GPU path's Triton kernels for a Hopper target on a machine without a GPU.

Inside ``offline_target()`` Triton sees a stand-in CUDA driver: every launch of a
``@triton.jit`` kernel is specialized exactly as on the GPU (pointer and integer
alignment, integers equal to 1), compiled through ptxas for ``sm_90a``, and recorded
instead of run (outputs stay as allocated). Each ``Compiled`` record carries what the
cubin says about the kernel: registers per thread, spill stack, shared memory, and how
many ``cp.async`` / TMA copies and ``wgmma`` instructions its PTX holds (whether the
pipeliner staged the loads through shared memory). So a tile config that spills or whose
loads are not pipelined is seen before device time is spent on it.

The figures are the local Triton's: the GPU machine runs triton 3.6
(``../shared/device/README.md``); compile with the same version for its code
(``bench/probes/kernel_resources.py --help`` says how). Python wrappers that ask
``pdl_enabled`` see PDL on, as on an sm_90 device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator

import triton
from triton.backends.compiler import GPUTarget

__all__ = ["Compiled", "offline_target", "compiled_asm", "ptx_body"]

_SM90_SHARED = 232448  # bytes of shared memory a block may use on H100 / H200


@dataclasses.dataclass(frozen=True, slots=True)
class Compiled:
    """One launch compiled offline."""

    name: str
    hash: str  # Triton's key of the compile (its `asm` in `compiled_asm`)
    grid: tuple[int, int, int]
    warps: int
    stages: int
    regs: int  # per thread
    stack: int  # bytes per thread of local-memory stack: spills (0 = none)
    shared: int  # bytes per block
    cp_async: int  # cp.async instructions in the PTX (loads staged through shared memory)
    tma: int  # TMA copies (cp.async.bulk)
    wgmma: int  # Hopper warp-group MMAs
    mma: int  # warp-level MMAs (mma.sync)
    waits: tuple[int, ...]  # each async wait's allowance of copies left in flight, in order;
    # a loop whose waits are all 0 computes with nothing in flight (its copies not overlapped)

    @property
    def blocks_per_sm(self) -> int:
        """Resident blocks per SM allowed by registers (allocated per warp in units of 256),
        shared memory (1 KiB reserved per block) and threads."""
        per_warp = -(-max(1, self.regs) * 32 // 256) * 256
        by_regs = 65536 // (per_warp * self.warps)
        by_smem = _SM90_SHARED // (self.shared + 1024) if self.shared else 32
        return max(0, min(by_regs, by_smem, 2048 // (self.warps * 32), 32))


def _resource_usage(cubin: bytes, tool: str) -> tuple[int, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                              text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)
    return int(regs.group(1)) if regs else -1, int(stack.group(1)) if stack else -1


class _Utils:
    def get_device_properties(self, device):
        return {"max_shared_mem": _SM90_SHARED, "multiprocessor_count": 132, "sm_clock_rate": 1980000,
                "mem_clock_rate": 2619000, "mem_bus_width": 5120, "max_num_regs": 65536,
                "warpSize": 32}

    def load_binary(self, name, kernel, shared, device):
        return None, None, 0, 0, 1024


class _Driver:
    """The parts of Triton's CUDA driver a compile-and-record launch touches."""

    def __init__(self, target: GPUTarget, records: list[Compiled]):
        self._target = target
        self._records = records
        self.utils = _Utils()
        tool_dir = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")
        self._cuobjdump = os.path.join(tool_dir, "cuobjdump")

    def is_active(self):
        return True

    def get_current_target(self):
        return self._target

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty):
        return ty

    def launcher_cls(self, src, metadata):
        driver = self

        def launch(gx, gy, gz, stream, function, packed, launch_md, enter, exit_, *args):
            driver._record(src, metadata, (gx, gy, gz))
        return launch

    def _record(self, src, metadata, grid) -> None:
        kernel = _kernels.get(metadata.hash)
        asm = kernel.asm if kernel is not None else {}
        ptx = asm.get("ptx", "")
        ttgir = asm.get("ttgir", "")
        regs, stack = _resource_usage(asm["cubin"], self._cuobjdump) if "cubin" in asm else (-1, -1)
        self._records.append(Compiled(
            name=metadata.name, hash=metadata.hash, grid=tuple(int(g) for g in grid), warps=metadata.num_warps,
            stages=metadata.num_stages, regs=regs, stack=stack, shared=metadata.shared,
            cp_async=len(re.findall(r"cp\.async\.(?:ca|cg)", ptx)),
            tma=len(re.findall(r"cp\.async\.bulk", ptx)),
            wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
            mma=len(re.findall(r"\bmma\.sync", ptx)),
            waits=tuple(int(n) for n in re.findall(r"async_wait[^{\n]*\{num = (\d+)", ttgir))))


_kernels: dict[str, object] = {}  # metadata hash -> CompiledKernel (its asm)


def compiled_asm(record: Compiled) -> dict[str, str | bytes]:
    """The stages Triton kept for a record's compile: ttir, ttgir, llir, ptx, cubin."""
    return _kernels[record.hash].asm


def ptx_body(ptx: str) -> str:
    """PTX without comments and debug line info: equal for the same code compiled from
    source lines that moved."""
    ptx = ptx.split(".section\t.debug")[0]
    lines = (line for line in ptx.splitlines()
             if not line.lstrip().startswith(("//", ".loc", ".file", "$L__tmp")))
    return "\n".join(line.split("//")[0].rstrip() for line in lines)


@contextlib.contextmanager
def offline_target(capability: int = 90) -> Iterator[list[Compiled]]:
    """Within: Triton launches compile for ``sm_<capability>`` and are recorded, not run.
    Yields the list the records are appended to."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("offline_target compiles for the GPU: unset TRITON_INTERPRET")
    from triton.compiler import compiler as triton_compiler
    from triton.runtime.driver import driver as driver_config

    from phalanx.kernels.gpu import pdl

    records: list[Compiled] = []
    fake = _Driver(GPUTarget("cuda", capability, 32), records)
    real_init = triton_compiler.CompiledKernel.__init__

    def init(self, src, metadata_group, hash):
        real_init(self, src, metadata_group, hash)
        _kernels[self.metadata.hash] = self

    old_active = driver_config._active  # None until something asked for the driver
    driver_config.set_active(fake)
    triton_compiler.CompiledKernel.__init__ = init
    patched = _patch_pdl_device_check(pdl)
    try:
        yield records
    finally:
        for module, attr, value in patched:
            setattr(module, attr, value)
        triton_compiler.CompiledKernel.__init__ = real_init
        driver_config._active = old_active


def _patch_pdl_device_check(pdl) -> list[tuple[object, str, object]]:
    """Make ``pdl_enabled`` answer as for a CUDA device, in every kernel module that
    imported it by name. Returns what to restore."""
    import sys

    def enabled(device, kernel: str = "gemv") -> bool:
        return kernel in pdl._enabled and pdl.gdc_wait is not None

    def launch(device, kernel: str) -> dict:
        return {"PDL": True, "launch_pdl": True} if enabled(device, kernel) else {"PDL": False}

    patched = []
    real = {"pdl_enabled": pdl.pdl_enabled, "pdl_launch": pdl.pdl_launch}  # before pdl's own are replaced
    for name, module in list(sys.modules.items()):
        if name.startswith("phalanx.kernels.gpu") and module is not None:
            for attr, new in (("pdl_enabled", enabled), ("pdl_launch", launch)):
                old = real[attr]
                if getattr(module, attr, None) is old:
                    patched.append((module, attr, old))
                    setattr(module, attr, new)
    return patched
