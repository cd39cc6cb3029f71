"""torchtitan's own trainer with a onebit optimizer (:mod:`onebit.integrations.torchtitan`), on 4
gloo ranks as 2 replicas x 2 shards of torchtitan's debug Llama: before the freeze a step is
torchtitan's HSDP + AdamW's (parameters and logged gradient norm), the ranks that hold the same
shard stay bitwise equal, only the replicate dimension carries onebit's traffic (FSDP2 sends
nothing across it), torchtitan's checkpoints resume bit for bit on either side of the freeze,
and what the integration cannot do is refused before anything runs.

torchtitan runs on the CPU with the shims of :mod:`torchtitan_cpu`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")
pytestmark = pytest.mark.slow

import torch  # noqa: E402
import torchtitan_cpu  # noqa: E402
from distributed import run_ranks as _run_ranks  # noqa: E402

STEPS, FREEZE = 4, 2
_ADAMW_NORMS: list[torch.Tensor] = []  # torchtitan's clip_grad_norm_'s, in an AdamW rank


def run_ranks(fn, *args) -> list:
    """``fn`` on 4 ranks, forked from a server that imported what torchtitan imports."""
    return _run_ranks(fn, 4, *args, timeout=600, frameworks=True)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return torchtitan_cpu.write_assets(tmp_path_factory.mktemp("torchtitan"))


def _config(assets, dump: str, name: str | None, steps: int = STEPS, **options):
    """The debug model's config: AdamW under torchtitan's ``Trainer`` if ``name`` is None, else
    the onebit optimizer ``name`` under ``OnebitTrainer``."""
    if name is None:
        return torchtitan_cpu.debug_config(assets, dump, replicas=2, shards=2, steps=steps)
    from onebit.integrations.torchtitan import OnebitTrainer, onebit_optimizer

    optimizer = onebit_optimizer(name, **options)
    return torchtitan_cpu.debug_config(
        assets, dump, replicas=2, shards=2, steps=steps, optimizer=optimizer, trainer=OnebitTrainer
    )


def _observe(trainer) -> dict:
    """What a step left: this rank's parameter shards, the logged gradient norm, and onebit's
    byte count and process group where there is one."""
    seen = {
        "params": [p.to_local().detach().clone() for p in trainer.model_parts[0].parameters()],
        "meshes": sorted({p.device_mesh.ndim for p in trainer.model_parts[0].parameters()}),
    }
    optimizers = trainer.optimizers
    if _ADAMW_NORMS:
        seen["grad_norm"] = float(_ADAMW_NORMS[-1])
    if hasattr(optimizers, "onebit"):
        optimizer = optimizers.onebit
        seen["grad_norm"] = float(optimizers.grad_norm)
        seen["stage"] = optimizer.comm_stats.last_step_stage
        seen["bytes"] = optimizer.comm_stats.last_step_bytes
        seen["fp32_bytes"] = 4 * sum(p.to_local().numel() for p in optimizer.shards.params)
        seen["group"] = torch.distributed.get_process_group_ranks(optimizer.process_group)
    return seen


def _train(rank: int, world_size: int, assets, dump: str, name: str | None, options: dict):
    """:data:`STEPS` steps of optimizer ``name``, or of AdamW (``None``), which saves at step 2
    through torchtitan's checkpointer (the start of the runs that load it)."""
    torchtitan_cpu.patch_for_the_cpu()
    config = _config(assets, dump, name, **options)
    if name is None:
        from torchtitan.distributed import utils

        clip = utils.clip_grad_norm_

        def recorded(*args, **kwargs):
            _ADAMW_NORMS.append(clip(*args, **kwargs))
            return _ADAMW_NORMS[-1]

        utils.clip_grad_norm_ = recorded
        config.checkpoint.enable = True
        config.checkpoint.interval = 2
    return torchtitan_cpu.train(config, _observe)


