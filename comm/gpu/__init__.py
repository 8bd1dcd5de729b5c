"""The device side of `comm`: the peer exchange's Triton kernels (`exchange`) and the
GPU symmetric-memory backends (`nvshmem_peers`, `ipc_peers`)."""
