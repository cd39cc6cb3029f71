"""docs/api.md: it is what ``python docs/make_api.py`` writes from the code as it is, and it has a
section for every public name."""

from __future__ import annotations

import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import onebit

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api.md"
INTEGRATIONS = ["transformers", "accelerate", "lightning", "deepspeed"]


def _generator():
    spec = importlib.util.spec_from_file_location("make_api", ROOT / "docs" / "make_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _frameworks() -> None:
    """The integration modules import their frameworks: without them the page cannot be made."""
    for framework in ("transformers", "accelerate", "lightning", "torchtitan"):
        pytest.importorskip(framework)


def _headings() -> set[str]:
    return set(re.findall(r"^#{2,4} `([^`]+)`$", API.read_text(encoding="utf-8"), flags=re.M))


@pytest.mark.slow
def test_api_md_is_what_the_generator_writes():
    """In a fresh interpreter, as a user runs it: other tests in this process may have imported
    or patched modules in ways that change what the generator sees."""
    _frameworks()
    check = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "make_api.py"), "--check"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr


def test_check_flag_fails_on_a_stale_page(tmp_path, monkeypatch, capsys):
    _frameworks()
    make_api = _generator()
    stale = tmp_path / "api.md"
    stale.write_text(API.read_text(encoding="utf-8").replace("freeze_step", "freeze_steps"))
    monkeypatch.setattr(make_api, "OUTPUT", stale)
    assert make_api.main(["--check"]) == 1
    assert "run `python docs/make_api.py`" in capsys.readouterr().err
    assert make_api.main([]) == 0 and make_api.main(["--check"]) == 0


def test_every_public_name_has_a_section():
    _frameworks()
    headings = _headings()
    names = [f"onebit.{n}" for n in onebit.__all__ if not inspect.ismodule(getattr(onebit, n))]
    names += [f"onebit.fsdp.{n}" for n in onebit.fsdp.__all__]
    for name in INTEGRATIONS:
        module = importlib.import_module(f"onebit.integrations.{name}")
        public = getattr(module, "__all__", None) or [
            n
            for n, obj in vars(module).items()
            if not n.startswith("_")
            and (inspect.isclass(obj) or inspect.isfunction(obj))
            and obj.__module__ == module.__name__
        ]
        names += [f"{module.__name__}.{n}" for n in public]
    names += ["onebit.zero_one_adam.run_schedule", "onebit.zero_one_adam.run_freeze_step"]
    names += ["onebit.compress.cpu_kernels"]
    for entry in (
        "onebit.integrations.transformers.OnebitCallback",
        "onebit.integrations.transformers.create_optimizer",
        "onebit.integrations.transformers.shard_hsdp",
        "onebit.integrations.accelerate.prepare",
        "onebit.integrations.lightning.OnebitCallback",
        "onebit.integrations.deepspeed.optimizer_from_config",
        "onebit.integrations.deepspeed.UnsupportedKeyWarning",
    ):
        assert entry in names  # the entry points the README names are among the public ones
    missing = [n for n in names if n not in headings]
    assert not missing, f"no section in docs/api.md for {missing}: run python docs/make_api.py"


def test_the_optimizers_methods_and_attributes_have_sections():
    members = [
        "step",
        "no_sync",
        "state_dict",
        "load_state_dict",
        "consolidated_state_dict",
        "consolidate_state_dict",
        "freeze_step",
        "in_warmup",
        "stage",
        "grad_norm",
        "max_grad_norm",
        "comm_stats",
        "skipped_steps",
        "num_steps",
        "backend",
    ]
    headings = _headings()
    missing = [m for m in members if f"optimizer.{m}" not in headings]
    assert not missing, missing
    for own in ("ZeroOneAdam.synchronize", "OnebitLamb.get_lamb_coeffs", "ZeroOneAdam.stage"):
        assert own in headings


def test_a_new_export_must_be_placed(monkeypatch):
    """A name added to ``onebit.__all__`` fails generation until docs/make_api.py places it,
    instead of being left out of the page."""
    make_api = _generator()
    monkeypatch.setattr(onebit, "__all__", [*onebit.__all__, "NewThing"])
    monkeypatch.setattr(onebit, "NewThing", type("NewThing", (), {}), raising=False)
    with pytest.raises(ValueError, match=r"\['NewThing'\].*add them to MODULES"):
        make_api.module_names(onebit, make_api.ONEBIT_ORDER)


def test_docstrings_become_markdown():
    make_api = _generator()
    doc = """Build it from :class:`~onebit.freeze.AutoFreeze` and :func:`onebit.fsdp.attach`.

    Example::

        opt = make(``x``)

    Args:
        params: the ``params``; a long
            sentence.
        lr, eps: rates.
        **overrides: the rest.

    Raises:
        ValueError: if ``lr`` < 0.

    * a bullet
      that goes on
    """
    assert make_api.markdown(doc).splitlines() == [
        "Build it from `AutoFreeze` and `onebit.fsdp.attach`.",
        "",
        "Example:",
        "",
        "```python",
        "opt = make(``x``)",
        "```",
        "",
        "Arguments:",
        "",
        "- `params`: the `params`; a long",
        "  sentence.",
        "- `lr`, `eps`: rates.",
        "- `**overrides`: the rest.",
        "",
        "Raises:",
        "",
        "- `ValueError`: if `lr` < 0.",
        "",
        "- a bullet",
        "  that goes on",
    ]


def test_signatures_show_defaults_and_keyword_markers():
    make_api = _generator()

    def short(a: int, b: str = "x", *, c: float | None = None, **kw: object) -> bool:
        return True

    assert make_api.signature(short, {}, "short") == (
        "short(a: int, b: str = 'x', *, c: float | None = None, **kw: object) -> bool"
    )
    rendered = make_api.signature(onebit.OnebitAdam, {}, "class OnebitAdam", drop_return=True)
    assert rendered.startswith("class OnebitAdam(\n    params: Iterable,\n    lr: float = 0.001,")
    assert "    *,\n    freeze_step: int | Literal['auto'] = 'auto',\n" in rendered


def test_generator_imports_no_framework_until_it_runs():
    path = str(ROOT / "docs" / "make_api.py")
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('m', {path!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "print(sorted(m for m in ('onebit', 'transformers', 'accelerate', 'lightning') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
