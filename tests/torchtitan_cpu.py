"""torchtitan's own trainer on gloo CPU ranks, for the tests of
:mod:`onebit.integrations.torchtitan`.

torchtitan 0.3 targets GPUs; on the CPU it needs what :func:`patch_for_the_cpu` changes (none of
it touches what onebit does): the device type (it falls back to ``"cuda"``), the CUDA memory
monitor, FlexAttention (no CPU backward: a dense masked softmax with the same mask instead, whose
block mask is built eagerly, not compiled: seconds a rank), the
process-group timeouts (a function torch 2.13 lacks), and FSDP2's ``PREMUL_SUM`` reduce-scatter,
which gloo refuses (:func:`sum_reductions`: FSDP2's own sum-then-scale path). The package ships no
dataset or tokenizer: :func:`write_assets` makes both from text that ships with Python.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable
from typing import Any

import torch

SEQ_LEN = 64
LOCAL_BATCH = 2


def patch_for_the_cpu(cpu: bool = True) -> None:
    """Make torchtitan 0.3 run on the CPU, logging as ``torchtitan.train`` does. Call before
    importing anything of torchtitan. With ``cpu=False`` (ranks sharing one GPU over gloo) it
    changes only the logging, the local rank and the process-group timeouts."""
    import torch._utils

    if cpu:
        torch._utils._get_available_device_type = lambda: "cpu"
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["LOCAL_RANK"] = "0"

    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.components import metrics
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common import attention
    from torchtitan.tools.logging import init_logger

    init_logger()  # as torchtitan.train does
    dist_utils.set_pg_timeouts = lambda *args, **kwargs: None
    if not cpu:
        return

    class _NoMemory:
        device_name = "cpu"
        device_capacity_gib = 0.0

        def get_peak_stats(self) -> Any:
            return metrics.DeviceMemStats(*[0] * len(metrics.DeviceMemStats._fields))

        def reset_peak_stats(self) -> None:
            pass

    metrics.build_device_memory_monitor = _NoMemory
    attention.FlexAttention.compiled_flex_attn = staticmethod(_dense_flex_attention)
    attention._compiled_create_block_mask = create_block_mask


def _dense_flex_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_mask: Any, scale: Any, **_: Any
) -> tuple[torch.Tensor, Any]:
    from torch.nn.attention.flex_attention import create_mask

    batch, heads, length, dim = q.shape
    mask = create_mask(block_mask.mask_mod, batch, 1, length, length, device=q.device)
    scores = q @ k.transpose(-1, -2) * (dim**-0.5 if scale is None else scale)
    out = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
    return out, None


def sum_reductions(model: torch.nn.Module) -> None:
    """FSDP2 reduces with ``ReduceOp.SUM`` and scales separately, as gloo needs."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def write_assets(directory: str | os.PathLike) -> pathlib.Path:
    """A small corpus (``c4_test``-shaped JSONL) and a byte-level BPE tokenizer under
    ``directory``, from the docstrings of Python's standard library; returns the folder."""
    import inspect
    import textwrap

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = pathlib.Path(directory)
    (root / "data").mkdir(parents=True, exist_ok=True)
    texts = []
    for module in (json, os, pathlib, textwrap, inspect):
        for _, member in inspect.getmembers(module):
            doc = inspect.getdoc(member)
            if doc and len(doc) > 200:
                texts.append(doc)
    with open(root / "data" / "train.jsonl", "w") as file:
        for text in texts:
            file.write(json.dumps({"text": text}) + "\n")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    tokenizer.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=1000, special_tokens=special, show_progress=False)
    )
    (root / "tokenizer").mkdir(exist_ok=True)
    tokenizer.save(str(root / "tokenizer" / "tokenizer.json"))
    with open(root / "tokenizer" / "tokenizer_config.json", "w") as file:
        json.dump({"bos_token": special[0], "eos_token": special[1]}, file)
    return root


def debug_config(
    assets: pathlib.Path,
    dump: str,
    *,
    replicas: int,
    shards: int,
    steps: int,
    optimizer: Any = None,
    trainer: Any = None,
    base: Any = None,
) -> Any:
    """torchtitan's ``llama3_debugmodel`` made small for the CPU: sequences of ``SEQ_LEN``, a
    local batch of ``LOCAL_BATCH``, HSDP ``replicas x shards``, no validation or activation
    checkpointing, checkpoints off (tests turn them on). ``trainer`` is the ``Trainer`` class
    whose ``Config`` to return (torchtitan's own by default); ``base``, the config to start from
    (``llama3_debugmodel()``'s by default)."""
    import dataclasses

    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from torchtitan.trainer import Trainer

    config = llama3_debugmodel() if base is None else base
    config.hf_assets_path = str(assets / "tokenizer")
    config.dump_folder = dump
    config.dataloader.dataset_path = str(assets / "data")
    config.training.seq_len = SEQ_LEN
    config.training.local_batch_size = LOCAL_BATCH
    config.training.steps = steps
    config.parallelism.spmd_backend = "partial_dtensor"
    config.parallelism.data_parallel_replicate_degree = replicas
    config.parallelism.data_parallel_shard_degree = shards
    config.validator.enable = False
    config.activation_checkpoint = None
    config.checkpoint.enable = False
    config.metrics.log_freq = 1
    config.debug.seed = 0
    config.debug.deterministic = True
    if optimizer is not None:
        config.optimizer = optimizer
    spec = config.model_spec
    parallelize = spec.parallelize_fn

    def parallelize_with_sums(model: Any, **kwargs: Any) -> Any:
        model = parallelize(model, **kwargs)
        sum_reductions(model)
        return model

    config.model_spec = dataclasses.replace(spec, parallelize_fn=parallelize_with_sums)
    if trainer is not None and trainer is not Trainer:
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
        config = trainer.Config(**fields)
    return config


def train(config: Any, after_step: Callable[[Any], Any] | None = None) -> list[Any]:
    """Build ``config``'s trainer and train it; returns ``after_step(trainer)`` of every step."""
    seen: list[Any] = []
    trainer = config.build()
    if after_step is not None:
        step = trainer.train_step

        def train_step(data: Any) -> None:
            step(data)
            seen.append(after_step(trainer))

        trainer.train_step = train_step
    try:
        trainer.train()
    finally:
        trainer.close()
    return seen
