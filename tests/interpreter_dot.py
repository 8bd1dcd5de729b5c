"""A dot for Triton's interpreter whose every element depends only on its own row of A,
column of B and accumulator, as an MMA's does on a GPU.

The interpreter's ``create_dot`` is one ``np.matmul`` of the tile pair, and on some CPUs
OpenBLAS sums a row's K in another order when the tile has another number of rows (seen on
an AMD EPYC without AVX-512, numpy 2.3-2.4: a row of a 16-row product differs from the same
row alone in most elements). The batch-invariance checks compare a row's bits across tiles
of different shapes, so they would test OpenBLAS rather than the kernels. This dot adds the
K products to the accumulator one k at a time, each product and each add rounded in the
accumulator's dtype: the same order for every element on every machine. FP8 operands are
widened to float16 first (as the interpreter does: exact), bf16 ones (which the interpreter
stores as raw 16-bit patterns) to float32 (exact); integer dots keep ``np.matmul``."""

from __future__ import annotations

import numpy as np


def _widened(handle, tl) -> np.ndarray:
    """The operand's values as a float array (exactly), or its data for other dtypes."""
    dtype, data = handle.dtype, handle.data
    if dtype == tl.bfloat16:
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype.primitive_bitwidth == 8 and dtype.is_floating():
        from triton.runtime.interpreter import _convert_float

        return _convert_float(data, dtype, tl.float16, None).view(np.float16)
    return data


def install() -> None:
    """Replace the interpreter's ``create_dot`` (call before any kernel runs)."""
    import triton.language as tl
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        acc_dtype = d.data.dtype
        a_data, b_data = _widened(a, tl), _widened(b, tl)
        if not np.issubdtype(acc_dtype, np.floating):
            return interpreter.TensorHandle(np.matmul(a_data, b_data, dtype=acc_dtype) + d.data, d.dtype.scalar)
        a_data, b_data = a_data.astype(acc_dtype), b_data.astype(acc_dtype)
        acc = np.array(d.data, dtype=acc_dtype, copy=True)
        for k in range(a_data.shape[-1]):
            acc += a_data[..., :, k:k + 1] * b_data[..., k:k + 1, :]
        return interpreter.TensorHandle(acc, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot
