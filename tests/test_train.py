"""``onebit train`` end to end: files, exact resume, bad input, data and models."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_cli import TINY, clean_env, onebit_train, read_metrics, without_timing

import onebit
from onebit.train import arguments, cli, optim
from onebit.train.data import prepare, source_files, stdlib_path, windows
from onebit.train.model import MASK_TOKEN, ModelConfig, Transformer, build_model

COMPARE = list(optim.OPTIMIZERS)
WARMUP_FP32 = "onebit-adam:warmup=fp32:freeze=5"  # its row: onebit-adam-warmup-fp32-freeze-5


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> Path:
    """A tiny ``--compare`` run of every optimizer, with checkpoints at steps 5 and 6."""
    out = tmp_path_factory.mktemp("compare")
    result = onebit_train(
        "--compare", ",".join([*COMPARE, "onebit-adam:no-ef", WARMUP_FP32]), *TINY,
        "--save-every", "5",
        "--local-step-scaler", "1",
        "--out", out, "--cache-dir", data_cache,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (out / "stdout.txt").write_text(result.stdout)
    return out


RESUMED = ["adamw", "onebit-adam", "zero-one-adam", "onebit-adam-warmup-fp32-freeze-5"]


@pytest.fixture(scope="module")
def resumed(compared: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each of RESUMED resumed from its step-5 checkpoint into a new folder, all at once."""
    outs = {label: tmp_path_factory.mktemp(f"resumed-{label}") for label in RESUMED}
    processes = {
        label: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "onebit.train",
                "--no-progress",
                "--out",
                str(out),
                "--resume",
                str(compared / label / "checkpoints" / "step_000005"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
        )  # fmt: skip
        for label, out in outs.items()
    }
    for label, process in processes.items():
        _, err = process.communicate(timeout=600)
        assert process.returncode == 0, f"{label}: {err}"
    return outs


@pytest.mark.slow  # onebit train runs
def test_zero_one_adam_checkpoint_holds_diverged_replicas(compared: Path) -> None:
    checkpoint = compared / "zero-one-adam" / "checkpoints" / "step_000005"
    models = [torch.load(checkpoint / f"rank{r}.pt")["model"] for r in range(2)]
    assert not torch.equal(models[0]["wte.weight"], models[1]["wte.weight"]), (
        "step 5 is a local step: the replicas differ, so resuming must restore each one"
    )


@pytest.mark.slow  # onebit train runs
def test_a_run_says_which_kernels_its_optimizer_runs(compared: Path) -> None:
    printed = (compared / "stdout.txt").read_text()
    cpu = onebit.kernels.for_device(torch.device("cpu")).name
    for label in COMPARE:
        backend = json.loads((compared / label / "summary.json").read_text())["kernels"]
        if label == "adamw":  # torch's own
            assert backend is None
        else:
            assert backend == cpu, label
            assert f"{label}: Onebit" in printed or f"{label}: ZeroOne" in printed, label
    assert f"on cpu, {cpu} kernels" in printed


@pytest.mark.slow  # onebit train runs
def test_a_run_counts_its_rounds(compared: Path) -> None:
    """Each run's summary, log line and ``--compare`` table give the collectives its steps
    waited on: DDP's one per bucket, a 1-bit exchange's two, none for 0/1 Adam's local steps."""
    summaries = {
        label: json.loads((compared / label / "summary.json").read_text())
        for label in ("adamw", "onebit-adam", "zero-one-adam")
    }
    steps = summaries["adamw"]["steps"]
    assert summaries["adamw"]["rounds"] >= steps  # one all_reduce a bucket, every step
    assert summaries["onebit-adam"]["rounds"] >= 2 * steps
    zero_one = summaries["zero-one-adam"]
    assert zero_one["rounds_by_stage"].get("local", 0) == 0
    assert zero_one["rounds"] == sum(zero_one["rounds_by_stage"].values())
    assert zero_one["rounds"] < summaries["onebit-adam"]["rounds"]
    printed = (compared / "stdout.txt").read_text()
    assert f"in {zero_one['rounds']:,} rounds" in printed
    table = (compared / "comparison.md").read_text()
    assert "| rounds |" in table and f"| {zero_one['rounds']:,} |" in table


@pytest.mark.slow  # onebit train runs
def test_a_compare_row_takes_its_own_settings(compared: Path) -> None:
    row = compared / "onebit-adam-warmup-fp32-freeze-5"
    summary = json.loads((row / "summary.json").read_text())
    assert summary["warmup_compression"] == "fp32" and summary["freeze_step"] == 5
    default = json.loads((compared / "onebit-adam" / "summary.json").read_text())
    assert default["warmup_compression"] == "int4" and default["freeze_step"] == 2
    int4, fp32 = read_metrics(compared / "onebit-adam")[0], read_metrics(row)[0]
    assert int4["comm/stage"] == fp32["comm/stage"] == "warmup"
    assert 6 * int4["comm/bytes"] < fp32["comm/bytes"]  # 8x fewer, less scales and headers


