"""``docs/cli.md`` against the ``onebit`` command it documents, and the command's own help.

The flag tables of ``docs/cli.md`` (and the README's short one) are the markdown tables whose
header is ``| flag | default | meaning |``. In each row:

* the flag cell is ``` `--flag` ``` or ``` `--flag VALUE` ```;
* the default cell is ``off`` for a flag without a value; or it starts with a value in
  backticks, the default as one would type it, followed by anything; or it is words only,
  for a default the parser leaves unset and the run works out. A backticked value must be the
  parser's default, parsed by the flag's own type; where the parser's default is unset, it
  must be what the default run gets (:data:`RESOLVED`).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed.run import get_args_parser as torchrun_parser

import onebit
from onebit.train import arguments, cli, loop, optim
from onebit.train.arguments import DEFAULT_STEPS, ROW_SETTINGS, UsageError, parse_compare

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "cli.md"
TABLE_HEADER = "| flag | default | meaning |"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
OTHER_COMMANDS = ("tensorboard --logdir",)
"""Other programs' flags the doc names outside a ``torchrun`` command."""

RESOLVED: dict[str, Callable[[cli.Plan], Any]] = {
    "optimizer": lambda plan: plan.configs[0].optimizer,
    "workers": lambda plan: plan.workers,
    "steps": lambda plan: plan.configs[0].steps,
    "lr": lambda plan: plan.configs[0].lr,
    "freeze_step": lambda plan: plan.configs[0].freeze_step,
    "warmup_compression": lambda plan: plan.configs[0].warmup_compression,
    "error_dtype": lambda plan: plan.configs[0].error_dtype,
    "keep": lambda plan: plan.configs[0].keep,
    "eval_every": lambda plan: plan.configs[0].eval_every,
}
"""What the default run gets for a flag whose parser default is unset."""


def doc() -> str:
    return DOC.read_text()


def train_actions() -> dict[str, argparse.Action]:
    """Each option string of ``onebit train``'s parser, and its action."""
    return {s: a for a in arguments.build_parser()._actions for s in a.option_strings}


def flag_rows(text: str | None = None) -> list[tuple[str, str]]:
    """``(flag, default cell)`` of every row of the flag tables of ``text`` (the doc), in order."""
    rows, in_table = [], False
    for line in (doc() if text is None else text).splitlines():
        if line.strip() == TABLE_HEADER:
            in_table = True
            continue
        if not in_table or not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if set(cells[0]) <= {"-", " "}:
            continue  # the separator row
        match = re.fullmatch(r"`(--[a-z0-9-]+)(?: [^`]+)?`", cells[0])
        assert match, f"a flag cell must be `--flag` or `--flag VALUE`: {cells[0]!r}"
        rows.append((match.group(1), cells[1]))
    return rows


def torchrun_commands() -> list[str]:
    """The ``torchrun`` commands of the doc's code blocks, continuation lines joined."""
    text = doc().replace("\\\n", " ")
    return [line for line in text.splitlines() if line.lstrip().startswith("torchrun ")]


def test_every_flag_of_onebit_train_is_documented() -> None:
    named = set(FLAG.findall(doc()))
    missing = [s for s in train_actions() if s.startswith("--") and s not in named]
    assert not missing, f"docs/cli.md never names {missing}"


def test_every_flag_the_doc_names_exists() -> None:
    ours = set(train_actions()) | {
        s for a in arguments.build_main_parser()._actions for s in a.option_strings
    }
    theirs = {s for a in torchrun_parser()._actions for s in a.option_strings}
    text = doc().replace("\\\n", " ")
    for command in torchrun_commands():
        own, _, onebit_part = command.partition("-m onebit.train")
        assert onebit_part, f"a torchrun command that does not start onebit.train: {command}"
        unknown = set(FLAG.findall(own)) - theirs
        assert not unknown, f"torchrun has no {unknown}: {command}"
        text = text.replace(own, "")  # torchrun's own flags are checked; the rest must be ours
    for other in OTHER_COMMANDS:
        text = text.replace(other, "")
    unknown = sorted(set(FLAG.findall(text)) - ours)
    assert not unknown, f"docs/cli.md names flags onebit does not have: {unknown}"


