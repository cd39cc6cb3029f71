"""``onebit train``: parse and check the options, prepare the data, start the workers.

Locally it spawns ``--workers`` processes that talk over gloo on the loopback interface. Under
``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) it is one of the ranks: it spawns nothing and uses
NCCL when CUDA is available, gloo otherwise. Every mistake in the input ends in a one-line error
and exit status 2, before any worker starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp

from . import checkpoint, launch, loggers, optim
from .arguments import (
    AUTO,
    DEFAULT_STEPS,
    DEFAULT_WORKERS,
    UsageError,
    Variant,
    build_main_parser,
    build_parser,
    parse_compare,
)
from .checkpoint import CheckpointError
from .data import DataError, prepare
from .loop import RunConfig, spawn_worker, torchrun_worker


def main(argv: list[str] | None = None) -> None:
    """The ``onebit`` console script: ``onebit train [options]``, ``onebit --version``; with no
    command it prints its help and exits 0."""
    parser = build_main_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        sys.exit(0)
    sys.exit(run(args, f"{parser.prog} {args.command}"))


def train_main(argv: list[str] | None = None) -> None:
    """``python -m onebit.train [options]``, as under ``torchrun``."""
    parser = build_parser("python -m onebit.train")
    sys.exit(run(parser.parse_args(argv), parser.prog))


@dataclass
class Plan:
    """What to run: the configurations, the checkpoint folder to continue from, the workers, and
    ``finished``, a message if there is nothing left to do."""

    configs: list[RunConfig]
    resume: str | None
    workers: int
    finished: str | None = None
    device: str = "cpu"


def run(args: argparse.Namespace, prog: str) -> int:
    """Check everything, then train; return the exit status."""
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    talk = not torchrun or os.environ.get("RANK") == "0"

    def warn(message: str) -> None:
        if talk:
            print(f"{prog}: warning: {message}", file=sys.stderr)

    try:
        _require_extras()
        loggers.check_available(args.log)
        plan = resolve(args, torchrun, warn)
    except (
        UsageError,
        DataError,
        CheckpointError,
        loggers.LoggerUnavailable,
    ) as err:
        if talk:
            print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    if plan.finished:
        if talk:
            print(f"{prog}: {plan.finished}", file=sys.stderr)
        return 0
    if torchrun:
        torchrun_worker(plan.configs, plan.resume, plan.device)
        return 0
    return _launch(plan, args.max_restarts, prog, warn)


def _launch(plan: Plan, max_restarts: int, prog: str, warn: Callable[[str], None]) -> int:
    """Run the workers locally; if one dies, stop the others and start them all again from the
    newest usable checkpoint, up to ``max_restarts`` times."""
    configs, resume = plan.configs, plan.resume
    where = configs[0].out if len(configs) == 1 else str(Path(configs[0].out).parent)
    print(f"{prog}: {plan.workers} workers on {plan.device}, results in {where}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        for attempt in range(max_restarts + 1):
            try:
                mp.start_processes(
                    spawn_worker,
                    args=(plan.workers, f"{tmp}/store{attempt}", configs, resume, plan.device),
                    nprocs=plan.workers,
                    start_method=launch.fast_start_method(),
                )
                return 0
            except KeyboardInterrupt:
                print(f"{prog}: interrupted", file=sys.stderr)
                return 130
            except (mp.ProcessExitedException, mp.ProcessRaisedException) as err:
                failure = _failure(err)
                if attempt == max_restarts:
                    print(f"{prog}: error: {failure}", file=sys.stderr)
                    return 1
            try:
                found = checkpoint.newest_usable(Path(configs[0].out), warn)
            except CheckpointError as bad:
                print(f"{prog}: error: {failure}; cannot restart: {bad}", file=sys.stderr)
                return 1
            resume = str(found.folder) if found else None
            start = f"step {found.step}" if found else "the start"
            warn(f"{failure}; restart {attempt + 1} of {max_restarts}, from {start}")
    raise AssertionError("unreachable")


def _failure(err: Exception) -> str:
    """What happened to a worker, in a line (a Python error keeps its traceback)."""
    if isinstance(err, mp.ProcessExitedException):
        if err.signal_name:
            return f"worker {err.error_index} was killed by {err.signal_name}"
        return f"worker {err.error_index} exited with status {err.exit_code}"
    return str(err).strip()


def _require_extras() -> None:
    missing = []
    for module in ("tqdm", "matplotlib"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise UsageError(
            f"onebit train needs {' and '.join(missing)}: pip install {' '.join(missing)}, "
            "or install onebit with its train extra (pip install -e '.[train]' in the clone)"
        )


def resolve(args: argparse.Namespace, torchrun: bool, warn: Callable[[str], None]) -> Plan:
    """Turn the options into a :class:`Plan`; ``warn`` gets one line per checkpoint skipped.

    Raises :class:`UsageError`, :class:`DataError` or :class:`CheckpointError` with a one-line
    message.
    """
    device = _device(args.device)
    world_size = int(os.environ["WORLD_SIZE"]) if torchrun else args.workers or DEFAULT_WORKERS
    if device == "cuda" and not torchrun:
        gpus = torch.cuda.device_count()
        world_size = args.workers or gpus
        if world_size > gpus:
            raise UsageError(
                f"--workers {world_size} on {gpus} GPU(s): each worker needs a GPU of its own "
                "(one GPU cannot hold two NCCL ranks); use --device cpu for more workers"
            )
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if device == "cuda" and torchrun and local > torch.cuda.device_count():
        raise UsageError(
            f"torchrun started {local} ranks on this machine, which has "
            f"{torch.cuda.device_count()} GPU(s): each rank needs a GPU of its own; use "
            "--device cpu, or fewer ranks"
        )
    if torchrun and args.workers is not None and args.workers != world_size:
        raise UsageError(f"--workers {args.workers} but torchrun started {world_size} ranks")
    if torchrun and args.max_restarts:
        raise UsageError(
            "under torchrun, restarts are torchrun's: give torchrun --max-restarts, and "
            "onebit --resume auto"
        )
    if args.compare and args.resume is not None:
        raise UsageError("--resume continues one run; it cannot be combined with --compare")
    if args.compare and args.max_restarts:
        raise UsageError("--max-restarts continues one run; it cannot be combined with --compare")
    if args.resume is not None and args.resume != AUTO:
        plan = _resume_from(args, torchrun, world_size, warn)
    else:
        plan = _new_run(args, torchrun, world_size, warn)
    config = plan.configs[0]
    if args.max_restarts and not config.save_every:
        raise UsageError(
            "--max-restarts needs --save-every N: a restart continues from a checkpoint"
        )
    if args.keep is not None and not config.save_every:
        raise UsageError("--keep needs --save-every N")
    if config.shard > 1:
        if world_size % config.shard:
            raise UsageError(
                f"--shard {config.shard} does not divide the {world_size} workers into nodes"
            )
        if config.save_every or args.resume is not None:
            raise UsageError(
                "--shard runs do not checkpoint yet: drop --save-every and --resume (in your "
                "own loop, onebit.fsdp.save and onebit.fsdp.load checkpoint a sharded run)"
            )
    return dataclasses.replace(plan, device=device)


def _device(name: str) -> str:
    """``--device``: ``"cpu"`` or ``"cuda"``."""
    cuda = torch.cuda.is_available()
    if name == "cuda" and not cuda:
        raise UsageError("--device cuda, but torch.cuda.is_available() is False here")
    return "cuda" if name == "auto" and cuda else "cpu" if name == "auto" else name


def _new_run(
    args: argparse.Namespace, torchrun: bool, world_size: int, warn: Callable[[str], None]
) -> Plan:
    """A fresh run, or with ``--resume auto`` the continuation of the one in ``--out``."""
    if args.compare and args.optimizer:
        raise UsageError("give either --optimizer or --compare, not both")
    runs = (
        parse_compare(args.compare) if args.compare else [Variant(args.optimizer or "onebit-adam")]
    )
    names = [run.name for run in runs]
    if not any(optim.is_compressed(n) for n in names):
        for flag, value in (
            ("--no-error-feedback", not args.error_feedback),
            ("--freeze-step", args.freeze_step),
            ("--error-dtype", args.error_dtype not in (None, "fp32")),
            ("--warmup-compression", args.warmup_compression not in (None, "fp32")),
        ):
            if value:
                raise UsageError(f"{flag} applies only to the 1-bit optimizers")
    if args.local_step_scaler and "zero-one-adam" not in names:
        raise UsageError("--local-step-scaler applies only to zero-one-adam")
    steps = args.steps or DEFAULT_STEPS
    if isinstance(args.freeze_step, int) and args.freeze_step >= steps:
        raise UsageError(
            f"--freeze-step {args.freeze_step} is not below --steps {steps}: the run would never "
            "compress"
        )
    if args.width % args.heads:
        raise UsageError(f"--width {args.width} is not a multiple of --heads {args.heads}")
    for name in names:
        lr = args.lr or optim.default_lr(name)
        if lr * args.weight_decay >= 1:
            raise UsageError(
                f"--weight-decay {args.weight_decay:g} with a learning rate of {lr:g} would "
                "zero or flip the weights at every step (lr x weight decay must be below 1)"
            )
    cache = _cache_dir(args)
    _check_folder(cache, "--cache-dir")
    dataset = prepare(args.data, cache)
    dataset.check_context(args.block_size)
    # Every torchrun rank, and every launch of a --resume auto command, must pick the same folder.
    stamp = "" if torchrun or args.resume == AUTO else time.strftime("-%Y%m%d-%H%M%S")
    if args.compare:
        root = args.out or Path("runs") / f"compare-{args.model}{stamp}"
        _check_folder(root, "--out")
    configs = []
    for run in runs:
        name = run.name
        error_feedback = run.error_feedback and args.error_feedback and optim.is_compressed(name)
        if isinstance(run.freeze_step, int) and run.freeze_step >= steps:
            raise UsageError(f"freeze={run.freeze_step} in --compare is not below --steps {steps}")
        warmup = run.warmup or args.warmup_compression or optim.DEFAULT_WARMUP_COMPRESSION
        freeze_step = run.freeze_step or args.freeze_step
        if name not in optim.WARMUP_COMPRESSED:
            warmup = "fp32"
        elif freeze_step is None:
            freeze_step = optim.DEFAULT_FREEZE_STEP
        errors = (run.errors or args.error_dtype or "fp32") if optim.is_compressed(name) else "fp32"
        label = run.label(error_feedback, warmup, errors)
        if args.compare:
            out = root / label
        else:
            out = args.out or Path("runs") / f"{args.model}-{label}{stamp}"
        configs.append(
            RunConfig(
                out=str(out),
                data=str(dataset.folder),
                data_digest=dataset.digest,
                label=label,
                optimizer=name,
                model=args.model,
                steps=steps,
                schedule_steps=steps,
                batch_size=args.batch_size,
                block_size=args.block_size,
                n_layer=args.layers,
                n_head=args.heads,
                n_embd=args.width,
                bias=args.bias,
                lr=args.lr or optim.default_lr(name),
                warmup_steps=max(1, steps // 20),
                weight_decay=args.weight_decay,
                freeze_step=freeze_step,
                warmup_compression=warmup,
                error_dtype=errors,
                bucket_size=args.bucket_size,
                local_step_scaler=run.local_step_scaler or args.local_step_scaler,
                var_update_scaler=run.var_update_scaler,
                local_step_clipper=run.local_step_clipper,
                error_feedback=error_feedback,
                amp=args.amp,
                grad_clip=args.grad_clip,
                shard=args.shard,
                eval_every=args.eval_every or max(1, steps // 20),
                eval_windows=args.eval_windows,
                seed=args.seed,
                save_every=args.save_every,
                keep=args.keep or 3,
                log=args.log,
                progress=args.progress,
            )
        )
    if args.resume == AUTO:
        return _resume_auto(configs[0], args, world_size, warn)
    for config in configs:
        _check_new_run_folder(Path(config.out))
    return Plan(configs, None, world_size)


_RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "model.pt", "checkpoints")


def _check_folder(path: Path, flag: str) -> None:
    """``path`` is a folder, or can be made one."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {path} is a file, not a folder")
    parent = next(p for p in [path, *path.parents] if p.exists())
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: cannot write in {parent}")


def _check_new_run_folder(out: Path) -> None:
    """A fresh run never writes over another run's files."""
    _check_folder(out, "--out")
    if any((out / name).exists() for name in _RUN_FILES):
        saved = checkpoint.steps(out)
        held = f"checkpoints up to step {saved[0]}" if saved else "its results"
        raise UsageError(
            f"{out} already holds a run ({held}); continue it with --resume auto, or choose "
            "another --out"
        )


_SAME_RUN = {
    "data_digest": "--data",
    "optimizer": "--optimizer",
    "label": "--no-error-feedback",
    "model": "--model",
    "batch_size": "--batch-size",
    "block_size": "--block-size",
    "n_layer": "--layers",
    "n_head": "--heads",
    "n_embd": "--width",
    "bias": "--no-bias",
    "lr": "--lr",
    "weight_decay": "--weight-decay",
    "bucket_size": "--bucket-size",
    "warmup_compression": "--warmup-compression",
    "error_dtype": "--error-dtype",
    "local_step_scaler": "--local-step-scaler",
    "var_update_scaler": "--compare zero-one-adam:varscale",
    "local_step_clipper": "--compare zero-one-adam:clipper",
    "amp": "--amp",
    "grad_clip": "--grad-clip",
    "eval_windows": "--eval-windows",
    "seed": "--seed",
}
"""The settings a ``--resume auto`` command must share with the run it continues, and their
flags. ``--freeze-step`` and ``--eval-every`` are compared when given."""


