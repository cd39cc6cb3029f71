"""Run a test on each kernel backend, chosen as a user would: through ``ONEBIT_BACKEND``."""

from __future__ import annotations

import os

import pytest

from onebit import kernels

BACKENDS = ["c", "numpy", "triton", "torch"]
"""Every backend that runs on the CPU (Triton under ``TRITON_INTERPRET=1``, which ``conftest.py``
sets where there is no GPU); ``"torch"`` is the reference the others must match."""


def use_backend(name: str, monkeypatch: pytest.MonkeyPatch | None = None) -> None:
    """Make every kernel call take backend ``name`` (for good in a rank's own process, where
    there is no ``monkeypatch``); skip the test where it cannot run here."""
    if name != "auto" and name not in kernels.available():
        pytest.skip(f"the {name} backend cannot run here")
    if monkeypatch is None:
        os.environ[kernels.ENV] = name
    else:
        monkeypatch.setenv(kernels.ENV, name)
