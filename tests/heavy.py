"""The variants that the inner loop, ``pytest -m "not slow"``, leaves to the whole suite: more
ranks, or more layouts, of a test whose smallest variant the inner loop runs."""

from typing import Any

import pytest


def slow(*values: Any) -> Any:
    """A ``pytest.mark.parametrize`` case marked ``slow``."""
    return pytest.param(*values, marks=pytest.mark.slow)
