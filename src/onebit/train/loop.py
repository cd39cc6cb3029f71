"""The worker's training loop: one data-parallel rank of ``onebit train``.

Every rank builds the same model from the same seed, draws its own random batches, and calls the
optimizer's ``step()``; the optimizer (or DDP, for ``adamw``) does all the communication. Rank 0
logs every step (``metrics.jsonl`` and the ``--log`` backends, see :mod:`.loggers`), and writes
``summary.json``, ``model.pt`` and the plot at the end. A checkpoint (:mod:`.checkpoint`) holds
each rank's model, optimizer state (error buffers included), loss scale and data generator, so a
resumed run continues bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import onebit

from . import checkpoint, loggers, optim, report
from .checkpoint import atomic_write
from .data import get_batch, read_split, val_starts, windows
from .launch import close_process_group, gloo_process_group
from .model import ModelConfig, build_model


@dataclass
class RunConfig:
    """Everything that defines one training run; saved as ``config.json`` in its folder."""

    out: str
    data: str
    data_digest: str
    label: str = "onebit-adam"
    optimizer: str = "onebit-adam"
    model: str = "gpt"
    steps: int = 300
    batch_size: int = 16
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    bias: bool = True
    lr: float = 1e-3
    warmup_steps: int = 15
    weight_decay: float = 0.1
    freeze_step: int | str | None = None
    warmup_compression: str = "fp32"
    error_dtype: str = "fp32"
    bucket_size: int = optim.DEFAULT_BUCKET_SIZE
    local_step_scaler: int | None = None
    var_update_scaler: int | None = None
    local_step_clipper: int | None = None
    error_feedback: bool = True
    eval_every: int = 25
    eval_windows: int = 256
    seed: int = 0
    save_every: int = 0
    keep: int = 3
    amp: str | None = None
    grad_clip: float | None = None
    shard: int = 1
    log: tuple[str, ...] = ("jsonl",)
    schedule_steps: int | None = None
    progress: bool = True

    def horizon(self) -> int:
        """The steps the learning-rate schedule and the default freeze step are laid out over:
        the first launch's ``steps``. A resumed run that changes ``steps`` only moves its end."""
        return self.schedule_steps or self.steps

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            self.model, self.block_size, self.n_layer, self.n_head, self.n_embd, self.bias
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        names = {f.name for f in fields(cls)}
        d = {"bias": False, **d}  # runs saved before biases came in had none
        return cls(**{k: v for k, v in d.items() if k in names})


def lr_at(step: int, config: RunConfig) -> float:
    """Linear warmup over ``warmup_steps``, then cosine decay to a tenth of ``lr`` at step
    ``config.horizon()``, and a tenth after it."""
    if step <= config.warmup_steps:
        return config.lr * step / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.horizon() - config.warmup_steps)
    return config.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


# Process groups.


def spawn_worker(
    rank: int,
    world_size: int,
    store: str,
    configs: list[RunConfig],
    resume: str | None,
    device: str = "cpu",
) -> None:
    """Entry point of a local worker started by ``torch.multiprocessing``: on ``"cpu"``, gloo
    over loopback; on ``"cuda"``, GPU ``rank`` and NCCL."""
    if device == "cpu":
        with gloo_process_group(rank, world_size, store, timeout=600):
            run_all(configs, torch.device("cpu"), resume)
        return
    gpu = torch.device("cuda", rank)
    torch.cuda.set_device(gpu)
    dist.init_process_group(
        "nccl", init_method=f"file://{store}", rank=rank, world_size=world_size, device_id=gpu
    )
    try:
        run_all(configs, gpu, resume)
    finally:
        close_process_group()


