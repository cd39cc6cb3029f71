"""The GPU benchmarks run, on tiny sizes, with the Triton kernels under ``TRITON_INTERPRET=1``:
what a GPU session will run first must not fail on its first line (the figures mean nothing
here)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from onebit import kernels

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(*args: str, backend: str = "triton") -> str:
    if backend not in kernels.available():
        pytest.skip(f"the {backend} backend cannot run here")
    env = {**os.environ, kernels.ENV: backend}
    done = subprocess.run([sys.executable, *args], cwd=BENCHMARKS, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_step_benchmark_runs_every_step_on_triton():
    out = _run("step.py", "--models", "gpt-tiny", "--repeats", "1")
    assert "kernels: triton" in out
    for row in ("AdamW(fused=True) step", "OnebitAdam compression step",
                "OnebitAdam warmup, int8", "ZeroOneAdam 1-bit sync step",
                "OnebitLamb compression step"):  # fmt: skip
        assert f"gpt-tiny | {row}" in out, row


def test_kernels_benchmark_prints_each_kernel_against_the_copy():
    out = _run("kernels.py", "--sizes", "4K", "--reps", "1", "--paths", "triton,torch",
               "--device", "cpu")  # fmt: skip
    lines = [line for line in out.splitlines() if "GB/s" in line and "x" in line]
    assert any("triton" in line for line in lines) and any("torch" in line for line in lines)


def test_gpu_model_finds_where_onebit_stops_paying_off():
    out = _run("gpu_model.py", backend="torch")
    assert out.count("AdamW + DDP is faster above") == 4
    assert "| 8 | 10 |" in out and "| 64 | 100 |" in out
