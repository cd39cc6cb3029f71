"""What the framework tests share: a tiny GPT-2 built from a config, byte-level text that ships
with Python, and the environment a launcher would give each rank."""

from __future__ import annotations

import difflib
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_ranks
from family import all_equal, params_of

import onebit


def needs(*modules: str) -> pytest.MarkDecorator:
    """Skip a test module unless ``modules`` are installed, without importing them at
    collection: Lightning's import alone costs each test process seconds of CPU, and the tests'
    ranks import the frameworks from their forkserver anyway."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}")


BLOCK = 32
FREEZE = 3  # OnebitAdam freezes after 3 steps: every run here crosses it


def launched_as(rank: int, world_size: int) -> None:
    """Set the variables torchrun sets, for frameworks that read them (the process group is
    already up: ``run_ranks`` started it)."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
        WANDB_MODE="disabled",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )


def tiny_gpt2(seed: int = 0) -> torch.nn.Module:
    """A 2-layer byte-level GPT-2 (about 30k parameters), without dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=256, n_positions=BLOCK, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


class Probe(torch.nn.Module):
    """A tiny GPT-2 and two 1-row linear layers, whose local shards are empty on the second
    shard of each replica (Accelerate matches shards to parameters by memory address, which
    empty shards share)."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = tiny_gpt2()
        self.a, self.b = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ones = torch.ones(4)
        return (
            self.gpt(input_ids=input_ids, labels=labels).loss + (self.a(ones) * self.b(ones)).sum()
        )


def text_windows(count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` consecutive ``BLOCK``-byte windows of ``difflib.py``, as causal-LM examples."""
    data = torch.tensor(list(Path(difflib.__file__).read_bytes()[: count * BLOCK]))
    return [{"input_ids": w, "labels": w} for w in data.view(count, BLOCK)]


def fp32_bytes(model: torch.nn.Module) -> int:
    return 4 * sum(p.numel() for p in model.parameters())


def onebit_adam(model: torch.nn.Module, clip: float | None = 1.0) -> onebit.OnebitAdam:
    """The optimizer the Accelerate and Lightning tests train with, framework or not."""
    return onebit.OnebitAdam(
        model.parameters(),
        warmup_compression="fp32",
        lr=1e-2,
        freeze_step=FREEZE,
        max_grad_norm=clip,
    )


def replay(batches: list[dict[str, torch.Tensor]]) -> tuple[list[torch.Tensor], int]:
    """:func:`onebit_adam` on a bare :func:`tiny_gpt2` in a plain loop over ``batches`` (those a
    framework fed this rank): its final parameters and the model's fp32 bytes."""
    plain = tiny_gpt2()
    optimizer = onebit_adam(plain)
    for batch in batches:
        plain(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return params_of(plain), fp32_bytes(plain)


def assert_trained_as_a_plain_loop(results: list[tuple]) -> None:
    """Each rank's (framework's parameters, plain loop's parameters on the same batches, comm
    stats, fp32 bytes of the model): bitwise the same training, so the framework adds nothing
    (no second allreduce through DDP, no local clipping, no extra step), and 1-bit traffic
    after the fp32 stage."""
    for trained, plain, stats, fp32 in results:
        assert all_equal(trained, plain)
        assert stats.steps["compression"] >= 2
        assert stats.mean_bytes_per_step("compression") < fp32 / 25  # 1 bit, with scales
        assert max(map(stats.mean_bytes_per_step, stats.steps)) >= fp32  # the fp32 stage


def assert_resumed_exactly(results: list[tuple], resumed: list[list[torch.Tensor]]) -> None:
    for (trained, *_), params in zip(results, resumed):
        assert all_equal(trained, params)


def assert_skipped_on_every_rank(params: list[list[torch.Tensor]], skipped: list[int]) -> None:
    """One step skipped on every rank, replicas identical and finite."""
    assert list(skipped) == [1] * len(skipped)
    assert all(all_equal(params[0], other) for other in params[1:])
    assert all(bool(torch.isfinite(p).all()) for p in params[0])


def check_plain_loop_and_exact_resume(train: Callable, resume: Callable, out: str) -> None:
    """Run the rank functions ``train`` then ``resume`` on 2 ranks: the framework must train as
    the plain loop does, sending 1 bit, and resume exactly."""
    results = run_ranks(train, 2, out, timeout=240, frameworks=True)
    assert_trained_as_a_plain_loop(results)
    assert_resumed_exactly(results, run_ranks(resume, 2, out, timeout=240, frameworks=True))


def check_an_inf_on_one_rank_skips_everywhere(run: Callable, out: str) -> None:
    """``run(rank, world_size, out, inf_at)`` puts an inf on one rank after the freeze; every
    rank must skip that step."""
    results = run_ranks(run, 2, out, FREEZE + 2, timeout=240, frameworks=True)
    assert_skipped_on_every_rank(*zip(*results))


def assert_hybrid_shards_trained(runs: list[dict]) -> None:
    """4 ranks as 2 replicas x 2 shards (ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1):
    every rank read its own batches, and each shard's replicas stayed bitwise one model."""
    seen = [torch.cat(run["batches"]) for run in runs]
    assert all(not torch.equal(seen[i], seen[j]) for i in range(4) for j in range(i))
    assert [run["shard"] for run in runs] == [0, 1, 0, 1]
    assert all_equal(runs[0]["params"], runs[2]["params"])
    assert all_equal(runs[1]["params"], runs[3]["params"])


def assert_resumed_from(runs: list[dict], resumed: list[dict], saved_at: int) -> None:
    """Each rank's run resumed after step ``saved_at`` read the batches the whole run read from
    there and ended bitwise where it ended."""
    for run, again in zip(runs, resumed):
        assert torch.equal(torch.cat(again["batches"]), torch.cat(run["batches"][saved_at:]))
        assert all_equal(run["params"], again["params"])


def accelerate_hsdp_on_cpu(replicas: int, shards: int, state_dict_type: str | None = None) -> Any:
    """An ``Accelerator`` set up as ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
    fsdp_version=2), parallelism_config=ParallelismConfig(dp_replicate_size=replicas,
    dp_shard_size=shards))`` is on GPUs (``state_dict_type``: the plugin's, which Accelerate's
    checkpoints follow). Accelerate refuses that configuration on the CPU, so
    its FSDP2 path is taken by hand here."""
    from accelerate import Accelerator, PartialState
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    accelerator = Accelerator(cpu=True)
    config = ParallelismConfig(dp_replicate_size=replicas, dp_shard_size=shards)
    for state in (PartialState(), accelerator.state):  # AcceleratorState() copies PartialState's
        state.distributed_type = DistributedType.FSDP
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=state_dict_type)
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.parallelism_config = config
    accelerator.state.device_mesh = config.build_device_mesh("cpu")
    return accelerator
