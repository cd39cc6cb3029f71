"""Error buffers kept in bf16: the kernels compute in fp32 whatever dtype an error is kept in.

A backend's kernels read and write fp32 errors. Where an error is kept in bf16, the dispatching
functions (:mod:`onebit.compress`, :mod:`onebit.kernels.fused`) hand the kernels an fp32 copy of
the call's buffer (:func:`fp32`) and round what they wrote back into it (:func:`written`), except
where the backend's ``error_dtypes`` has bf16: the C kernels' fused momentum passes and server
pass with a scale per piece, and the Triton passes over every bucket at once
(:mod:`onebit.kernels.triton_model`), read and write bf16 where it is. Either way the bits are
those of the fp32 formulation with each written error rounded to nearest, ties to even.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

ERROR_DTYPES = (torch.float32, torch.bfloat16)
"""Dtypes an error buffer may be kept in. The kernels always compute in fp32: they read a bf16
error exactly and round the one they write to nearest (ties to even), so every backend gives
the bits of the fp32 formulation with each written error rounded to bf16. bf16 has fp32's
range, so no error overflows or vanishes for want of exponent; fp16 would."""


def check_error_dtype(dtype: torch.dtype) -> torch.dtype:
    """Return ``dtype`` if error buffers can be kept in it (:data:`ERROR_DTYPES`), else raise
    ``ValueError``."""
    if dtype not in ERROR_DTYPES:
        names = ", ".join(str(d) for d in ERROR_DTYPES)
        raise ValueError(f"error_dtype must be one of {names}, got {dtype!r}")
    return dtype


def fp32(error: Tensor | None, read: Sequence[torch.dtype] = (torch.float32,)) -> Tensor | None:
    """``error`` as the kernels read it: itself if of a dtype they ``read`` (or ``None``), else
    an fp32 copy."""
    return error if error is None or error.dtype in read else error.float()


@contextmanager
def written(error: Tensor, read: Sequence[torch.dtype] = (torch.float32,)) -> Iterator[Tensor]:
    """``error`` as the kernels update it: itself if of a dtype they ``read`` and write, else an
    fp32 copy, rounded back into ``error`` when the block ends without raising (a bucket's
    worth of fp32 for the call)."""
    staged = fp32(error, read)
    yield staged
    if staged is not error:
        error.copy_(staged)
