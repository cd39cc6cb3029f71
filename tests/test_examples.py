"""The examples run as their docstrings say, ``torchrun --nproc-per-node 2 examples/<name>.py``:
each exits 0, prints a final validation loss well below an untrained model's and sends fewer
bytes than an fp32 allreduce every step would."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TIMEOUT = 300  # seconds; each takes about 15 on 2 CPU cores
REPORT = re.compile(
    r"final validation loss (?P<loss>\S+) \| sent .* MB: (?P<ratio>[\d.]+)x fewer bytes "
    r"\((?P<per_step>\d+)x fewer per step after warmup\)"
)


def torchrun(script: Path, *args: str, log: Path, ranks: int = 2) -> str:
    """Run ``torchrun --nproc-per-node RANKS script *args`` with its output in ``log``; return
    the output, or fail on a non-zero exit or a hang."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(ranks), str(script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            process.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            # torchrun runs each worker in a session of its own: SIGTERM makes it stop them.
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            pytest.fail(f"{script.name} ran past {TIMEOUT}s:\n{log.read_text()[-4000:]}")
    output = log.read_text()
    assert process.returncode == 0, f"{script.name} exited {process.returncode}:\n{output[-4000:]}"
    return output


@pytest.mark.parametrize(
    "name, framework",
    [
        ("torchrun_ddp", None),
        ("hf_trainer", "transformers"),
        ("accelerate_loop", "accelerate"),
        ("lightning_module", "lightning"),
    ],
)
def test_example_trains_on_two_ranks_and_sends_fewer_bytes(name, framework, tmp_path):
    pytest.importorskip("transformers")  # every example's model is a GPT-2 from a config
    if framework:
        pytest.importorskip(framework)
    args = ["--out", str(tmp_path)] if name == "hf_trainer" else []
    output = torchrun(EXAMPLES / f"{name}.py", *args, log=tmp_path / "output.txt")
    report = REPORT.search(output)
    assert report, f"no final report in the output of {name}:\n{output[-4000:]}"
    loss = float(report["loss"])
    # Untrained, the loss is ln 256 = 5.5; the 100 default steps bring it to about 2.5.
    assert math.isfinite(loss) and loss < math.log(256) - 1.5, output[-4000:]
    assert float(report["ratio"]) > 1
    assert int(report["per_step"]) >= 20  # one bit per element and a few scales, not 32 bits
    if name == "hf_trainer":
        assert (tmp_path / "checkpoint-100" / "optimizer.pt").is_file()
    # One GPU cannot hold two NCCL ranks: with fewer GPUs than ranks the examples use the CPU.
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert f"optimizer state on {'cuda:0' if gpus >= 2 else 'cpu'}" in output


def _trains_hsdp_on_four_ranks(script: str, out: Path, tmp_path: Path) -> None:
    """Run an FSDP2 hybrid-sharding example on 4 ranks (2 emulated nodes of 2) with ``--out``:
    it learns, and sends 1 bit per element between nodes after the warmup."""
    output = torchrun(EXAMPLES / script, "--out", str(out), log=tmp_path / "output.txt", ranks=4)
    report = REPORT.search(output)
    assert report, output[-4000:]
    loss = float(report["loss"])
    assert math.isfinite(loss) and loss < math.log(256) - 1.5, output[-4000:]
    assert int(report["per_step"]) >= 20


def test_fsdp_example_shards_inside_nodes_and_sends_one_bit_between(tmp_path):
    """``examples/fsdp_hsdp.py`` on 4 ranks, 2 emulated nodes of 2: trains, sends 1 bit per
    element between nodes after the warmup, and checkpoints through torch.distributed.checkpoint."""
    pytest.importorskip("transformers")
    _trains_hsdp_on_four_ranks("fsdp_hsdp.py", tmp_path, tmp_path)
    assert (tmp_path / "step-100" / ".metadata").is_file()


def test_accelerate_hsdp_example_shards_inside_nodes_and_saves_every_rank(tmp_path):
    """``examples/accelerate_hsdp.py`` on 4 ranks, 2 emulated nodes of 2, through Accelerate's
    FSDP2 path: trains, sends 1 bit per element between nodes after the warmup, and
    ``accelerator.save_state`` writes each rank's part of the optimizer."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = tmp_path / "checkpoint"
    _trains_hsdp_on_four_ranks("accelerate_hsdp.py", out, tmp_path)
    assert sorted(p.name for p in (out / "onebit").iterdir()) == [f"rank_{r}.pt" for r in range(4)]


def test_lightning_hsdp_example_shards_inside_nodes_and_saves_every_rank(tmp_path):
    """``examples/lightning_hsdp.py`` on 4 ranks, 2 emulated nodes of 2, with
    ``ModelParallelStrategy``: trains, sends 1 bit per element between nodes after the warmup,
    and ``trainer.save_checkpoint`` writes each rank's part of the optimizer."""
    pytest.importorskip("transformers")
    pytest.importorskip("lightning")
    out = tmp_path / "checkpoint"
    _trains_hsdp_on_four_ranks("lightning_hsdp.py", out, tmp_path)
    assert sorted(p.name for p in (out / "onebit").iterdir()) == [f"rank_{r}.pt" for r in range(4)]


def test_hf_trainer_hsdp_example_shards_inside_nodes_and_checkpoints_every_rank(tmp_path):
    """``examples/hf_trainer_hsdp.py`` on 4 ranks, 2 emulated nodes of 2: trains, sends 1 bit
    per element between nodes after the warmup, and Trainer's checkpoint holds every rank's
    state."""
    pytest.importorskip("transformers")
    _trains_hsdp_on_four_ranks("hf_trainer_hsdp.py", tmp_path, tmp_path)
    assert (tmp_path / "checkpoint-100" / "onebit" / ".metadata").is_file()


ONE_GPU = [
    ("torchrun_ddp", []),
    ("hf_trainer", []),
    ("hf_trainer", ["--bf16"]),
    ("accelerate_loop", []),
    ("accelerate_loop", ["--mixed-precision", "fp16"]),
    ("accelerate_loop", ["--mixed-precision", "bf16"]),
    ("lightning_module", []),
    ("lightning_module", ["--precision", "bf16-mixed"]),
]


@pytest.mark.cuda
@pytest.mark.parametrize("name, args", ONE_GPU)
def test_example_trains_on_one_gpu(name, args, tmp_path):
    """HF Trainer and Accelerate build the optimizer before they move the model to the GPU: the
    optimizer's state must follow it there."""
    pytest.importorskip("transformers")
    if name == "hf_trainer":
        args = [*args, "--out", str(tmp_path)]
    output = torchrun(EXAMPLES / f"{name}.py", *args, log=tmp_path / "output.txt", ranks=1)
    loss = re.search(r"final validation loss (\S+) .* optimizer state on cuda:0", output)
    assert loss, output[-4000:]
    assert float(loss[1]) < math.log(256) - 1.5, output[-4000:]
