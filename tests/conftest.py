"""Fixtures shared by the test modules."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ``--cache-dir`` for every ``onebit train`` run of the session: the data is split once."""
    return tmp_path_factory.mktemp("data-cache")