def _resume_auto(
    fresh: RunConfig, args: argparse.Namespace, world_size: int, warn: Callable[[str], None]
) -> Plan:
    out = Path(fresh.out)
    _check_folder(out, "--out")
    if not (out / "config.json").exists():
        _check_new_run_folder(out)
        return Plan([fresh], None, world_size)
    saved = _read_config(out)
    fields = dict(_SAME_RUN)
    if args.freeze_step is not None:
        fields["freeze_step"] = "--freeze-step"
    if args.eval_every is not None:
        fields["eval_every"] = "--eval-every"
    changed = [
        f"{flag} {getattr(saved, name)} there, {getattr(fresh, name)} here"
        for name, flag in fields.items()
        if getattr(saved, name) != getattr(fresh, name)
    ]
    if changed:
        raise UsageError(
            f"{out} holds a different run ({'; '.join(changed)}); choose another --out"
        )
    summary = out / "summary.json"
    if summary.exists():
        done = json.loads(summary.read_text())["steps"]
        if done >= fresh.steps:
            return Plan([saved], None, world_size, f"{out} already finished {done} steps")
    found = checkpoint.newest_usable(out, warn)
    if found is None:
        return Plan([fresh], None, world_size)
    return _continue(saved, found, args, world_size, out)


_RESUME_MAY_CHANGE = {
    "command",
    "out",
    "steps",
    "save_every",
    "keep",
    "log",
    "max_restarts",
    "resume",
    "workers",
    "device",
    "progress",
    "cache_dir",
}


