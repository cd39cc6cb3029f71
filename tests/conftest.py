"""Fixtures shared by the test modules."""

import os
from pathlib import Path

import pytest
import torch
from backends import BACKENDS, use_backend

if not torch.cuda.is_available():  # the Triton kernels run on CPU tensors, in numpy
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``slow`` the tests marked ``slow_on_triton`` whose ``backend`` is Triton; skip the
    tests marked ``cuda`` where there is no GPU."""
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        callspec = getattr(item, "callspec", None)
        on_triton = callspec is not None and callspec.params.get("backend") == "triton"
        if on_triton and "slow_on_triton" in item.keywords:
            item.add_marker(pytest.mark.slow)
        if skip and "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ``--cache-dir`` for every ``onebit train`` run of the session: the data is split once."""
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each kernel backend that runs here in turn, chosen through ``ONEBIT_BACKEND``."""
    use_backend(request.param, monkeypatch)
    return request.param
