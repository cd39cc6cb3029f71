"""``onebit train``'s options: the parser, the checks of each value, and ``--compare``'s runs.
Every mistake ends in a one-line error and exit status 2."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onebit

from . import loggers, optim
from .model import MODELS

DEFAULT_STEPS = 300
DEFAULT_WORKERS = 4
DEVICES = ("auto", "cpu", "cuda")


class UsageError(Exception):
    """Bad input; the message is printed as one line."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line and exit status 2."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, got {value}")
        return value

    return parse


_positive = _integer(1)
_non_negative = _integer(0)


def _number(low: float, *, inclusive: bool) -> Callable[[str], float]:
    """An argparse type: a finite number above ``low`` (or equal to it if ``inclusive``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value < low or (value == low and not inclusive):
            bound = "at least" if inclusive else "above"
            raise argparse.ArgumentTypeError(f"must be {bound} {low:g}, got {text}")
        return value

    return parse


def _freeze_step(text: str) -> int | str:
    return "auto" if text == "auto" else _positive(text)


def _resume(text: str) -> Path | str:
    return AUTO if text == AUTO else Path(text)


def _log(text: str) -> tuple[str, ...]:
    try:
        return loggers.parse_backends(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


AUTO = "auto"
SEED_MAX = 2**32 - 1


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``onebit train``."""
    run = parser.add_argument_group("run")
    run.add_argument(
        "--optimizer",
        choices=optim.OPTIMIZERS,
        help="default onebit-adam; adamw is torch.optim.AdamW with DistributedDataParallel (with "
        "--shard, FSDP2's HSDP), lamb is uncompressed LAMB",
    )
    run.add_argument(
        "--workers",
        type=_positive,
        metavar="N",
        help=f"local worker processes (default: one per GPU on cuda, else {DEFAULT_WORKERS}); "
        "under torchrun, leave it out or give the number of ranks torchrun started",
    )
    run.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="auto (default): cuda when torch.cuda.is_available(), else cpu. On cuda each worker "
        "takes a GPU of its own and the workers talk over NCCL; on cpu, over gloo",
    )
    run.add_argument(
        "--steps", type=_positive, metavar="N", help=f"optimizer steps (default {DEFAULT_STEPS})"
    )
    run.add_argument(
        "--batch-size", type=_positive, default=16, metavar="N", help="sequences per worker (16)"
    )
    run.add_argument(
        "--lr",
        type=_number(0, inclusive=False),
        help="peak learning rate, reached after a linear warmup over the first 5%% of --steps, "
        "then a cosine decay to a tenth of it (default 1e-3; lamb and onebit-lamb 1e-2)",
    )
    run.add_argument(
        "--weight-decay",
        type=_number(0, inclusive=True),
        default=0.1,
        metavar="WD",
        help="decoupled, on weight matrices and convolution kernels only, not on biases, "
        "LayerNorms or position embeddings (0.1)",
    )
    run.add_argument(
        "--amp",
        choices=("bf16", "fp16"),
        help="autocast the forward pass to bf16, or to fp16 with a GradScaler (default: fp32)",
    )
    run.add_argument(
        "--grad-clip",
        type=_number(0, inclusive=False),
        metavar="NORM",
        help="clip the gradients to this global norm: the averaged gradient on full-precision "
        "steps, each rank's own gradient on the 1-bit optimizers' compressed steps (default: "
        "no clipping)",
    )
    run.add_argument(
        "--shard",
        type=_positive,
        default=1,
        metavar="S",
        help="FSDP2: shard the model over S ranks per emulated node, the other ranks being "
        "replicas; adamw is torch's HSDP, the other optimizers average each shard across nodes "
        "themselves "
        "(default 1: every rank holds the whole model)",
    )
    run.add_argument(
        "--freeze-step",
        type=_freeze_step,
        metavar="N|auto",
        help="warmup steps of onebit-adam and onebit-lamb (default auto, the library's: watch "
        "Adam's variance and freeze it once stable, by step 100 at the latest), and "
        "zero-one-adam's var_freeze_step (default 20%% of --steps)",
    )
    run.add_argument(
        "--warmup-compression",
        choices=optim.WARMUP_COMPRESSION,
        help="onebit-adam, onebit-lamb: how the warmup averages gradients (fp32: an fp32 "
        "allreduce, exactly AdamW + DDP or LAMB; bf16, int8, int4: 2, 4 and 8 times fewer bytes, "
        f"with error feedback; default {optim.DEFAULT_WARMUP_COMPRESSION})",
    )
    run.add_argument(
        "--error-dtype",
        choices=tuple(optim.ERROR_DTYPES),
        help="onebit-adam, onebit-lamb, zero-one-adam: the dtype of the error-feedback buffers "
        "(bf16: half their memory; default fp32)",
    )
    run.add_argument(
        "--bucket-size",
        type=_positive,
        default=optim.DEFAULT_BUCKET_SIZE,
        metavar="N",
        help=f"elements per 1-bit bucket ({optim.DEFAULT_BUCKET_SIZE}, the library's default)",
    )
    run.add_argument(
        "--local-step-scaler",
        type=_positive,
        metavar="N",
        help="zero-one-adam: phase-B steps between doublings of its local-step interval, which "
        "then grows up to 16 (default: onebit.zero_one_adam.run_schedule sizes it to the run: "
        "the interval grows to the largest power of two at most 1/200 of phase B, at most 16, "
        "doubling in equal parts of phase B; a phase B under 400 steps, as the default run's "
        "240, keeps it at 1, a sync every step)",
    )
    run.add_argument(
        "--seed",
        type=_integer(0, SEED_MAX),
        default=0,
        help="model init, data order and BERT's masks (0)",
    )
    run.add_argument(
        "--compare",
        metavar="OPT,OPT,...",
        help=_compare_help(),
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
        choices=MODELS,
        default="gpt",
        help="gpt: causal byte-level transformer LM; bert: masked LM, the papers' workload; cnn: "
        "causal convolutional LM, without attention; rnn: an LSTM LM (gpt)",
    )
    model.add_argument(
        "--block-size", type=_positive, default=128, metavar="N", help="context in bytes (128)"
    )
    model.add_argument(
        "--layers",
        type=_positive,
        default=4,
        metavar="N",
        help="transformer blocks, convolutional blocks or LSTM layers (4)",
    )
    model.add_argument(
        "--heads",
        type=_positive,
        default=4,
        metavar="N",
        help="attention heads, which must divide --width; cnn and rnn have none (4)",
    )
    model.add_argument(
        "--width", type=_positive, default=128, metavar="N", help="embedding width (128)"
    )
    model.add_argument(
        "--no-bias",
        dest="bias",
        action="store_false",
        help="no biases in the model's layers and LayerNorms (as nanoGPT's bias=False)",
    )
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
        help="where the train/validation split is kept (default $ONEBIT_CACHE, else "
        "$XDG_CACHE_HOME/onebit, else ~/.cache/onebit)",
    )
    output = parser.add_argument_group("output and checkpoints")
    output.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="run folder (default runs/<model>-<run name>-<date>-<time>, without the date and "
        "time under torchrun and with --resume auto; --compare: runs/compare-<model>-<date>-"
        "<time>, a folder per row inside)",
    )
    output.add_argument(
        "--eval-every",
        type=_positive,
        metavar="N",
        help="steps between validation losses, and one at the last step (default 5%% of --steps)",
    )
    output.add_argument(
        "--eval-windows",
        type=_positive,
        default=256,
        metavar="N",
        help="validation sequences, shared out among the workers (256)",
    )
    output.add_argument(
        "--save-every",
        type=_non_negative,
        default=0,
        metavar="N",
        help="checkpoint every N steps and at the end (default 0: never)",
    )
    output.add_argument(
        "--keep",
        type=_positive,
        metavar="K",
        help="keep the newest K checkpoints, delete older ones (default 3)",
    )
    output.add_argument(
        "--resume",
        type=_resume,
        metavar="DIR|auto",
        help="continue a run exactly from a run folder (its newest usable checkpoint) or a "
        "checkpoint folder; only --out, --steps, --save-every, --keep, --log, --max-restarts, "
        "--device, --cache-dir and --no-progress may be given (--workers only as the "
        "checkpoint's). auto: continue the run in --out if it has a checkpoint, else start it, "
        "so that the same command starts a run and continues it after a crash (its other "
        "settings must be the run's)",
    )
    output.add_argument(
        "--max-restarts",
        type=_non_negative,
        default=0,
        metavar="N",
        help="if a local worker dies, stop the others and start them all again from the newest "
        "usable checkpoint, up to N times (needs --save-every; under torchrun use torchrun's "
        "--max-restarts and --resume auto)",
    )
    output.add_argument(
        "--log",
        type=_log,
        default=("jsonl",),
        metavar="jsonl,csv,tensorboard,wandb",
        help="where rank 0 logs each step's metrics, any combination (jsonl, which the summary "
        "and --resume read, is always written)",
    )
    output.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar"
    )


