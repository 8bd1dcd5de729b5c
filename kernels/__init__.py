"""Numeric hot spots behind one small interface each, with a torch reference (CPU, the
oracle) and Triton versions for the GPU (`gpu/`): `attention`, `moe`, `linear`, `norm`,
`rope`, `activation`; `backend` picks the implementation.

Leaves: depends on torch and triton only. How ranks talk lives in `comm/`.
"""
