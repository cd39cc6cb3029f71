"""``onebit train``: parse and check the options, prepare the data, start the workers.

Locally it spawns ``--workers`` processes that talk over gloo on the loopback interface. Under
``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) it is one of the ranks: it spawns nothing and uses
NCCL when CUDA is available, gloo otherwise. Every mistake in the input ends in a one-line error
and exit status 2, before any worker starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from . import optim
from .data import DataError, prepare
from .loop import RunConfig, checkpoint_dir, latest_checkpoint

DEFAULT_STEPS = 300
DEFAULT_WORKERS = 4


class UsageError(Exception):
    """Bad input; the message is printed as one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    return 0 if text.strip() == "0" else _positive(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _freeze_step(text: str) -> int | str:
    return "auto" if text == "auto" else _positive(text)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``onebit train``."""
    run = parser.add_argument_group("run")
    run.add_argument(
        "--optimizer",
        choices=optim.OPTIMIZERS,
        help="default onebit-adam; adamw is torch.optim.AdamW with DistributedDataParallel, lamb "
        "is uncompressed LAMB",
    )
    run.add_argument(
        "--workers",
        type=_positive,
        metavar="N",
        help=f"local worker processes (default {DEFAULT_WORKERS}; under torchrun, its ranks)",
    )
    run.add_argument(
        "--steps", type=_positive, metavar="N", help=f"optimizer steps (default {DEFAULT_STEPS})"
    )
    run.add_argument(
        "--batch-size", type=_positive, default=16, metavar="N", help="sequences per worker (16)"
    )
    run.add_argument(
        "--lr", type=_positive_float, help="peak learning rate (default 1e-3, LAMB 1e-2)"
    )
    run.add_argument(
        "--weight-decay", type=float, default=0.1, help="decoupled, on matrices only (0.1)"
    )
    run.add_argument(
        "--freeze-step",
        type=_freeze_step,
        metavar="N|auto",
        help="warmup steps of the 1-bit optimizers (default 20%% of --steps); auto watches "
        "Adam's variance and freezes it between 10%% and 25%%",
    )
    run.add_argument(
        "--bucket-size",
        type=_positive,
        default=optim.DEFAULT_BUCKET_SIZE,
        metavar="N",
        help=f"elements per 1-bit bucket, each with its own scale ({optim.DEFAULT_BUCKET_SIZE})",
    )
    run.add_argument(
        "--local-step-scaler",
        type=_positive,
        metavar="N",
        help="zero-one-adam: steps between doublings of its local-step interval (default 32768, "
        "so short runs sync every step)",
    )
    run.add_argument("--seed", type=int, default=0, help="model init and data order (0)")
    run.add_argument(
        "--compare",
        metavar="OPT,OPT,...",
        help="run each optimizer in turn with the same seed and data order, then write a "
        "comparison table and plot; OPT:no-ef runs a 1-bit optimizer without error feedback",
    )
    run.add_argument(
        "--no-error-feedback",
        dest="error_feedback",
        action="store_false",
        help="research ablation: drop the 1-bit optimizers' error feedback (converges worse)",
    )
    model = parser.add_argument_group("model and data")
    model.add_argument(
        "--model",
        choices=("gpt", "bert"),
        default="gpt",
        help="gpt: causal byte-level LM; bert: masked LM, the papers' workload (gpt)",
    )
    model.add_argument(
        "--block-size", type=_positive, default=128, metavar="N", help="context in bytes (128)"
    )
    model.add_argument("--layers", type=_positive, default=4, metavar="N", help="(4)")
    model.add_argument("--heads", type=_positive, default=4, metavar="N", help="(4)")
    model.add_argument("--width", type=_positive, default=128, metavar="N", help="(128)")
    model.add_argument(
        "--data",
        type=Path,
        metavar="PATH",
        help="a text file or a folder of them (default: the Python standard library's source)",
    )
    model.add_argument(
        "--cache-dir",
        type=Path,
        metavar="DIR",
        help="where the train/validation split is kept (default $ONEBIT_CACHE or ~/.cache/onebit)",
    )
    output = parser.add_argument_group("output and checkpoints")
    output.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="run folder (default runs/<model>-<optimizer>-<time>, or runs/compare-...)",
    )
    output.add_argument(
        "--eval-every",
        type=_positive,
        metavar="N",
        help="steps between validation losses (default 5%% of --steps)",
    )
    output.add_argument(
        "--eval-windows",
        type=_positive,
        default=256,
        metavar="N",
        help="validation sequences (256)",
    )
    output.add_argument(
        "--save-every",
        type=_non_negative,
        default=0,
        metavar="N",
        help="checkpoint every N steps and at the end (default 0: never)",
    )
    output.add_argument(
        "--resume",
        type=Path,
        metavar="DIR",
        help="continue a run exactly from a run folder (its newest checkpoint) or a checkpoint "
        "folder; only --out, --steps and --save-every may be changed",
    )
    output.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar"
    )


def build_parser(prog: str = "onebit train") -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog,
        description="Train a small byte-level language model with several data-parallel workers "
        "and a 1-bit optimizer; write metrics, a summary and plots.",
    )
    add_train_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    """The ``onebit`` console script: ``onebit train [options]``."""
    parser = _Parser(prog="onebit", description="1-bit optimizers for torch.distributed.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train_parser = commands.add_parser(
        "train", help="train a model with several workers", description=build_parser().description
    )
    add_train_arguments(train_parser)
    args = parser.parse_args(argv)
    sys.exit(run(args, train_parser.prog))


def train_main(argv: list[str] | None = None) -> None:
    """``python -m onebit.train [options]``, as under ``torchrun``."""
    parser = build_parser("python -m onebit.train")
    sys.exit(run(parser.parse_args(argv), parser.prog))


def run(args: argparse.Namespace, prog: str) -> int:
    """Check everything, then train; return the exit status."""
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        _require_extras()
        configs, resume, workers = resolve(args, torchrun)
    except (UsageError, DataError, optim.OptimizerUnavailable) as err:
        if not torchrun or os.environ.get("RANK") == "0":
            print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    from .loop import spawn_worker, torchrun_worker

    if torchrun:
        torchrun_worker(configs, resume)
        return 0
    import torch.multiprocessing as mp

    where = configs[0].out if len(configs) == 1 else str(Path(configs[0].out).parent)
    print(f"{prog}: {workers} workers, results in {where}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.start_processes(
                spawn_worker,
                args=(workers, f"{tmp}/store", configs, resume),
                nprocs=workers,
                start_method="spawn",
            )
        except KeyboardInterrupt:
            print(f"{prog}: interrupted", file=sys.stderr)
            return 130
    return 0


def _require_extras() -> None:
    missing = []
    for module in ("tqdm", "matplotlib"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise UsageError(f"onebit train needs {' and '.join(missing)}: pip install 'onebit[train]'")


def resolve(args: argparse.Namespace, torchrun: bool) -> tuple[list[RunConfig], str | None, int]:
    """Turn the options into run configurations; return (configs, checkpoint to resume, workers).

    Raises :class:`UsageError` or :class:`DataError` with a one-line message.
    """
    world_size = int(os.environ["WORLD_SIZE"]) if torchrun else args.workers or DEFAULT_WORKERS
    if torchrun and args.workers is not None and args.workers != world_size:
        raise UsageError(f"--workers {args.workers} but torchrun started {world_size} ranks")
    if args.resume is not None:
        return _resume(args, torchrun, world_size)
    if args.compare and args.optimizer:
        raise UsageError("give either --optimizer or --compare, not both")
    runs = (
        _parse_compare(args.compare) if args.compare else [(args.optimizer or "onebit-adam", True)]
    )
    for name, _ in runs:
        optim.optimizer_class(name)
    if not args.error_feedback and not any(optim.is_compressed(n) for n, _ in runs):
        raise UsageError("--no-error-feedback applies only to the 1-bit optimizers")
    dataset = prepare(args.data, _cache_dir(args))
    dataset.check_context(args.block_size)
    if args.width % args.heads:
        raise UsageError(f"--width {args.width} is not a multiple of --heads {args.heads}")
    steps = args.steps or DEFAULT_STEPS
    # Under torchrun every rank must pick the same folder, so no time stamp there.
    stamp = "" if torchrun else time.strftime("-%Y%m%d-%H%M%S")
    if args.compare:
        root = args.out or Path("runs") / f"compare-{args.model}{stamp}"
    configs = []
    for name, error_feedback in runs:
        error_feedback = error_feedback and args.error_feedback and optim.is_compressed(name)
        label = name if error_feedback or not optim.is_compressed(name) else f"{name}-no-ef"
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
                batch_size=args.batch_size,
                block_size=args.block_size,
                n_layer=args.layers,
                n_head=args.heads,
                n_embd=args.width,
                lr=args.lr or optim.default_lr(name),
                warmup_steps=max(1, steps // 20),
                weight_decay=args.weight_decay,
                freeze_step=args.freeze_step,
                bucket_size=args.bucket_size,
                local_step_scaler=args.local_step_scaler,
                error_feedback=error_feedback,
                eval_every=args.eval_every or max(1, steps // 20),
                eval_windows=args.eval_windows,
                seed=args.seed,
                save_every=args.save_every,
                progress=args.progress,
            )
        )
    return configs, None, world_size


def _cache_dir(args: argparse.Namespace) -> Path:
    if args.cache_dir is not None:
        return args.cache_dir
    if os.environ.get("ONEBIT_CACHE"):
        return Path(os.environ["ONEBIT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "onebit"


def _parse_compare(text: str) -> list[tuple[str, bool]]:
    runs = []
    for item in text.split(","):
        name, _, variant = item.strip().partition(":")
        if name not in optim.OPTIMIZERS:
            raise UsageError(
                f"unknown optimizer {name!r} in --compare "
                f"(choose from {', '.join(optim.OPTIMIZERS)})"
            )
        if variant not in ("", "no-ef"):
            raise UsageError(f"unknown variant {variant!r} of {name} in --compare (only no-ef)")
        if variant and not optim.is_compressed(name):
            raise UsageError(f"{name} has no error feedback to drop ({item} in --compare)")
        runs.append((name, not variant))
    if len(set(runs)) != len(runs):
        raise UsageError(f"--compare lists a run twice: {text}")
    return runs


_RESUME_MAY_CHANGE = {
    "command",
    "out",
    "steps",
    "save_every",
    "resume",
    "workers",
    "progress",
    "cache_dir",
}


def _resume(
    args: argparse.Namespace, torchrun: bool, world_size: int
) -> tuple[list[RunConfig], str, int]:
    given = [
        name
        for name, value in vars(args).items()
        if name not in _RESUME_MAY_CHANGE and value != build_parser().get_default(name)
    ]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise UsageError(f"--resume continues the saved run: {flags} cannot be changed")
    path = args.resume
    if (path / "complete").exists():
        checkpoint = path
    elif (path / "config.json").exists():
        checkpoint = latest_checkpoint(path)
        if checkpoint is None:
            raise UsageError(f"{path} has no complete checkpoint (train with --save-every N)")
    else:
        raise UsageError(f"{path} is neither a run folder nor a checkpoint folder")
    run_dir = checkpoint.parent.parent
    config = RunConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
    saved_world = int((checkpoint / "complete").read_text())
    if args.workers is None and not torchrun:
        world_size = saved_world
    if world_size != saved_world:
        raise UsageError(
            f"the checkpoint was saved by {saved_world} workers, not {world_size}: "
            "error-feedback buffers are per rank"
        )
    if not (Path(config.data) / "train.bin").exists():
        raise UsageError(f"the run's data {config.data} is gone; it cannot be resumed exactly")
    step = int(checkpoint.name.removeprefix("step_"))
    assert checkpoint == checkpoint_dir(run_dir, step)
    config.out = str(args.out or run_dir)
    config.steps = args.steps or config.steps
    if config.steps <= step:
        raise UsageError(f"the checkpoint is at step {step}: nothing left of {config.steps} steps")
    config.save_every = args.save_every or config.save_every
    config.progress = args.progress
    return [config], str(checkpoint), world_size