def test_the_flag_tables_hold_every_flag_once() -> None:
    flags = [flag for flag, _ in flag_rows()]
    assert len(flags) == len(set(flags)), "a flag has two rows"
    expected = {a.option_strings[-1] for a in arguments.build_parser()._actions}
    assert set(flags) == expected - {"--help"}


@pytest.mark.parametrize("page", [DOC, ROOT / "README.md"], ids=lambda p: p.name)
def test_the_flag_tables_state_the_parser_defaults(page: Path, tmp_path: Path) -> None:
    actions = train_actions()
    (tmp_path / "text.txt").write_text("some text to train on. " * 4000)
    args = arguments.build_parser().parse_args(
        ["--device", "cpu", "--data", str(tmp_path / "text.txt"),
         "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "out")]
    )  # fmt: skip
    plan = cli.resolve(args, torchrun=False, warn=print)
    rows = flag_rows(page.read_text())
    assert rows, f"{page.name} has no flag table"
    for flag, cell in rows:
        action = actions[flag]
        if action.nargs == 0:
            assert cell == "off", f"{flag} takes no value: its default is `off`, not {cell!r}"
            continue
        stated = re.match(r"`([^`]*)`", cell)
        if stated is None:
            assert action.default is None, f"{flag}: state its default {action.default!r}"
            continue
        value = action.type(stated.group(1)) if action.type else stated.group(1)
        if action.default is not None:
            assert value == action.default, f"{flag}: the doc says {value!r}"
        else:
            assert action.dest in RESOLVED, f"{flag}: what does the default run get?"
            assert value == RESOLVED[action.dest](plan), f"{flag}: the default run differs"


def test_onebit_version_prints_the_version(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"onebit {onebit.__version__}\n"
    assert f'"onebit {onebit.__version__}"' in doc()


def test_onebit_without_a_command_prints_its_help(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 0
    printed = capsys.readouterr()
    assert printed.out.startswith("usage: onebit") and "train" in printed.out
    assert printed.err == ""


def test_compare_help_and_doc_name_every_row_setting() -> None:
    (action,) = [a for a in arguments.build_parser()._actions if a.dest == "compare"]
    help_text = " ".join(action.help.split())
    for setting in ROW_SETTINGS:
        assert setting.syntax in help_text, f"--compare's help leaves out {setting.syntax}"
        assert f"`{setting.syntax.replace('|', chr(92) + '|')}`" in doc(), setting.syntax


@pytest.mark.parametrize("setting", ROW_SETTINGS, ids=lambda s: s.key)
def test_each_row_setting_is_what_the_row_parser_reads(setting: arguments.RowSetting) -> None:
    """The table drives the parser: each setting sets its field for the optimizers it names
    and is refused by the other 1-bit optimizers."""
    _, equals, values = setting.syntax.partition("=")
    example = values.split("|")[0].replace("N", "3")
    written = f"{setting.key}={example}" if equals else setting.key
    for name in optim.REFERENCE:
        if name in setting.optimizers:
            (row,) = parse_compare(f"{name}:{written}")
            assert getattr(row, setting.field) == setting.parse(example if equals else None)
            assert getattr(row, setting.field) != getattr(arguments.Variant(name), setting.field)
        else:
            with pytest.raises(UsageError, match=name):
                parse_compare(f"{name}:{written}")


def test_the_doc_states_where_the_default_run_freezes() -> None:
    """Where the learning rate of the default run first lies ``lr_drop`` below its peak, from
    the rule's ``min_step`` on: the library's rule, which ``onebit train`` runs untold."""
    knobs = onebit.AutoFreeze()
    config = SimpleNamespace(
        lr=1.0, warmup_steps=DEFAULT_STEPS // 20, horizon=lambda: DEFAULT_STEPS
    )
    lrs = [loop.lr_at(step, config) for step in range(1, DEFAULT_STEPS + 1)]
    step = next(
        t
        for t in range(knobs.first_step, DEFAULT_STEPS + 1)
        if lrs[t - 1] <= (1 - knobs.lr_drop) * max(lrs[:t])
    )
    assert f"the run freezes there, at step {step}" in " ".join(doc().split())
