"""The variants that the inner loop, ``pytest -m "not slow"``, leaves to the whole suite: more
ranks, or more layouts, of a test whose smallest variant the inner loop runs; and, under Triton's
interpreter, the sizes past numpy's chunk, which the other backends' inner runs still take."""

from typing import Any

import pytest


def slow(*values: Any) -> Any:
    """A ``pytest.mark.parametrize`` case marked ``slow``."""
    return pytest.param(*values, marks=pytest.mark.slow)


def slow_on_triton(*values: Any) -> Any:
    """A ``pytest.mark.parametrize`` case marked ``slow`` where the test's ``backend`` is Triton
    (``conftest.py`` adds the mark): a size past numpy's chunk, which the compiled backends need
    in the inner loop and Triton does not, whose 1,024-element blocks smaller sizes already cross,
    and whose interpreter takes seconds over it."""
    return pytest.param(*values, marks=pytest.mark.slow_on_triton)