def _resume_from(
    args: argparse.Namespace, torchrun: bool, world_size: int, warn: Callable[[str], None]
) -> Plan:
    """``--resume DIR``: continue the run in DIR (a run folder or one of its checkpoints)."""
    given = [
        name
        for name, value in vars(args).items()
        if name not in _RESUME_MAY_CHANGE and value != build_parser().get_default(name)
    ]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise UsageError(f"--resume continues the saved run: {flags} cannot be changed")
    path = args.resume
    if (path / checkpoint.MARKER).exists() or path.parent.name == "checkpoints":
        found = checkpoint.verify(path)
        run_dir = path.parent.parent
    elif (path / "config.json").exists():
        run_dir = path
        found = checkpoint.newest_usable(run_dir, warn)
        if found is None:
            raise UsageError(f"{path} has no complete checkpoint (train with --save-every N)")
    else:
        raise UsageError(f"{path} is neither a run folder nor a checkpoint folder")
    out = args.out or run_dir
    if out.resolve() == run_dir.resolve():
        newer = [s for s in checkpoint.steps(run_dir) if s > found.step]
        if newer and path != run_dir:
            raise UsageError(
                f"{run_dir} has checkpoints after step {found.step} (step {newer[0]}), which "
                "continuing from it would overwrite; resume into another --out"
            )
    else:
        _check_new_run_folder(out)
    if args.workers is None and not torchrun:
        world_size = found.world_size
    return _continue(_read_config(run_dir), found, args, world_size, out)


def _read_config(run_dir: Path) -> RunConfig:
    try:
        return RunConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
    except (ValueError, TypeError) as err:
        raise UsageError(f"{run_dir / 'config.json'} is unreadable ({err})") from None


def _continue(
    config: RunConfig,
    found: checkpoint.Checkpoint,
    args: argparse.Namespace,
    world_size: int,
    out: Path,
) -> Plan:
    """``config`` continued from ``found`` into ``out``: only where it stops, how often it saves
    and where it logs may change; the schedule and the freeze step stay the saved run's."""
    if world_size != found.world_size:
        raise UsageError(
            f"the checkpoint was saved by {found.world_size} workers, not {world_size}: "
            "error-feedback buffers are per rank"
        )
    if not (Path(config.data) / "train.bin").exists():
        raise UsageError(f"the run's data {config.data} is gone; it cannot be resumed exactly")
    config.schedule_steps = config.horizon()
    config.out = str(out)
    config.steps = args.steps or config.steps
    if config.steps < found.step:
        raise UsageError(f"the checkpoint is at step {found.step}, past --steps {config.steps}")
    config.save_every = args.save_every or config.save_every
    config.keep = args.keep or config.keep
    config.log = args.log if args.log != ("jsonl",) else tuple(config.log)
    config.progress = args.progress
    return Plan([config], str(found.folder), world_size)


def _cache_dir(args: argparse.Namespace) -> Path:
    if args.cache_dir is not None:
        return args.cache_dir
    if os.environ.get("ONEBIT_CACHE"):
        return Path(os.environ["ONEBIT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "onebit"