TRAIN_DESCRIPTION = (
    "Train a small byte-level language model with several data-parallel workers and a 1-bit "
    "optimizer; write metrics, a summary and plots."
)


def build_parser(prog: str = "onebit train") -> argparse.ArgumentParser:
    """The parser of ``onebit train``'s options, as ``prog``."""
    parser = Parser(prog=prog, description=TRAIN_DESCRIPTION)
    add_train_arguments(parser)
    return parser


def build_main_parser() -> argparse.ArgumentParser:
    """The ``onebit`` console script's parser: ``--version``, and the ``train`` command with
    :func:`add_train_arguments`'s options. Without a command ``args.command`` is ``None``."""
    parser = Parser(prog="onebit", description="1-bit optimizers for torch.distributed.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {onebit.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = commands.add_parser(
        "train", help="train a model with several workers", description=TRAIN_DESCRIPTION
    )
    add_train_arguments(train)
    return parser


@dataclass(frozen=True)
class Variant:
    """One run of ``--compare``:
    ``OPT[:no-ef][:warmup=BITS][:errors=DTYPE][:freeze=N|auto][:local=N][:varscale=N]
    [:clipper=N]``."""

    name: str
    error_feedback: bool = True
    warmup: str | None = None
    errors: str | None = None
    freeze_step: int | str | None = None
    local_step_scaler: int | None = None
    var_update_scaler: int | None = None
    local_step_clipper: int | None = None

    def label(self, error_feedback: bool, warmup: str, errors: str = "fp32") -> str:
        """The run's folder and row name: the optimizer, then what differs from its defaults."""
        parts = [self.name]
        if optim.is_compressed(self.name) and not error_feedback:
            parts.append("no-ef")
        if self.name in optim.WARMUP_COMPRESSED and warmup != optim.DEFAULT_WARMUP_COMPRESSION:
            parts.append(f"warmup-{warmup}")
        if optim.is_compressed(self.name) and errors != "fp32":
            parts.append(f"errors-{errors}")
        if self.freeze_step is not None:
            parts.append(f"freeze-{self.freeze_step}")
        if self.local_step_scaler is not None:
            parts.append(f"local-{self.local_step_scaler}")
        if self.var_update_scaler is not None:
            parts.append(f"varscale-{self.var_update_scaler}")
        if self.local_step_clipper is not None:
            parts.append(f"clipper-{self.local_step_clipper}")
        return "-".join(parts)


