"""Triton kernels of `kernels`' interfaces for the GPU (`attention`, `moe`, `moe_decode`,
`linear`, `norm`, `rope`, `route`) and their launch helpers (`compiled_launch`,
`arrivals`). Each is checked against the torch reference in `kernels/`."""
