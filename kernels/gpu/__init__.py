"""Triton kernels of `kernels`' interfaces for the GPU (`attention`, `moe`, `moe_decode`,
`linear`, `norm`, `rope`, `route`), their launch helpers (`compiled_launch`,
`arrivals`), and the device side of the peer exchange (`exchange`, `ipc_peers`,
`nvshmem_peers`). Each is checked against the torch reference in `kernels/`."""