def test_defaults_compress_the_warmup_and_freeze_by_the_variance(tmp_path: Path) -> None:
    """Without --freeze-step and --warmup-compression, 1-bit Adam and 1-bit LAMB warm up with
    int4 and freeze by ``"auto"``; 0/1 Adam's variance steps are int4 and its phase A is the
    library's default for the run; the uncompressed ones stay fp32."""
    (tmp_path / "text.txt").write_text("some text to train on. " * 4000)
    args = cli.build_parser().parse_args(
        ["--compare", ",".join(COMPARE), "--data", str(tmp_path / "text.txt"),
         "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "out")]
    )  # fmt: skip
    plan = cli.resolve(args, torchrun=False, warn=print)
    settings = {c.optimizer: (c.warmup_compression, c.freeze_step) for c in plan.configs}
    assert settings == {
        "adamw": ("fp32", None),
        "onebit-adam": ("int4", "auto"),
        "zero-one-adam": ("int4", "auto"),
        "lamb": ("fp32", None),
        "onebit-lamb": ("int4", "auto"),
    }
    assert [c.label for c in plan.configs] == COMPARE  # the defaults need no suffix
    (row,) = arguments.parse_compare("zero-one-adam:varscale=64:local=9:clipper=8")
    assert (row.var_update_scaler, row.local_step_scaler, row.local_step_clipper) == (64, 9, 8)
    assert row.label(True, "fp32") == "zero-one-adam-warmup-fp32-local-9-varscale-64-clipper-8"
    (row,) = arguments.parse_compare("onebit-adam:errors=bf16")
    assert row.errors == "bf16" and row.label(True, "int4", "bf16") == "onebit-adam-errors-bf16"


@pytest.mark.slow  # onebit train runs
@pytest.mark.parametrize("label", RESUMED)
def test_resume_continues_exactly(compared: Path, resumed: dict[str, Path], label: str) -> None:
    straight, tmp_path = compared / label, resumed[label]
    assert without_timing(read_metrics(tmp_path)) == without_timing(read_metrics(straight))
    resumed = torch.load(tmp_path / "model.pt")
    final = torch.load(straight / "model.pt")
    assert resumed.keys() == final.keys()
    for name, tensor in final.items():
        assert torch.equal(resumed[name], tensor), name


@pytest.mark.slow  # onebit train runs
def test_resume_refuses_changed_options(compared: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--resume", str(compared / "adamw"), "--lr", "0.1"])
    assert exit_info.value.code == 2
    assert "--lr cannot be changed" in capsys.readouterr().err


def test_bad_input_from_the_command_line() -> None:
    result = onebit_train("--workers", "0")
    assert result.returncode == 2
    assert result.stderr == "python -m onebit.train: error: argument --workers: must be at " \
        "least 1, got 0\n"  # fmt: skip


def test_library_imports_without_train_extras() -> None:
    code = "import sys; sys.modules['tqdm'] = sys.modules['matplotlib'] = None; import onebit"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_default_data_is_the_standard_library(tmp_path: Path) -> None:
    files = source_files(stdlib_path())
    names = {f.relative_to(stdlib_path()).as_posix() for f in files}
    assert {"os.py", "json/__init__.py"} <= names
    assert not any(n.startswith("test/") or "site-packages" in n for n in names)
    first = prepare(None, tmp_path / "a")
    again = prepare(None, tmp_path / "b")
    assert first.digest == again.digest
    assert torch.equal(first.val, again.val)
    assert len(first.train) > 1_000_000
    assert 0.08 < len(first.val) / (len(first.train) + len(first.val)) < 0.12


def test_data_from_a_folder(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("alpha " * 1000)
    (tmp_path / "src" / "b.md").write_text("beta " * 1000)
    (tmp_path / "src" / "blob.bin").write_bytes(b"\0\1\2" * 100)
    assert [f.name for f in source_files(tmp_path / "src")] == ["a.txt", "b.md"]
    data = prepare(tmp_path / "src", tmp_path / "cache")
    assert len(data.train) + len(data.val) == 6000 + 5000 + 1
    assert set(bytes(data.val.tolist())) <= set(b"alphbet \n")


def test_bert_masks_and_gpt_shifts() -> None:
    data = torch.arange(200, dtype=torch.uint8)
    starts = torch.tensor([0, 50, 100])
    gen = torch.Generator().manual_seed(0)
    x, y = windows(data, starts, 64, "gpt", gen)
    assert torch.equal(y[:, :-1], x[:, 1:]) and x[1, 0] == 50
    x, y = windows(data, starts.repeat(100), 64, "bert", gen)
    chosen = y != -100
    assert 0.13 < chosen.float().mean() < 0.17
    assert 0.75 < (x[chosen] == MASK_TOKEN).float().mean() < 0.85
    assert not (x[~chosen] == MASK_TOKEN).any()
    model = Transformer(ModelConfig("bert", block_size=64, n_layer=1, n_head=2, n_embd=32))
    logits, loss = model(x[:4], y[:4])
    assert logits.shape == (4, 64, 257) and 5.0 < loss.item() < 6.0


@pytest.mark.parametrize("kind", ["cnn", "rnn"])
def test_the_other_architectures_are_causal_and_learn_the_next_byte(kind: str) -> None:
    """The convolutional and the recurrent model: no logit sees a later byte, and a few steps
    fit a batch."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(kind, block_size=32, n_layer=3, n_embd=32))
    x = torch.randint(256, (2, 32))
    changed = x.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 256
    with torch.no_grad():
        assert torch.equal(model(x)[0][:, :20], model(changed)[0][:, :20])
        assert not torch.equal(model(x)[0][:, 20:], model(changed)[0][:, 20:])
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-2)
    first = None
    for _ in range(30):
        _, loss = model(x[:, :-1], x[:, 1:])
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first / 2


def test_the_one_bit_rows_run_the_librarys_defaults() -> None:
    """``onebit train``'s onebit-adam and onebit-lamb are the optimizers given the learning rate
    and nothing else (an int4 warmup, ``"auto"`` untold); its ``lamb`` is LAMB, all fp32."""
    model = Transformer(ModelConfig(block_size=16, n_layer=1, n_head=2, n_embd=32))
    for name in ("onebit-adam", "onebit-lamb", "lamb"):
        opt = optim.build(
            name, model, model.param_groups(0.1), lr=1e-3, freeze_step="auto", steps=40,
            warmup_compression="int4",
        ).optimizer  # fmt: skip
        if name == "lamb":
            assert opt.warmup_compression == "fp32" and opt.freeze_step == optim.NEVER
        else:
            assert opt.warmup_compression == "int4"
            assert opt.freeze.auto_freeze == onebit.AutoFreeze() and opt.freeze_step is None


def wandb_offline(tmp_path: Path) -> dict[str, str]:
    """Environment for W&B in offline mode, writing nothing outside ``tmp_path``."""
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    for var in ("CONFIG", "CACHE", "DATA", "ARTIFACT"):
        env[f"WANDB_{var}_DIR"] = str(tmp_path / "wandb-home" / var.lower())
    return env


@pytest.mark.slow  # onebit train runs
def test_fp16_clipping_and_every_log_backend_resume_exactly(
    tmp_path: Path, data_cache: Path
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, resumed = tmp_path / "run", tmp_path / "resumed"
    options = ["--amp", "fp16", "--grad-clip", "1.0", "--log", "csv,tensorboard,wandb"]
    env = wandb_offline(tmp_path)
    result = onebit_train(
        *TINY, *options, "--save-every", "3", "--out", run, "--cache-dir", data_cache, env=env
    )
    assert result.returncode == 0, result.stderr
    records = read_metrics(run)
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["amp"], summary["grad_clip"]) == ("fp16", 1.0)

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for key in ("loss/train", "optim/lr", "comm/bytes", "optim/skipped_steps"):
        logged = [(e.step, e.value) for e in events.Scalars(key)]
        assert logged == [(r["step"], pytest.approx(r[key])) for r in records], key
    assert [e.step for e in events.Scalars("loss/val")] == [3, 6]
    with (run / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [float(row["loss/train"]) for row in rows] == [r["loss/train"] for r in records]
    assert [row["comm/stage"] for row in rows] == [r["comm/stage"] for r in records]
    assert len(list((run / "wandb").glob("offline-run-*/run-*.wandb"))) == 1

    result = onebit_train(
        "--resume", run / "checkpoints" / "step_000003", "--out", resumed, "--no-progress", env=env
    )
    assert result.returncode == 0, result.stderr
    assert without_timing(read_metrics(resumed)) == without_timing(records)
    final, straight = torch.load(resumed / "model.pt"), torch.load(run / "model.pt")
    assert all(torch.equal(final[k], straight[k]) for k in straight), "the loss scale is saved"


@pytest.mark.parametrize("name", optim.OPTIMIZERS)
def test_grad_clip_reaches_every_optimizer(name: str) -> None:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(block_size=16, n_layer=1, n_head=2, n_embd=32))
    trainer = optim.build(
        name, model, model.param_groups(0.0), lr=1.0, freeze_step=5, steps=10, max_grad_norm=1e-3
    )
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randint(256, (2, 16))
    _, loss = trainer.model(x, x)
    trainer.step(loss)
    if name == "adamw":
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        assert norm == pytest.approx(1e-3, rel=1e-4), "clipped before AdamW's step"
    else:
        assert trainer.optimizer.max_grad_norm == 1e-3
        assert trainer.optimizer.grad_norm > 1e-3
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


@pytest.mark.cuda
@pytest.mark.parametrize("amp", [None, "bf16", "fp16"])
def test_trains_on_cuda(tmp_path: Path, data_cache: Path, amp: str | None) -> None:
    """``--device cuda``: one worker per GPU over NCCL (one here: a GPU holds one NCCL rank)."""
    extra = ["--amp", amp] if amp else []
    run = tmp_path / "run"
    tiny = [*TINY[TINY.index("--steps") :], "--workers", "1"]
    result = onebit_train(
        *tiny, "--device", "cuda", *extra, "--out", run, "--cache-dir", data_cache
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["device"] == "cuda:0" and summary["kernels"] == "triton"
    assert "OnebitAdam on cuda, triton kernels" in result.stdout
    assert all(torch.isfinite(torch.tensor(r["loss/train"])) for r in read_metrics(run))


@pytest.mark.slow
def test_shard_trains_hsdp_and_onebit_side_by_side(tmp_path: Path, data_cache: Path) -> None:
    """``--shard 2`` on 4 workers: 2 emulated nodes of 2 ranks. adamw is torch's HSDP; onebit-adam
    shards with FSDP2 and averages across nodes itself, in fp32 until the freeze (the same losses
    as HSDP), then in 1 bit."""
    result = onebit_train(
        "--compare", "adamw,onebit-adam", *TINY, "--workers", "4", "--shard", "2",
        "--warmup-compression", "fp32", "--out", tmp_path, "--cache-dir", data_cache,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    hsdp, ours = (read_metrics(tmp_path / label) for label in ("adamw", "onebit-adam-warmup-fp32"))
    for a, b in zip(hsdp[:3], ours[:3]):  # steps 1-3: two fp32 warmup updates
        assert b["loss/train"] == pytest.approx(a["loss/train"], rel=1e-5)
    assert [r["comm/stage"] for r in ours] == ["warmup"] * 2 + ["compression"] * 4
    assert ours[0]["comm/bytes"] == pytest.approx(hsdp[0]["comm/bytes"], rel=0.01)
    assert ours[-1]["comm/bytes"] < hsdp[-1]["comm/bytes"] / 16
    row = tmp_path / "onebit-adam-warmup-fp32"
    summary = json.loads((row / "summary.json").read_text())
    assert summary["workers"] == 4 and (row / "model.pt").exists()


def _loop_collectives(rank: int, world_size: int, config: dict, out: str) -> tuple[list, dict]:
    """Run ``config`` on this rank, counting the ``all_reduce`` calls the loop itself makes."""
    import torch.distributed as dist

    from onebit.train import loop

    calls: list[int] = []
    real = dist.all_reduce

    def counted(tensor: torch.Tensor, *args, **kwargs):
        if sys._getframe(1).f_code.co_filename == loop.__file__:
            calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        summary = loop.train(loop.RunConfig.from_dict({**config, "out": out, "save_every": 0}),
                             torch.device("cpu"))  # fmt: skip
    finally:
        dist.all_reduce = real
    return calls, summary


def test_the_loop_averages_training_losses_at_validations_not_every_step(
    compared: Path, tmp_path: Path
) -> None:
    """A collective a step would cost a round trip a step on a long link, where 0/1 Adam's
    local steps wait on none: the loop averages the training losses over the ranks in one
    ``all_reduce`` at each validation (here steps 3 and 6, beside the validation's own)."""
    from distributed import run_ranks

    config = json.loads((compared / "adamw" / "config.json").read_text())
    results = run_ranks(_loop_collectives, 2, config, str(tmp_path), timeout=120)
    for calls, _ in results:
        assert calls == [2, 3, 2, 3]  # validation (loss, count), then 3 steps' losses
    expected = json.loads((compared / "adamw" / "summary.json").read_text())
    assert results[0][1]["final_train_loss"] == expected["final_train_loss"]
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 7))
