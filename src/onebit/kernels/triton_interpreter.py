"""Triton's interpreter (``TRITON_INTERPRET=1``, the kernels on CPU tensors in numpy) without the
largest part of its overhead, for the machines without a GPU that test the kernels.

Before a launch, the interpreter patches the builtins of the ``triton.language`` modules that
the kernel sees into interpreted ones, and restores them after. It patches them again at every
call of a ``@triton.jit`` helper inside the kernel (``tl.sum`` among them), although they are
patched already: a walk over the whole language that took about a third of an interpreted
optimizer step. :func:`skip_repatching` patches both language modules once per launch, and
makes the helpers' calls patch nothing. What each op computes is unchanged: every builtin it
calls is the interpreted one either way. :func:`cache_numpy_dtypes` stops the interpreter from
rebuilding its table of dtypes for every value an op makes.
"""

from __future__ import annotations

import types
from typing import Any


def skip_repatching() -> None:
    """Patch ``triton.language`` once per interpreted launch, not at each call of a helper
    inside it (idempotent). Where this Triton's interpreter has no ``_patch_lang`` returning
    a ``_LangPatchScope``, nothing changes."""
    import triton.language as tl
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if patch is None or scope_type is None or getattr(patch, "once_per_launch", False):
        return
    # what the interpreter reads of a kernel to patch the language: its globals
    every_language = types.FunctionType((lambda: None).__code__, {"tl": tl, "core": tl.core})
    launching = [False]

    def patch_once(fn: Any) -> Any:
        if launching[0]:
            return scope_type()  # a helper's call inside the launch: patched already
        scope = patch(every_language)
        launching[0] = True
        restore = scope.restore

        def restore_and_end() -> None:
            launching[0] = False
            restore()

        scope.restore = restore_and_end
        return scope

    patch_once.once_per_launch = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_once


def cache_numpy_dtypes() -> None:
    """Look up the numpy dtype of a Triton dtype in a table built once (idempotent).

    The interpreter's ``_get_np_dtype``, called for every value an op makes, builds a table of
    every Triton dtype (19 hashes) at each call. A block's numpy dtype is its element's (the
    interpreter holds a block as an array of its elements), so the cache holds the plain dtypes;
    pointers (unhashable) take the interpreter's own function. Where this Triton's interpreter
    has no ``_get_np_dtype``, nothing changes."""
    import triton.language as tl
    from triton.runtime import interpreter

    lookup = getattr(interpreter, "_get_np_dtype", None)
    if lookup is None or getattr(lookup, "cached", False):
        return
    table: dict[Any, Any] = {}

    def cached(tt_dtype: Any) -> Any:
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if type(element) is not tl.dtype:
            return lookup(tt_dtype)
        found = table.get(element)
        if found is None:
            found = table[element] = lookup(tt_dtype)
        return found

    cached.cached = True  # type: ignore[attr-defined]
    interpreter._get_np_dtype = cached
