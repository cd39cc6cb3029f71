"""Optional fused CPU kernels in C (AVX2), built with the package and loaded with ctypes.

Why: the compressor's five steps (add the error, scale, signs, packing, error update) are each a
trivial pass, and numpy or torch run them as separate passes that each cost about as much as
the whole fused loop. Fused, they run at memory speed (``benchmarks/kernels.py``).

How: ``setup.py`` compiles ``_kernels.c`` at install time into the optional extension
``onebit._kernels`` (a shared library beside this file; nothing is compiled or cached at run
time, so nothing is ever loaded from a directory other than the installed package's). Loading it
is the first kernel call's only cost.

When it does not apply: the install had no C compiler or was not on x86-64 (the extension is
optional, so the install still succeeds), a CPU without AVX2, FMA and F16C, or
``ONEBIT_NATIVE=0`` in the environment. :func:`load` then returns ``None``, the reason is in
:data:`unavailable`, and :mod:`onebit.compress` uses its numpy kernels, which give the same
bits.

The kernels reproduce the torch formulation bit for bit: signs are ``x >= 0`` (ordered compare:
NaN is negative, ``-0.0`` positive), the error update is ``y - s`` or ``y - (-1 * s)``, and the
server average adds the ranks' ``±s`` in rank order and then divides. Only the scale's reduction
order differs (fp32 partial sums of 4096 elements, added in fp64).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
from pathlib import Path

unavailable: str | None = None
"""Why the native kernels are not in use (``None`` while they are, or before the first try)."""

_lib: ctypes.CDLL | None = None
_tried = False


def library_path() -> Path | None:
    """The installed ``onebit._kernels`` shared library beside this module, if the install built
    it (``None`` otherwise)."""
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_kernels{suffix}"
        if path.is_file():
            return path
    return None


def load() -> ctypes.CDLL | None:
    """The installed kernels, loaded on the first call; ``None`` if they do not apply."""
    global _lib, _tried, unavailable
    if _tried:
        return _lib
    _tried = True
    try:
        _lib = _load()
    except Exception as err:  # any failure means: use the numpy kernels
        unavailable, _lib = f"{type(err).__name__}: {err}", None
    return _lib


def _load() -> ctypes.CDLL | None:
    global unavailable
    if os.environ.get("ONEBIT_NATIVE", "1") == "0":
        unavailable = "disabled by ONEBIT_NATIVE=0"
        return None
    path = library_path()
    if path is None:
        unavailable = (
            "onebit was installed without its C kernels (no C compiler at install time, or not "
            "x86-64); reinstall with a compiler for the fast path"
        )
        return None
    lib = ctypes.CDLL(str(path))
    if not lib.ob_supported():
        unavailable = "CPU lacks AVX2/FMA/F16C"
        return None
    ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.ob_compress.argtypes = [ptr, ptr, ptr, i64, ctypes.c_int]
    lib.ob_compress.restype = ctypes.c_double
    lib.ob_commit.argtypes = [ptr, f32, ptr, i64]
    lib.ob_commit.restype = None
    lib.ob_decompress.argtypes = [ptr, i64, ptr, i64, i64, ptr, i64]
    lib.ob_decompress.restype = None
    lib.ob_average.argtypes = [ptr, i64, ptr, i64, i64, ptr]
    lib.ob_average.restype = None
    lib.ob_sums.argtypes = [ptr, ptr, i64, ctypes.c_int, ptr]
    lib.ob_sums.restype = None
    lib.ob_commit_segments.argtypes = [ptr, ptr, ptr, i64, ptr]
    lib.ob_commit_segments.restype = None
    lib.ob_average_pieces.argtypes = [ptr, i64, ptr, i64, i64, ptr, i64, ptr]
    lib.ob_average_pieces.restype = None
    lib.ob_decompress_pieces.argtypes = [ptr, i64, ptr, i64, i64, ptr, i64, ptr, i64]
    lib.ob_decompress_pieces.restype = None
    momentum = [ptr, ptr, i64, i64, ptr, ptr]  # dense, packed bits, stride, chunk, scales, masks
    y = [ptr, i64, ptr, f32, ctypes.c_int, *momentum, f32, ptr, ptr]  # ... weight, post, error
    dtypes = [ctypes.c_int, ctypes.c_int]  # the parameters', the error's
    lib.ob_fused_signs.argtypes = [*y, ptr, ctypes.c_int, ptr, i64, *dtypes]
    lib.ob_fused_signs.restype = None
    lib.ob_fused_commit.argtypes = [*y, ptr, ptr, *dtypes, ctypes.c_int]  # ..., the output's
    lib.ob_fused_commit.restype = None
    lib.ob_fused_update.argtypes = [ptr, i64, ptr, *momentum[1:], ptr, ptr, ptr, ctypes.c_int]
    lib.ob_fused_update.restype = None
    served = [ptr, i64, ptr, i64, i64, ptr, i64]  # packed, stride, scales, ncols, k, pieces, count
    lib.ob_serve_store.argtypes = [*served, ptr, ptr, ptr, ctypes.c_int, ptr, ctypes.c_int]
    lib.ob_serve_store.restype = ctypes.c_int
    lib.ob_serve_commit.argtypes = [*served, ptr, ptr]
    lib.ob_serve_commit.restype = ctypes.c_int
    lib.ob_add_signs.argtypes = [ptr, i64, ptr, ptr, i64, ctypes.c_int]
    lib.ob_add_signs.restype = ctypes.c_double
    lib.ob_add_signs_segments.argtypes = [ptr, i64, ptr, ptr, i64, ptr, ctypes.c_int, ptr]
    lib.ob_add_signs_segments.restype = None
    lib.ob_add_commit.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr]
    lib.ob_add_commit.restype = None
    lib.ob_serve_chunk_signs.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, ctypes.c_int, ptr]
    lib.ob_serve_chunk_signs.restype = ctypes.c_int
    lib.ob_solo_commit_signs.argtypes = [ptr, i64, ptr, f32, ptr, ptr, i64, ctypes.c_int]
    lib.ob_solo_commit_signs.restype = ctypes.c_double
    lib.ob_solo_serve_commit.argtypes = [ptr, f32, ptr, f32, ptr, i64, i64]
    lib.ob_solo_serve_commit.restype = None
    return lib
