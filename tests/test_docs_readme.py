"""The README and docs/ stay true: every Python block marked ``runnable`` runs on 2 gloo ranks,
and every default the README's tables state is the code's."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
from distributed import run_script

import onebit

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RANKS = 2
TIMEOUT_S = 120
DONE = "runnable block: done"
GLOO_TEARDOWN = "terminate called without an active exception"


def runnable_blocks() -> list[tuple[str, str]]:
    """``(where, code)`` of every fenced block whose info string is ``python runnable``."""
    blocks = []
    for path in DOCS:
        text = path.read_text()
        for match in re.finditer(r"^```python runnable\n(.*?)^```", text, re.M | re.S):
            line = text.count("\n", 0, match.start()) + 1
            blocks.append((f"{path.relative_to(ROOT)}:{line}", match.group(1)))
    return blocks


BLOCKS = runnable_blocks()


def test_the_readme_has_runnable_blocks():
    readme = [where for where, _ in BLOCKS if where.startswith("README.md")]
    assert len(readme) >= 3, readme


@pytest.mark.slow  # each block is a script on 2 ranks, as a user runs it
@pytest.mark.parametrize("where, code", BLOCKS, ids=[where for where, _ in BLOCKS])
def test_a_runnable_block_runs_on_two_gloo_ranks(where, code, tmp_path):
    """As ``torchrun --nproc-per-node 2`` would start it, in one working directory with the
    environment torchrun sets, each rank forked from a server that imported torch and onebit
    (:func:`distributed.run_script`).

    A rank that ran the whole block may still abort as it exits, with "terminate called without
    an active exception": a gloo worker thread dropping a finished collective
    (pytorch/pytorch#179291, see ``onebit.train.launch.close_process_group``). That, and only
    after the block's last line ran, is tolerated."""
    script = tmp_path / "block.py"
    script.write_text(code + f"\nprint({DONE!r}, flush=True)\n")
    env = {"CUDA_VISIBLE_DEVICES": ""}
    ran = run_script(script, ranks=RANKS, timeout=TIMEOUT_S, cwd=tmp_path, env=env)
    for rank, (returncode, out) in enumerate(ran):
        torn_down = DONE in out and out.rstrip().endswith(GLOO_TEARDOWN)
        assert returncode == 0 or torn_down, f"{where}, rank {rank}:\n{out}"
        assert DONE in out, f"{where}, rank {rank}:\n{out}"


def markdown_table(text: str, header: str) -> list[list[str]]:
    """The rows of the table whose header line starts with ``header``, as stripped cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


OPTIMIZERS = {c.__name__: c for c in (onebit.OnebitAdam, onebit.OnebitLamb, onebit.ZeroOneAdam)}


def test_the_readme_argument_defaults_are_the_signatures():
    rows = markdown_table((ROOT / "README.md").read_text(), "| argument | default |")
    assert len(rows) >= 8
    for name, default, which, _ in rows:
        name = name.strip("`")
        named = OPTIMIZERS.keys() if which == "all" else which.split(", ")
        classes = [OPTIMIZERS[w] for w in named]
        for cls in classes:
            parameter = inspect.signature(cls).parameters[name]
            if default == "required":
                assert parameter.default is inspect.Parameter.empty, (cls.__name__, name)
            else:
                stated = eval(default.strip("`"), {"torch": torch})
                assert stated == parameter.default, (cls.__name__, name, stated)
        others = set(OPTIMIZERS.values()) - set(classes)
        for cls in others:  # "OnebitAdam" means only OnebitAdam takes it
            assert name not in inspect.signature(cls).parameters, (cls.__name__, name)