def torchrun_worker(configs: list[RunConfig], resume: str | None, device: str = "cpu") -> None:
    """Entry point under ``torchrun``: rank and world from the environment; on ``"cuda"``, GPU
    ``LOCAL_RANK`` and NCCL, on ``"cpu"`` gloo.

    torchrun keeps one store for all attempts of a job, and a restarted rank may read the dead
    attempt's addresses from it before its peers overwrite them, then fail to connect. Each
    attempt (``TORCHELASTIC_RESTART_COUNT``) therefore gets its own key prefix.
    """
    store, rank, world_size = next(dist.rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"onebit/attempt_{attempt}", store)
    if device == "cuda":
        where = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(where)
        backend = {"backend": "nccl", "device_id": where}
    else:
        where = torch.device("cpu")
        backend = {"backend": "gloo"}
    dist.init_process_group(**backend, store=store, rank=rank, world_size=world_size)
    try:
        run_all(configs, where, resume)
    finally:
        close_process_group()


def run_all(configs: list[RunConfig], device: torch.device, resume: str | None = None) -> None:
    """Train each configuration in turn; with several, rank 0 then writes the comparison."""
    summaries = [train(c, device, resume if i == 0 else None) for i, c in enumerate(configs)]
    if len(configs) > 1 and dist.get_rank() == 0:
        out = Path(configs[0].out).parent
        runs = {c.label: report.read_metrics(Path(c.out)) for c in configs}
        print(report.write_comparison(out, summaries, runs))


# One run.


