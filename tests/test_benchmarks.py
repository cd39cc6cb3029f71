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
    cases = out.split("\n\n")[1:]  # before; after with a collective per bucket; after
    assert len(cases) == 3 and all(c.count("AdamW + DDP is faster") == 2 for c in cases)
    assert "| 8 | 10 |" in out and "| 64 | 100 |" in out

    def step_ms(case: str, row: str) -> float:
        return float(next(line for line in case.splitlines() if line.startswith(row)).split("|")[4])

    # on 64 nodes one collective per phase saves 85 buckets' latency
    assert step_ms(cases[2], "| 64 | 10 |") < step_ms(cases[1], "| 64 | 10 |") - 400


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_every_kernel_variant_of_a_step_fits_an_h100_and_buckets_add_none(monkeypatch):
    """Each Triton kernel variant the steps of ``step.py`` launch, compiled for sm_90 (Triton's
    wheel ships ``ptxas``: no GPU is needed), uses at most 128 registers a thread and spills
    nothing; and a step compiles the same variants at 1 bucket as at many (sizes that vary by
    bucket do not specialize kernels). OnebitAdam's compression step (with a scale per tensor
    or one per bucket) launches the same six kernels at any number of buckets, ZeroOneAdam's
    sync six (its own passes before and after the allreduce, in place of the allreduce's input
    pass and decompression), 1-bit LAMB's the same seven and the int8 warmup the same six; with
    bf16 errors, an ``exp_avg_mask`` or bf16 parameters, the same kernels (their variants)."""
    if "triton" not in kernels.available():
        pytest.skip("Triton cannot run here")
    monkeypatch.setenv(kernels.ENV, "triton")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import registers

    shapes = [(16, 96)] * 3 + [(96,)] * 3 + [(44,)]  # 1 bucket or 3; 64 rows bind the same
    results = registers.record_all((1 << 22, 2056), shapes)
    variants, _ = registers.compile_recorded(results, sys.executable, sass=False)
    over = [v for v in variants.values() if v["registers"] > 128 or v["spill_stores"]]
    assert not over and all(not v["spill_loads"] for v in variants.values()), over
    one, many = (
        {row["step"]: {launch["key"] for launch in row["first"] + row["measured"]}
         for row in r["rows"]}
        for r in results
    )  # fmt: skip
    launches = [{row["step"]: len(row["measured"]) for row in r["rows"]} for r in results]
    at_once = {
        "OnebitAdam compression step": 6,
        "... one scale per bucket": 6,
        "ZeroOneAdam 1-bit sync step": 6,
        "OnebitAdam warmup, int8": 6,
        "... errors in bf16": 6,
        "... exp_avg_mask": 6,
        "... bf16 parameters": 6,
        "ZeroOneAdam, bf16 errors": 6,
        "OnebitLamb compression step": 7,  # and its two passes after the allreduce
        "OnebitLamb, bf16 errors": 7,
    }
    for step, count in at_once.items():
        assert launches[1][step] == launches[0][step] == count, step  # every bucket at once
    assert many == one


def test_profile_step_finds_what_it_builds_on():
    """``profile_step.py`` needs a GPU to measure; here its imports (the step variants and
    their builder, shared with ``step.py`` and ``launches.py``) and arguments must resolve."""
    out = _run("profile_step.py", "--help")
    assert "--bucket-size" in out


def test_blocks_benchmark_names_every_per_element_kernel(monkeypatch):
    """``blocks.py`` needs a GPU to measure; here its arguments must resolve, its per-element
    kernels must all exist (a renamed kernel would silently keep its warps), and its steps must
    be steps of ``step.py``."""
    assert "--configs" in _run("blocks.py", "--help")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import blocks
    import step

    assert blocks.PER_ELEMENT <= set(blocks._kernels())
    assert set(blocks.STEPS.split(";")) <= {name.strip() for name, *_ in step.VARIANTS}


def test_call_path_traces_a_compression_step_across_files():
    out = _run("call_path.py", "--edges", backend=kernels.available()[0])
    assert out.startswith("OnebitAdam, compression step")
    assert "-> optim/adam.py:_Compression.step" in out and " -> " in out


@pytest.mark.slow
def test_torchtitan_benchmark_compares_hsdp_adamw_with_onebit_locally(tmp_path):
    """What ``gpu_check.py``'s ``torchtitan`` part runs, on the CPU: both runs and the table."""
    pytest.importorskip("torchtitan")
    args = ["--local", "--hosts", "1", "--ranks-per-host", "2", "--shards", "1", "--steps", "6"]
    done = subprocess.run([sys.executable, "torchtitan_hsdp.py", *args, "--freeze", "3", "--out",
                           str(tmp_path)], cwd=BENCHMARKS, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    rows = [line for line in out.splitlines() if line.startswith(("| adamw", "| onebit-adam"))]
    assert len(rows) == 2 and "x fewer bytes across replicas" in out
