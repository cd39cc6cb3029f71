"""Check and measure onebit on one NVIDIA GPU, in one command, and write a markdown summary.

    python benchmarks/gpu_check.py                      # every part, in order
    python benchmarks/gpu_check.py --only step,kernels  # some parts
    python benchmarks/gpu_check.py --out summary.md

Each part runs in its own process under its own time limit, so that one failure or hang does
not stop the rest; the summary gives each part's status, time and the end of its output:

* ``versions``: Python, torch, Triton, CUDA, the GPU and its driver;
* ``cuda-tests``: the tests marked ``cuda`` (Triton on CUDA against the CPU's bits, two ranks
  sharing the GPU over gloo, the optimizers moved to the GPU, ``onebit train`` on CUDA with AMP,
  FSDP2 on NCCL, the DDP, HF Trainer, Accelerate and Lightning examples with mixed precision);
* ``step``: ``benchmarks/step.py --device cuda``, each step timed in turns with
  ``AdamW(fused=True)`` on both GPU layouts, with state and peak memory;
* ``kernels``: ``benchmarks/kernels.py``, the kernels' GB/s against a copy;
* ``launches``: ``benchmarks/launches.py --device cuda``, per step the CUDA kernels, the host
  synchronisations, and the Triton variants its first step (with the rehearsal that compiles
  the stage's kernels ahead) and its second compile, with their time;
* ``frameworks``: the FSDP2 hybrid-sharding examples of Lightning, HF Trainer and (with two
  GPUs or more) Accelerate, through each framework's CUDA code path, a rank per GPU (one GPU
  holds one NCCL rank), each saving a checkpoint;
* ``train``: ``onebit train --device cuda`` for 60 steps;
* ``torchtitan``: torchtitan's own trainer on its debug Llama, HSDP + AdamW against
  ``OnebitTrainer`` with 1-bit Adam, 2 replicas sharing the GPU over gloo
  (``benchmarks/torchtitan_hsdp.py --local --device cuda``); where torchtitan is not installed
  (``pip install -e ".[torchtitan]"``, Python 3.11+), it says so and is skipped.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
VERSIONS = (
    "import platform, torch, triton; p = torch.cuda.get_device_properties(0); "
    "print('python', platform.python_version(), '| torch', torch.__version__, '| triton', "
    "triton.__version__, '| CUDA', torch.version.cuda, '|', p.name, p.total_memory // 2**20, "
    "'MiB,', p.multi_processor_count, 'SMs')"
)


def _examples(out: Path) -> list[list[str]]:
    """The FSDP2 examples on every GPU here (up to 4), one rank each, all shards of one node.
    Accelerate builds no mesh for a single rank, so its example needs two GPUs."""
    import torch

    ranks = max(1, min(torch.cuda.device_count(), 4))
    run = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    short = ["--shard", str(ranks), "--steps", "40", "--freeze-step", "10"]
    names = ["lightning_hsdp", "hf_trainer_hsdp"] + (["accelerate_hsdp"] if ranks > 1 else [])
    return [[*run, f"examples/{name}.py", *short, "--out", str(out / name)] for name in names]


def _parallel() -> list[str]:
    """pytest-xdist's workers, where it is installed: the ``cuda`` tests share the one GPU, and
    one after the other they take longer than the whole check's six minutes."""
    try:
        import xdist  # noqa: F401
    except ImportError:
        return []
    return ["-n", str(max(1, min(8, (os.cpu_count() or 1) // 2)))]


def parts(scratch: Path) -> dict[str, tuple[float, list[list[str]]]]:
    """Each part: its time limit in seconds and the commands it runs, in order."""
    return {
        "versions": (60, [[PY, "-c", VERSIONS], ["nvidia-smi", "-L"]]),
        "cuda-tests": (
            300,
            [[PY, "-m", "pytest", "-q", "-m", "cuda", *_parallel(), "-rfE", "tests"]],
        ),
        "step": (180, [[PY, "benchmarks/step.py", "--device", "cuda", "--repeats", "30"]]),
        "kernels": (
            60,
            [
                [
                    PY,
                    "benchmarks/kernels.py",
                    "--device",
                    "cuda",
                    "--sizes",
                    "16M,64M,256M",
                    "--paths",
                    "auto,torch",
                ]
            ],
        ),  # fmt: skip
        "launches": (120, [[PY, "benchmarks/launches.py", "--device", "cuda"]]),
        "frameworks": (180, _examples(scratch)),
        "train": (
            120,
            [
                [
                    PY,
                    "-m",
                    "onebit.train",
                    "--device",
                    "cuda",
                    "--steps",
                    "60",
                    "--no-progress",
                    "--out",
                    str(scratch / "train"),
                    "--cache-dir",
                    str(scratch / "data"),
                ]
            ],
        ),  # fmt: skip
    }


def run(commands: list[list[str]], limit: float) -> tuple[str, float, str]:
    """Run ``commands`` one after the other within ``limit`` seconds in all: the status
    (``ok``, ``failed (exit N)`` or ``timed out``), the seconds taken and the output."""
    start, output = time.monotonic(), []
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    for command in commands:
        left = limit - (time.monotonic() - start)
        output.append(f"$ {' '.join(command)}")
        try:
            done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=max(left, 1))  # fmt: skip
        except subprocess.TimeoutExpired as stopped:
            output.append(_text(stopped.stdout) + _text(stopped.stderr))
            return "timed out", time.monotonic() - start, "\n".join(output)
        except OSError as err:
            output.append(str(err))
            return "failed (cannot run)", time.monotonic() - start, "\n".join(output)
        output.append(done.stdout + done.stderr)
        if done.returncode:
            return f"failed (exit {done.returncode})", time.monotonic() - start, "\n".join(output)
    return "ok", time.monotonic() - start, "\n".join(output)


def _text(stream: bytes | str | None) -> str:
    return stream.decode(errors="replace") if isinstance(stream, bytes) else stream or ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated parts (default: all)")
    parser.add_argument("--out", default="gpu_check.md", help="the markdown summary")
    parser.add_argument("--lines", type=int, default=40, help="output lines kept per part")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        every = parts(Path(scratch))
        chosen = args.only.split(",") if args.only else list(every)
        unknown = sorted(set(chosen) - set(every))
        if unknown:
            parser.error(f"unknown part(s) {', '.join(unknown)}; the parts: {', '.join(every)}")
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        summary = [f"# onebit GPU check, {when}", "", "| part | status | seconds |"]
        summary.append("|---|---|---|")
        details = []
        for name in chosen:
            limit, commands = every[name]
            print(f"== {name} (limit {limit:.0f} s)", flush=True)
            status, seconds, output = run(commands, limit)
            tail = "\n".join(output.strip().splitlines()[-args.lines :])
            print(f"{tail}\n-- {name}: {status}, {seconds:.0f} s", flush=True)
            summary.append(f"| {name} | {status} | {seconds:.0f} |")
            details += ["", f"## {name}: {status}, {seconds:.0f} s", "", "```", tail, "```"]
    Path(args.out).write_text("\n".join(summary + details) + "\n")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