@pytest.fixture(scope="module")
def adamw(assets, tmp_path_factory) -> tuple[list, str]:
    """torchtitan's HSDP + AdamW: what each rank saw at each step, and where it saved."""
    dump = str(tmp_path_factory.mktemp("adamw"))
    return run_ranks(_train, assets, dump, None, {}), dump


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_warmup_is_torchtitans_hsdp_adamw_and_1_bit_crosses_replicas_only(assets, adamw, tmp_path):
    adamw, _ = adamw
    options = {"freeze_step": FREEZE, "warmup_compression": "fp32"}
    onebit = run_ranks(_train, assets, str(tmp_path / "b"), "OnebitAdam", options)
    for rank in range(4):
        assert onebit[rank][0]["meshes"] == [1]  # FSDP2 shards on the 1-D fsdp mesh
        assert onebit[rank][0]["group"] == [rank % 2, rank % 2 + 2]  # dp_replicate
        for step in range(FREEZE):
            for x, y in zip(adamw[rank][step]["params"], onebit[rank][step]["params"]):
                torch.testing.assert_close(x, y, rtol=0, atol=5e-7)
        assert [s["stage"] for s in onebit[rank]] == ["warmup"] * FREEZE + ["compression"] * 2
        for s in onebit[rank][FREEZE:]:
            assert s["fp32_bytes"] / s["bytes"] > 16  # 1 bit an element, and scales
        for s in onebit[rank][:FREEZE]:
            assert 0 <= s["bytes"] - s["fp32_bytes"] < 1024  # the shard in fp32, and headers
    for step in range(STEPS):
        for rank in (0, 1):  # the ranks that hold the same shard
            assert _equal(onebit[rank][step]["params"], onebit[rank + 2][step]["params"])
    # torchtitan's logged norm is the replica-averaged gradient's, as under HSDP + AdamW
    for rank in range(4):
        logged = [s["grad_norm"] for s in onebit[rank][:FREEZE]]
        assert logged == pytest.approx([s["grad_norm"] for s in adamw[rank][:FREEZE]], rel=1e-5)


def _train_with_checkpoints(
    rank, world_size, assets, dump: str, load_step: int, options: dict, replicas: int = 2
):
    """5 steps of 1-bit Adam, saving every 2 steps through torchtitan's checkpointer, or
    resuming from ``load_step`` (0: from the start); a refusal's message."""
    torchtitan_cpu.patch_for_the_cpu()
    config = _config(assets, dump, "OnebitAdam", steps=5, **options)
    config.parallelism.data_parallel_replicate_degree = replicas
    config.parallelism.data_parallel_shard_degree = 4 // replicas
    config.checkpoint.enable = True
    config.checkpoint.interval = 2
    config.checkpoint.load_step = load_step or -1
    try:
        return torchtitan_cpu.train(config, _observe)
    except ValueError as error:
        return str(error)


def test_resume_from_torchtitans_checkpoints_is_bitwise_through_the_freeze(assets, tmp_path):
    """Saved at step 2 (the warmup: freeze_step=3) and 4 (the compression stage), each resume
    ends where the uninterrupted run did: parameters, error buffers and counters restored. On
    another layout the resume is refused."""
    import shutil

    options = {"freeze_step": 3, "warmup_compression": "int4"}
    whole = run_ranks(_train_with_checkpoints, assets, str(tmp_path / "run"), 0, options)
    assert [s["stage"] for s in whole[0]] == ["warmup"] * 3 + ["compression"] * 2
    for saved_at in (2, 4):
        dump = tmp_path / f"resumed_{saved_at}"
        shutil.copytree(tmp_path / "run" / "checkpoint", dump / "checkpoint")
        resumed = run_ranks(_train_with_checkpoints, assets, str(dump), saved_at, options)
        for rank in range(4):
            assert len(resumed[rank]) == 5 - saved_at
            for mine, theirs in zip(resumed[rank], whole[rank][saved_at:]):
                assert _equal(mine["params"], theirs["params"])
                assert mine["bytes"] == theirs["bytes"]
    # on 4 replicas x 1 shard the error buffers cannot follow: every rank refuses
    refused = run_ranks(_train_with_checkpoints, assets, str(dump), 4, options, 4)
    assert all("2 replicas x 2 shards" in message for message in refused)