def _flag(text: str | None) -> bool | None:
    """A setting without a value (``:no-ef``): ``False``, the field's new value."""
    return False if text is None else None


def _choice(choices: tuple[str, ...]) -> Callable[[str | None], str | None]:
    def parse(text: str | None) -> str | None:
        return text if text in choices else None

    return parse


def _count(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() and int(text) > 0 else None


def _freeze(text: str | None) -> int | str | None:
    return "auto" if text == "auto" else _count(text)


@dataclass(frozen=True)
class RowSetting:
    """A setting one ``--compare`` row may add after its optimizer's name: ``:KEY`` or
    ``:KEY=VALUE``.

    Attributes:
        key: what the row writes before ``=``.
        syntax: how the setting is written, values included, for the help and the errors.
        field: the :class:`Variant` field it sets.
        parse: the field's value for the text after ``=`` (``None`` when there is no ``=``), or
            ``None`` if the text is not one of its values.
        meaning: what it sets, for the help.
        optimizers: the optimizers that take it (for the others it is an unknown variant).
    """

    key: str
    syntax: str
    field: str
    parse: Callable[[str | None], Any]
    meaning: str
    optimizers: tuple[str, ...]


ROW_SETTINGS = (
    RowSetting(
        "no-ef", "no-ef", "error_feedback", _flag, "no error feedback", tuple(optim.REFERENCE)
    ),
    RowSetting(
        "warmup",
        f"warmup={'|'.join(optim.WARMUP_COMPRESSION)}",
        "warmup",
        _choice(optim.WARMUP_COMPRESSION),
        "--warmup-compression",
        optim.WARMUP_COMPRESSED,
    ),
    RowSetting(
        "errors",
        f"errors={'|'.join(optim.ERROR_DTYPES)}",
        "errors",
        _choice(tuple(optim.ERROR_DTYPES)),
        "--error-dtype",
        tuple(optim.REFERENCE),
    ),
    RowSetting(
        "freeze", "freeze=N|auto", "freeze_step", _freeze, "--freeze-step", tuple(optim.REFERENCE)
    ),
    RowSetting(
        "local", "local=N", "local_step_scaler", _count, "--local-step-scaler", ("zero-one-adam",)
    ),
    RowSetting(
        "varscale",
        "varscale=N",
        "var_update_scaler",
        _count,
        "var_update_scaler, the variance updates between doublings of phase A's interval",
        ("zero-one-adam",),
    ),
    RowSetting(
        "clipper",
        "clipper=N",
        "local_step_clipper",
        _count,
        "local_step_clipper, the longest interval between phase B's syncs",
        ("zero-one-adam",),
    ),
)
"""Every setting a ``--compare`` row may add: :func:`parse_compare` reads them from here and
``--compare``'s help lists them."""


def _compare_help() -> str:
    every = tuple(optim.REFERENCE)
    settings = []
    for setting in ROW_SETTINGS:
        which = "" if setting.optimizers == every else f"; {', '.join(setting.optimizers)}"
        settings.append(f"{setting.syntax} ({setting.meaning}{which})")
    return (
        "OPT is one of " + ", ".join(optim.OPTIMIZERS) + ". Run each in turn with the same seed "
        "and data order, then write comparison.md, comparison.json and comparison.png. A row of "
        "a 1-bit optimizer may add settings of its own, each after a colon, as in "
        "onebit-adam:warmup=fp32:freeze=120; they win over the flags for that row: "
        + ", ".join(settings)
        + ". A row's folder and name are the optimizer and what differs from the defaults"
    ).replace("%", "%%")


def parse_compare(text: str) -> list[Variant]:
    """The runs ``--compare`` lists; :class:`UsageError` for a name or variant it cannot run."""
    settings_by_key = {setting.key: setting for setting in ROW_SETTINGS}
    runs = []
    for item in text.split(","):
        name, *variants = item.strip().split(":")
        if name not in optim.OPTIMIZERS:
            raise UsageError(
                f"unknown optimizer {name!r} in --compare "
                f"(choose from {', '.join(optim.OPTIMIZERS)})"
            )
        settings: dict[str, Any] = {}
        for variant in variants:
            if not optim.is_compressed(name):
                raise UsageError(f"{name} has no variants ({item} in --compare)")
            key, equals, value = variant.partition("=")
            setting = settings_by_key.get(key)
            parsed = None if setting is None else setting.parse(value if equals else None)
            if parsed is None or name not in setting.optimizers:
                takes = ", ".join(s.syntax for s in ROW_SETTINGS if name in s.optimizers)
                raise UsageError(
                    f"unknown variant {variant!r} of {name} in --compare ({name} takes {takes})"
                )
            settings[setting.field] = parsed
        runs.append(Variant(name, **settings))
    if len(set(runs)) != len(runs):
        raise UsageError(f"--compare lists a run twice: {text}")
    return runs
