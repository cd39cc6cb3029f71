"""The examples run as their docstrings say, ``torchrun --nproc-per-node 2 examples/<name>.py``:
each exits 0, prints a final validation loss well below an untrained model's and sends fewer
bytes than an fp32 allreduce every step would.

``torchrun_ddp.py`` and the GPU runs go through ``torchrun`` itself. The others run in ranks that
:func:`distributed.run_script` forks from a server that imported torch and the frameworks, with
the environment, arguments and ``sys.path`` torchrun gives them: a torchrun rank spends about 5 s
of CPU importing them before its first step.
"""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import run_script

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


def forked(script: Path, *args: str, log: Path, ranks: int = 2) -> str:
    """:func:`torchrun`'s run of ``script``, with its ranks forked by :func:`run_script`."""
    try:
        ran = run_script(script, *args, ranks=ranks, timeout=TIMEOUT)
    except TimeoutError as hung:
        pytest.fail(str(hung))
    output = "".join(out for _, out in ran)
    log.write_text(output)
    code = max((code for code, _ in ran if code), default=0)  # an error's 1 over a kill's -9
    assert code == 0, f"{script.name} exited {code}:\n{output[-4000:]}"
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
    launch = torchrun if name == "torchrun_ddp" else forked
    output = launch(EXAMPLES / f"{name}.py", *args, log=tmp_path / "output.txt")
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
    output = forked(EXAMPLES / script, "--out", str(out), log=tmp_path / "output.txt", ranks=4)
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


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "ckpt.pt", weights_only=True)["model"]


def _same_weights(a: Path, b: Path) -> bool:
    want, got = _weights(a), _weights(b)
    return want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_ddp_gpt_trains_in_both_modes_and_its_onebit_path_is_exact(tmp_path):
    """``examples/ddp_gpt.py``, the porting guide's script, on 2 gloo ranks: both paths train
    (AdamW's unclipped, onebit's with its default clipping); with an fp32 warmup (and no
    clipping, whose norm sums in the optimizer's order of the parameters) onebit is AdamW + DDP
    bit for bit; its default run, resumed from the rank-0 checkpoint it also saved before the
    freeze, is the straight run bit for bit."""
    script, short = EXAMPLES / "ddp_gpt.py", ["--max-iters", "40"]

    def run(name: str, *args: str) -> str:
        out = ["--out", str(tmp_path / name)]
        return forked(script, *short, *out, *args, log=tmp_path / f"{name}.txt")

    unclipped = ["--grad-clip", "0"]
    onebit = ["onebit", "--save-at", "5"]
    for name, args in (("adamw-unclipped", ["adamw", *unclipped]), ("onebit", onebit)):
        output = run(name, "--optimizer", *args)
        loss = float(re.search(r"final val loss (\S+)", output)[1])
        assert loss < math.log(256) - 2, output[-4000:]
    assert "x fewer bytes than an fp32 allreduce | froze at step 8" in output  # total_steps
    run("fp32", "--optimizer", "onebit", "--warmup-compression", "fp32", "--freeze-step", "99",
        *unclipped)  # fmt: skip
    assert _same_weights(tmp_path / "adamw-unclipped", tmp_path / "fp32")
    run("resumed", "--optimizer", "onebit", "--resume", str(tmp_path / "onebit" / "ckpt-5.pt"))
    assert _same_weights(tmp_path / "onebit", tmp_path / "resumed")


def test_ddp_gpts_naive_port_stops_with_errors_that_name_the_fix(tmp_path):
    """The AdamW path with only the optimizer swapped (``clip_grad_norm_`` before ``step()``, and
    rank 0's ``state_dict()`` loaded everywhere) stops on every rank at the first step, and at
    ``load_state_dict``: each error names what to do instead."""
    source = (EXAMPLES / "ddp_gpt.py").read_text()
    naive = {
        "clip": ("if grad_clip != 0.0 and not ONEBIT:", "if grad_clip != 0.0:"),
        "save": ("optimizer.consolidated_state_dict() if ONEBIT else ", ""),
    }
    for name, (before, after) in naive.items():
        assert before in source, f"the porting guide's {name} line changed"
        script = tmp_path / f"naive_{name}.py"
        script.write_text(source.replace(before, after))
        args = ["--optimizer", "onebit", "--max-iters", "10", "--out", str(tmp_path / name)]
        if name == "save":
            forked(script, *args, log=tmp_path / "saved.txt")
            args += ["--resume", str(tmp_path / name / "ckpt.pt")]
        with pytest.raises(AssertionError, match="exited 1"):
            forked(script, *args, log=tmp_path / f"{name}.txt")
        output = (tmp_path / f"{name}.txt").read_text()
        if name == "clip":
            wanted = "ranks 0, 1 have gradients changed between backward and step()"
            assert "clip with the optimizer's max_grad_norm" in output
        else:
            wanted = "rank 1: the state holds rank(s) [0], this is rank 1"
            assert "save consolidated_state_dict()" in output
        assert output.count(wanted) >= 2, output[-4000:]  # raised on both ranks
