"""Triton kernels of `kernels`' interfaces for the GPU (`attention`, `moe`, `moe_decode`,
`linear`, `gemv`, `qkv_rope`, `norm`, `rope`, `route`, the FP8 ones) and their launch
helpers (`compiled_launch`, `arrivals`, `pdl`). Each is checked against the torch
reference in `kernels/`."""