def _start_from_adamw(rank, world_size, assets, dump: str, exclude: list):
    """1-bit Adam (freeze_step=1) loads AdamW's step 2 and runs to step 4, its optimizer state
    excluded or not."""
    torchtitan_cpu.patch_for_the_cpu()
    config = _config(assets, dump, "OnebitAdam", steps=4, freeze_step=1)
    config.checkpoint.enable = True
    config.checkpoint.interval = 2
    config.checkpoint.load_step = 2
    config.checkpoint.exclude_from_loading = exclude
    try:
        return torchtitan_cpu.train(config, _observe)
    except ValueError as error:
        return str(error)


def test_an_adamw_checkpoint_is_refused_unless_its_optimizer_state_is_left_out(assets, adamw):
    _, dump = adamw  # the runs save their step 4 beside AdamW's
    refused = run_ranks(_start_from_adamw, assets, dump, [])
    assert all("exclude_from_loading optimizer" in message for message in refused)
    started = run_ranks(_start_from_adamw, assets, dump, ["optimizer"])
    for rank in range(4):
        assert [s["stage"] for s in started[rank]] == ["warmup", "compression"]  # steps 3 and 4
    assert _equal(started[0][-1]["params"], started[2][-1]["params"])


@pytest.mark.parametrize("name", ["ZeroOneAdam", "OnebitLamb"])
def test_zero_one_adam_and_onebit_lamb_train_through_their_freeze(assets, tmp_path, name):
    options = {"var_freeze_step": FREEZE} if name == "ZeroOneAdam" else {"freeze_step": FREEZE}
    runs = run_ranks(_train, assets, str(tmp_path), name, options)
    for rank in range(4):
        stages = [s["stage"] for s in runs[rank]]
        last = runs[rank][-1]
        assert stages[0] != stages[-1] and last["bytes"] < last["fp32_bytes"] / 16
    for step in range(STEPS):
        for rank in (0, 1):
            assert _equal(runs[rank][step]["params"], runs[rank + 2][step]["params"])
    assert not _equal(runs[0][0]["params"], runs[0][-1]["params"])


REFUSED = {
    "parallelism.tensor_parallel_degree": (2, "data parallelism only"),
    "parallelism.context_parallel_degree": (2, "data parallelism only"),
    "parallelism.pipeline_parallel_degree": (2, "data parallelism only"),
    "parallelism.expert_parallel_degree": (2, "data parallelism only"),
    "parallelism.data_parallel_replicate_degree": (1, "at least 2"),
    "parallelism.spmd_backend": ("spmd_types", "partial_dtensor"),
    "training.enable_cpu_offload": (True, "cpu_offload"),
    "checkpoint.async_mode": ("async", "async_mode must be 'disabled'"),
    "optimizer.implementation": ("fused_opt_states_bf16", "AdamW's"),
}


@pytest.mark.parametrize("setting", REFUSED)
def test_what_the_integration_cannot_do_is_refused_before_anything_runs(assets, tmp_path, setting):
    from onebit.integrations.torchtitan import OnebitTrainer, onebit_optimizer

    config = torchtitan_cpu.debug_config(
        assets, str(tmp_path), replicas=2, shards=2, steps=1,
        optimizer=onebit_optimizer(), trainer=OnebitTrainer,
    )  # fmt: skip
    section, key = setting.split(".")
    value, message = REFUSED[setting]
    setattr(getattr(config, section), key, value)
    config.checkpoint.enable = True
    with pytest.raises(ValueError, match=message):
        OnebitTrainer(config)


