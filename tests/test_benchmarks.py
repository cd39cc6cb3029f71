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


def test_step_benchmark_layouts_run_forward():
    """``step.py`` times forward + backward of each layout built of layers, on the meta device
    here (the GPU layouts hold 269M parameters)."""
    import torch

    sys.path.insert(0, str(BENCHMARKS))
    try:
        import step
    finally:
        sys.path.remove(str(BENCHMARKS))
    meta = torch.device("meta")
    for kind in step.LAYOUTS:
        with meta:
            model = step._model(kind, meta)
        if isinstance(model, torch.nn.Sequential):
            assert model(torch.empty(2, model[0].in_features, device=meta)).shape[0] == 2, kind


def test_gpu_check_reports_a_failed_part_and_writes_its_summary(tmp_path):
    """Each part runs in its own process: one that fails (here, without a GPU, the versions
    part) is reported in the summary, not raised."""
    import torch

    summary = tmp_path / "summary.md"
    done = subprocess.run(
        [sys.executable, "gpu_check.py", "--only", "versions", "--out", str(summary)],
        cwd=BENCHMARKS, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    status = "ok" if torch.cuda.is_available() else "failed (exit 1)"
    assert f"| versions | {status} |" in summary.read_text()
    refused = subprocess.run([sys.executable, "gpu_check.py", "--only", "nope"], cwd=BENCHMARKS,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert refused.returncode == 2 and "unknown part(s) nope" in refused.stderr