def train(config: RunConfig, device: torch.device, resume: str | None = None) -> dict[str, Any]:
    """Run ``config`` on this rank (from checkpoint folder ``resume`` if given); return the
    summary."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = Path(config.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / "config.json", (json.dumps(config.to_dict(), indent=1) + "\n").encode())
    train_data = read_split(Path(config.data), "train")
    val_data = read_split(Path(config.data), "val")
    eval_x, eval_y = _eval_set(val_data, config)

    torch.manual_seed(config.seed)
    model = build_model(config.model_config()).to(device)
    mesh = None
    if config.shard > 1:
        mesh = optim.shard(model, config.shard, config.optimizer, device)
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + rank)
    start_step, elapsed, sent = 0, 0.0, {}
    rounds: dict[str, int] = {}
    trainer = optim.build(
        config.optimizer,
        model,
        model.param_groups(config.weight_decay),
        lr=config.lr,
        freeze_step=config.freeze_step,
        steps=config.horizon(),
        bucket_size=config.bucket_size,
        local_step_scaler=config.local_step_scaler,
        var_update_scaler=config.var_update_scaler,
        local_step_clipper=config.local_step_clipper,
        max_grad_norm=config.grad_clip,
        scaler=torch.amp.GradScaler(device.type) if config.amp == "fp16" else None,
        warmup_compression=config.warmup_compression,
        error_dtype=config.error_dtype,
        mesh=mesh,
    )
    opt = trainer.optimizer
    backend = getattr(opt, "backend", None)  # a onebit optimizer's kernels
    if rank == 0 and backend is not None:
        print(f"{config.label}: {type(opt).__name__} on {device.type}, {backend} kernels")
    kept: list[dict[str, Any]] = []
    if resume is not None:
        # After the optimizer's broadcast from rank 0: 0/1 Adam's replicas may differ.
        state = torch.load(Path(resume) / f"rank{rank}.pt", map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        trainer.load_state_dict(state["trainer"])
        generator.set_state(state["generator"])
        start_step, elapsed, sent = state["step"], state["elapsed"], state["bytes_sent"]
        rounds = state.get("rounds", {})  # a checkpoint from before rounds were counted: 0
        source = Path(resume).parent.parent
        if rank == 0 and (source / "metrics.jsonl").exists():
            kept = [r for r in report.read_metrics(source) if r["step"] <= start_step]
    logger = None
    if rank == 0:
        logger = loggers.MetricLogger(
            tuple(config.log),
            out,
            kept=kept,
            start_step=start_step,
            config=config.to_dict(),
            name=out.name,
        )

    dummy = torch.zeros(config.batch_size, config.block_size, dtype=torch.long, device=device)
    trainer.settle(dummy, dummy)
    numel = sum(p.numel() for p in model.parameters())
    samples_per_step = config.batch_size * world_size
    bar = _progress(config, start_step) if rank == 0 else None
    autocast = _autocast(config.amp, device)
    dist.barrier()
    t0 = time.perf_counter() - elapsed
    pending: list[tuple[dict[str, Any], Tensor]] = []
    for step in range(start_step + 1, config.steps + 1):
        lr = lr_at(step, config)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = get_batch(train_data, config.batch_size, config.block_size, config.model, generator)
        with autocast:
            _, loss = trainer.model(x.to(device), y.to(device))
        trainer.step(loss)
        if not config.error_feedback:
            optim.drop_error_feedback(opt)
        stage, nbytes = trainer.stage(), trainer.last_step_bytes()
        sent[stage] = sent.get(stage, 0) + nbytes
        rounds[stage] = rounds.get(stage, 0) + trainer.last_step_rounds()
        record = {
            "step": step,
            "samples": step * samples_per_step,
            "loss/train": math.nan,  # averaged over the ranks when logged
            "optim/lr": lr,
            "optim/skipped_steps": trainer.skipped_steps(),
            "comm/stage": stage,
            "comm/bytes": nbytes,
            "comm/bytes_total": sum(sent.values()),
        }
        pending.append((record, loss.detach()))
        evaluating = step % config.eval_every == 0 or step == config.steps
        if evaluating:
            synced, synced_rounds = trainer.synchronize()
            if synced:
                if not config.error_feedback:
                    optim.drop_error_feedback(opt)
                sent["synchronize"] = sent.get("synchronize", 0) + synced
                rounds["synchronize"] = rounds.get("synchronize", 0) + synced_rounds
                record["comm/bytes"] += synced
                record["comm/bytes_total"] += synced
            with autocast:
                record["loss/val"] = evaluate(model, eval_x, eval_y, config.batch_size, device)
        record["time/elapsed_s"] = time.perf_counter() - t0
        record["throughput/samples_per_s"] = (
            (step - start_step) * samples_per_step / (record["time/elapsed_s"] - elapsed)
        )
        if bar is not None:
            bar.update()
        saving = config.save_every and (step % config.save_every == 0 or step == config.steps)
        if evaluating or saving:
            _log(pending, logger, bar)
            pending = []
        if saving:
            state = {
                "step": step,
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "trainer": trainer.state_dict(),
                "generator": generator.get_state(),
                "bytes_sent": dict(sent),
                "rounds": dict(rounds),
                "elapsed": time.perf_counter() - t0,
            }
            checkpoint.save(out, step, state, config.keep)
    if bar is not None:
        bar.close()
    wall_time = time.perf_counter() - t0
    per_rank: list[Any] = [None] * world_size
    dist.all_gather_object(per_rank, sum(sent.values()))
    weights = _full_state_dict(model, mesh)
    if rank != 0:
        return {}
    logger.close()
    atomic_write(out / "model.pt", checkpoint.to_bytes(weights))
    summary = _summary(
        config, trainer, numel, world_size, per_rank, sent, rounds, wall_time, device
    )
    atomic_write(out / "summary.json", (json.dumps(summary, indent=1) + "\n").encode())
    records = report.read_metrics(out)
    report.plot_runs({config.label: records}, out / "loss.png", summary["model"])
    print(report.describe(summary))
    return summary


def _full_state_dict(model: nn.Module, mesh: Any) -> dict[str, Tensor]:
    """The model's whole weights, gathered from its shards if FSDP2 sharded it (a collective
    then: call it on every rank)."""
    if mesh is None:
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def _autocast(amp: str | None, device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast to ``amp`` ("bf16" or "fp16") on ``device``, or nothing."""
    if amp is None:
        return contextlib.nullcontext()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[amp]
    return torch.autocast(device.type, dtype=dtype)


