"""Triton's interpreter, made cheaper for the CPU (:mod:`onebit.kernels.triton_interpreter`),
computes what it computed before: the kernels' bitwise tests check the ops; here, the dtype
table the cache stands in for."""

import numpy as np
import pytest

triton = pytest.importorskip("triton")


def test_cached_numpy_dtypes_are_the_interpreters():
    import triton.language as tl
    from triton.runtime import interpreter

    from onebit.kernels.triton_interpreter import cache_numpy_dtypes

    cache_numpy_dtypes()
    lookup = interpreter._get_np_dtype
    cache_numpy_dtypes()  # idempotent
    assert lookup.cached and interpreter._get_np_dtype is lookup
    expected = {tl.float32: np.float32, tl.bfloat16: np.uint16, tl.float16: np.float16,
                tl.int1: np.bool_, tl.uint8: np.uint8, tl.int64: np.int64}  # fmt: skip
    for _ in range(2):  # filling the table, then reading it
        for tt_dtype, want in expected.items():
            assert lookup(tt_dtype) == want
            assert lookup(tl.block_type(tt_dtype, [4])) == want
    pointer = tl.pointer_type(tl.float32)
    assert lookup(pointer) == lookup(tl.block_type(pointer, [4])) == np.uint64