def test_only_onebit_optimizers_and_only_under_onebit_trainer(assets, tmp_path):
    from torchtitan.components.optimizer import ParamGroupConfig, default_adamw

    from onebit.integrations.torchtitan import (
        OnebitOptimizers,
        OnebitTrainer,
        onebit_config,
        onebit_optimizer,
    )

    with pytest.raises(ValueError, match="not a onebit optimizer"):
        onebit_optimizer("AdamW")
    base = torchtitan_cpu.debug_config(assets, str(tmp_path), replicas=2, shards=2, steps=1)
    config = onebit_config(base, onebit_optimizer("ZeroOneAdam", lr=1e-3))
    assert isinstance(config, OnebitTrainer.Config) and config.training is base.training
    config.optimizer = default_adamw()
    with pytest.raises(ValueError, match="needs a onebit optimizer"):
        OnebitTrainer(config)
    config.optimizer = onebit_optimizer()
    config.optimizer.param_groups.insert(
        0, ParamGroupConfig(pattern="norm", optimizer_name="OnebitLamb", optimizer_kwargs={})
    )
    with pytest.raises(ValueError, match="same onebit optimizer"):
        OnebitTrainer(config)
    config.optimizer = onebit_optimizer(max_grad_norm=0.5)
    with pytest.raises(ValueError, match="set training.max_norm alone"):
        OnebitTrainer(config)
    with pytest.raises(ValueError, match="runs under OnebitTrainer"):
        OnebitOptimizers(onebit_optimizer(), model_parts=[torch.nn.Linear(2, 2)])


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "torchtitan"


def _train_the_example(rank, world_size, assets, dump: str, onebit: bool):
    """The example's debug config (or torchtitan's, with AdamW) parsed from a command line as
    ``torchtitan.train`` does, with gradient accumulation, bf16 parameters, ``torch.compile``
    and full activation checkpointing."""
    sys.path.insert(0, str(EXAMPLE))
    torchtitan_cpu.patch_for_the_cpu()
    from torchtitan.config import ConfigManager
    from torchtitan.distributed.activation_checkpoint import FullAC

    module, name = ("onebit_llama3", "onebit_llama3.llama3_debugmodel_onebit")
    if not onebit:
        module, name = "torchtitan.models.llama3", "llama3_debugmodel"
    args = ["--module", module, "--config", name.split(".")[-1], "--compile.enable"]
    args += ["--training.mixed_precision_param", "bfloat16"]
    if onebit:
        args += ["--optimizer.optimizer-factory-kwargs-by-name.OnebitAdam.freeze-step", "2"]
        args += ["--optimizer.optimizer-factory-kwargs-by-name.OnebitAdam.warmup-compression"]
        args += ["fp32"]
    base = ConfigManager().parse_args(args)
    config = torchtitan_cpu.debug_config(assets, dump, replicas=2, shards=2, steps=3, base=base)
    config.training.global_batch_size = 2 * 4 * torchtitan_cpu.LOCAL_BATCH
    config.activation_checkpoint = FullAC.Config()

    import logging

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger().addHandler(handler)

    def observe(trainer):
        onebit_lines = [line for line in lines if line.startswith("onebit ")]
        seen = {**_observe(trainer), "accumulation": trainer.gradient_accumulation_steps}
        return {**seen, "logged": onebit_lines[-1:]}

    return torchtitan_cpu.train(config, observe)


def test_the_example_with_accumulation_bf16_compile_and_activation_checkpointing(assets, tmp_path):
    adamw = run_ranks(_train_the_example, assets, str(tmp_path / "a"), False)
    onebit = run_ranks(_train_the_example, assets, str(tmp_path / "b"), True)
    assert onebit[0][0]["accumulation"] == 2
    assert [s["stage"] for s in onebit[0]] == ["warmup", "warmup", "compression"]
    assert "stage: compression" in onebit[0][-1]["logged"][0]  # the onebit metrics line
    assert "x fewer than fp32" in onebit[0][-1]["logged"][0]
    for rank in range(4):  # the first step is AdamW's (later ones differ in bf16's rounding)
        for x, y in zip(adamw[rank][0]["params"], onebit[rank][0]["params"]):
            torch.testing.assert_close(x, y, rtol=0, atol=5e-7)
    for step in range(3):
        for rank in (0, 1):
            assert _equal(onebit[rank][step]["params"], onebit[rank + 2][step]["params"])
