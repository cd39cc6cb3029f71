"""docs/deepspeed.md agrees with the DeepSpeed translator: its key table is the translator's,
its optimizer types are the ones it accepts, and its before and after use the same config."""

from __future__ import annotations

import json
import re
from pathlib import Path

import onebit
from onebit.integrations.deepspeed import KEY_MAP, OPTIMIZERS, mapping_table, translate_config

DOC = Path(__file__).resolve().parents[1] / "docs" / "deepspeed.md"


def _section(title: str) -> str:
    text = DOC.read_text(encoding="utf-8")
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"docs/deepspeed.md has no section {title!r}"
    return match.group(1)


def _table(section: str) -> list[str]:
    return [line for line in section.splitlines() if line.startswith("|")]


def _key_rows() -> list[str]:
    return _table(_section("How the keys translate"))[2:]


def test_every_key_the_translator_knows_is_in_the_table_and_no_other():
    documented = [k for row in _key_rows() for k in re.findall(r"`(\w+)`", row.split("|")[1])]
    assert len(documented) == len(set(documented)), "a key appears in two rows"
    assert set(documented) == set(KEY_MAP), (
        f"missing from the table: {sorted(set(KEY_MAP) - set(documented))}; "
        f"unknown to the translator: {sorted(set(documented) - set(KEY_MAP))}"
    )


def test_the_table_says_what_the_translator_does():
    """Each row as ``mapping_table()`` writes it from ``KEY_MAP``: a rule changed in the code
    fails here until the page has the new row."""
    assert _key_rows() == mapping_table().splitlines()[2:], (
        "paste the output of onebit.integrations.deepspeed.mapping_table() into "
        "docs/deepspeed.md's key table"
    )


def test_the_accepted_types_are_the_translators():
    rows = _table(_section("Accepted optimizer types"))[2:]
    documented = dict(re.findall(r'^\| `"(\w+)"` \| `onebit\.(\w+)` \|$', "\n".join(rows), re.M))
    assert len(documented) == len(rows)
    assert {t: getattr(onebit, c) for t, c in documented.items()} == OPTIMIZERS
    for ds_type in OPTIMIZERS:
        assert translate_config({"type": ds_type.lower()}).optimizer_class is OPTIMIZERS[ds_type]


def test_before_and_after_use_the_same_config():
    text = _section("Before and after")
    before = re.search(r"```json\n(.*?)```", text, re.S)
    after = re.search(r'```python runnable\n.*?DS_CONFIG = """(.*?)"""', text, re.S)
    assert before and after
    config = json.loads(before.group(1))
    assert json.loads(after.group(1)) == config
    translated = translate_config(config)
    assert translated.optimizer_class is onebit.OnebitAdam and translated.notes == []
    # What the after script asserts, and the page says, of the translation.
    assert translated.kwargs["freeze_step"] == config["optimizer"]["params"]["freeze_step"] - 1
    assert translated.kwargs["max_grad_norm"] == config["gradient_clipping"]
    kwargs = translated.kwargs
    stated = f"freeze_step == {kwargs['freeze_step']} and optimizer.max_grad_norm == "
    assert f"assert optimizer.{stated}{kwargs['max_grad_norm']}\n" in text


def test_the_stated_deepspeed_defaults_are_the_translators():
    text = DOC.read_text(encoding="utf-8")
    assert "`freeze_step` is 100000" in text and KEY_MAP["freeze_step"].default == 100000
    assert "DeepSpeed's default 32678" in text and KEY_MAP["local_step_scaler"].default == 32678
