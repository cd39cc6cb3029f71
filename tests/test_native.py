"""The C kernels are built when onebit is installed, found beside the package, and in use.

Nothing is compiled at run time: a machine whose install had a C compiler gets the fast path on
the first call, and one without it gets the numpy kernels (same bits) with the reason stated.
"""

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import onebit
from onebit import _native, compress

ROOT = Path(__file__).resolve().parents[1]


def _avx2_fma() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


FAST_PATH_EXPECTED = (
    platform.machine().lower() in ("x86_64", "amd64")
    and _avx2_fma()
    and any(shutil.which(cc) for cc in ("cc", "gcc", "clang"))
)


def _fresh_load(monkeypatch) -> None:
    monkeypatch.setattr(_native, "_tried", False)
    monkeypatch.setattr(_native, "_lib", None)
    monkeypatch.setattr(_native, "unavailable", None)


@pytest.mark.skipif(not FAST_PATH_EXPECTED, reason="needs x86-64 with AVX2/FMA and a C compiler")
def test_the_installed_kernels_are_active():
    path = _native.library_path()
    assert path is not None, "the install did not build onebit._kernels"
    assert path.parent == Path(onebit.__file__).parent
    assert _native.load() is not None, _native.unavailable
    assert compress.cpu_kernels() == "c"


def test_without_the_kernels_numpy_runs_and_says_why(monkeypatch):
    _fresh_load(monkeypatch)
    monkeypatch.setenv("ONEBIT_NATIVE", "0")
    assert _native.load() is None and "ONEBIT_NATIVE" in _native.unavailable
    assert compress.cpu_kernels() == "numpy"
    _fresh_load(monkeypatch)
    monkeypatch.delenv("ONEBIT_NATIVE")
    monkeypatch.setattr(_native, "library_path", lambda: None)
    assert _native.load() is None and "without its C kernels" in _native.unavailable


def test_nothing_is_compiled_or_cached_at_run_time():
    source = Path(_native.__file__).read_text()
    for word in ("subprocess", "tempfile", "ONEBIT_CACHE", "gettempdir"):
        assert word not in source


@pytest.mark.slow
@pytest.mark.skipif(not FAST_PATH_EXPECTED, reason="needs x86-64 with AVX2/FMA and a C compiler")
def test_a_fresh_install_gets_the_fast_path_on_first_call(tmp_path):
    """``pip install`` into a clean venv builds the kernels; the first call only loads them, even
    with no compiler on PATH."""
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, project / name)
    shutil.copytree(ROOT / "src", project / "src", ignore=shutil.ignore_patterns("*.so", "__py*"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = str(venv / "bin" / "python")
    # The venv sees this interpreter's packages (torch, and pip, as it has none of its own)
    # after its own: --system-site-packages would give the base interpreter's, which inside a
    # venv have no torch.
    inner = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    outer = [p for p in sys.path if p.endswith("site-packages")]
    (Path(inner) / "outer.pth").write_text("\n".join(outer) + "\n")
    install = [python, "-m", "pip", "install", "-q", "--no-deps"]  # build isolation, as a user
    subprocess.run([*install, str(project)], check=True, timeout=600)
    check = (
        "import onebit, onebit._native as n, onebit.compress as c; "
        "assert n.load() is not None, n.unavailable; assert c.cpu_kernels() == 'c'; "
        "print(n.library_path())"
    )
    env = {**os.environ, "PATH": str(venv / "bin"), "CC": "/nonexistent"}
    out = subprocess.run(
        [python, "-c", check], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).is_relative_to(venv)