def _eval_set(val_data: torch.Tensor, config: RunConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the fixed validation windows (BERT masks drawn from the seed)."""
    starts = val_starts(val_data, config.eval_windows, config.block_size)
    generator = torch.Generator().manual_seed(config.seed)
    x, y = windows(val_data, starts, config.block_size, config.model, generator)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return x[rank::world_size], y[rank::world_size]


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int, device: torch.device
) -> float:
    """Mean validation cross-entropy (nats per predicted byte) over every rank's windows."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(0, len(x), batch_size):
        logits, _ = model(x[i : i + batch_size].to(device))
        targets = y[i : i + batch_size].to(device)
        loss = F.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
        )
        total += torch.stack([loss.double(), (targets != -100).sum().double()])
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def _progress(config: RunConfig, start_step: int) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=config.steps,
        initial=start_step,
        desc=config.label,
        unit="step",
        mininterval=0.5,
        dynamic_ncols=True,
        disable=not config.progress,
    )


def _log(pending: list[tuple[dict[str, Any], Tensor]], logger: Any, bar: Any) -> None:
    """Log the records of ``pending`` with their training losses averaged over the ranks, all
    in one collective: one each step would cost the run a round trip a step on a long link."""
    losses = torch.stack([loss.double() for _, loss in pending])
    dist.all_reduce(losses)  # fp64: exact sums of fp32 losses, whatever the order
    for (record, _), total in zip(pending, losses.tolist()):
        record["loss/train"] = total / dist.get_world_size()
        if logger is not None:
            logger.log(record)
    if bar is not None:
        bar.set_postfix(_postfix(pending[-1][0]), refresh=False)


def _postfix(record: dict[str, Any]) -> dict[str, str]:
    postfix = {
        "loss": f"{record['loss/train']:.3f}",
        "stage": record["comm/stage"],
        "sent": report.human_bytes(record["comm/bytes_total"]),
    }
    if "loss/val" in record:
        postfix["val"] = f"{record['loss/val']:.3f}"
    return postfix


def _summary(
    config: RunConfig,
    trainer: optim.Trainer,
    numel: int,
    world_size: int,
    per_rank: list[int],
    sent: dict[str, int],
    rounds: dict[str, int],
    wall_time: float,
    device: torch.device,
) -> dict[str, Any]:
    records = report.read_metrics(Path(config.out))
    vals = [r["loss/val"] for r in records if "loss/val" in r]
    losses = [r["loss/train"] for r in records][-20:]
    nodes = world_size // config.shard  # with --shard, the fp32 average of a shard across nodes
    fp32 = config.steps * onebit.wire.protocol.allreduce_bytes(
        4 * math.ceil(numel / config.shard), nodes
    )
    total = per_rank[0]
    return {
        "label": config.label,
        "optimizer": config.optimizer,
        "model": config.model,
        "parameters": numel,
        "workers": world_size,
        "steps": config.steps,
        "batch_size": config.batch_size,
        "block_size": config.block_size,
        "samples": config.steps * config.batch_size * world_size,
        "lr": config.lr,
        "freeze_step": trainer.freeze_step(),
        "bucket_size": config.bucket_size,
        "error_feedback": config.error_feedback,
        "warmup_compression": config.warmup_compression,
        "error_dtype": config.error_dtype,
        "amp": config.amp,
        "grad_clip": config.grad_clip,
        "kernels": getattr(trainer.optimizer, "backend", None),
        "skipped_steps": trainer.skipped_steps(),
        "final_val_loss": vals[-1],
        "best_val_loss": min(vals),
        "final_train_loss": sum(losses) / len(losses),
        "bytes_sent": total,
        "bytes_sent_per_rank": per_rank,
        "bytes_by_stage": sent,
        "fp32_allreduce_bytes": fp32,
        "rounds": sum(rounds.values()),
        "rounds_by_stage": rounds,
        "compression": fp32 / total if total else None,
        "wall_time_s": wall_time,
        "samples_per_s": records[-1]["throughput/samples_per_s"],
        "backend": dist.get_backend(),
        "device": str(device),
        "torch": torch.__version__,
        "onebit": onebit.__version__,
        "seed": config.seed,
        "data_digest": config.data_digest,
    }
