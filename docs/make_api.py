"""Write docs/api.md, onebit's API reference, from the public names' signatures and docstrings.

    python docs/make_api.py          # writes docs/api.md
    python docs/make_api.py --check  # exits 1 if docs/api.md is not what this would write

The reference covers what ``onebit.__all__`` exports, the methods and attributes users call on
the optimizers, and the integrations' entry points. The integration modules import their
framework (transformers, accelerate, lightning, torchtitan) when they are imported, so
generating needs ``pip install -e ".[integrations,torchtitan]"``; this file itself imports
nothing of onebit until it runs.
Docstrings are Google-style reST; they are converted modestly: ``x`` and :role:`x` become `x`,
``Args:``-style sections become lists, and ``::`` blocks become fenced code.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import importlib
import inspect
import re
import sys
import textwrap
import typing
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

OUTPUT = Path(__file__).resolve().parent / "api.md"

HEADER = """\
# API reference

This file is generated from the docstrings by `python docs/make_api.py`; do not edit it by hand.
After changing a public signature or docstring, run `python docs/make_api.py` again
(`python docs/make_api.py --check` exits 1 while this file is out of date; the tests check it
too). The guides are [the README](../README.md) and [Coming from DeepSpeed](deepspeed.md); what
each algorithm computes is in [SPEC.md](SPEC.md).
"""

COMMON = "optimizer"
"""Where the members that the three optimizers share go in ``onebit``'s list of names."""

ONEBIT_ORDER = (
    "OnebitAdam",
    "ZeroOneAdam",
    "OnebitLamb",
    COMMON,
    "AutoFreeze",
    "CommStats",
    "CompressedAllreduce",
    "ddp_comm_hook",
)
"""The order of ``onebit``'s names; every name of ``onebit.__all__`` but the ``fsdp`` module,
which has a section of its own, must be here."""

MODULES: tuple[tuple[str, tuple[str, ...] | None, bool], ...] = (
    ("onebit", ONEBIT_ORDER, True),
    ("onebit.fsdp", None, True),
    (
        "onebit.zero_one_adam",
        ("run_schedule", "run_freeze_step", "Schedule", "PAPER_SCHEDULE", "ZeroOneAdam"),
        False,
    ),
    ("onebit.compress", ("cpu_kernels",), False),
    ("onebit.integrations.transformers", None, True),
    ("onebit.integrations.accelerate", None, True),
    ("onebit.integrations.lightning", None, True),
    ("onebit.integrations.deepspeed", None, True),
    (
        "onebit.integrations.torchtitan",
        ("onebit_optimizer", "onebit_config", "OnebitTrainer", "OnebitOptimizers"),
        True,
    ),
)
"""Each module: its names in order (``None``: its public names, :func:`public_names`), and
whether its docstring introduces its section."""

SELECTED = frozenset({"onebit.compress"})
"""Modules of which only the names given are documented: ``onebit.compress``'s other functions
are the arithmetic the communicators are built on."""

COMMON_HEADING = "Methods and attributes of the optimizers"
COMMON_INTRO = """\
`OnebitAdam`, `ZeroOneAdam` and `OnebitLamb` share these methods and attributes, from their
base class `onebit.optim.base.CompressedOptimizer`. Those they inherit unchanged from
`torch.optim.Optimizer` (`zero_grad`, `param_groups`, `state`) work as in torch;
`state[p]` holds views into the optimizer's flat fp32 buffers (each class says which)."""

COMMON_ATTRIBUTES = ("backend", "comm_stats", "skipped_steps", "num_steps")
"""The instance attributes users read, from the base class's ``Attributes:`` section (its others,
``engine``, ``bucketer``, ``flat`` and ``freeze``, are the optimizer's own parts; ``grad_norm``
is a property and documented as one)."""

INTERNAL = frozenset(
    {
        # What the optimizers' stages and checkpoints call on themselves.
        "CompressedOptimizer.set_frozen",
        "PacksMomentum.check_packed",
        "ZeroOneAdam.sync_params",
        # What the optimizers call on their CommStats.
        "CommStats.record",
        # The parts of CompressedAllreduce that only the optimizers' fused steps use.
        "CompressedAllreduce.kept_worker_error",
        "CompressedAllreduce.server_buffers",
        "CompressedAllreduce.hold_server_error",
        "CompressedAllreduce.scale_geometry",
        "CompressedAllreduce.phase1_width",
        "CompressedAllreduce.phase2_width",
        "CompressedAllreduce.start_compressed",
        "CompressedAllreduce.result_signs",
        "TwoPhase.received",  # CompressedAllreduce's base
        "CompressedAllreduce.server_error",  # the class's Attributes: say what users need
        # The call in phases (start, worker_scales, headers, serve, finish), as the
        # optimizers' engine drives it to batch and overlap many buckets.
        "CompressedAllreduce.start",
        "CompressedAllreduce.worker_scales",
        "CompressedAllreduce.headers",
        "CompressedAllreduce.serve",
        "CompressedAllreduce.finish",
    }
)
"""Public, documented members left out, as ``DefiningClass.name``: they are for onebit's own
use."""

PUBLIC_DUNDERS = ("__call__",)

SECTIONS = ("Args", "Arguments", "Attributes", "Fields", "Raises", "Returns", "Yields")
_SECTION = re.compile(rf"^({'|'.join(SECTIONS)}):\s*$")
_ENTRY = re.compile(r"^(\*{0,2}[\w.]+(?:, \*{0,2}[\w.]+)*)(?: \(([^)]*)\))?: ?(.*)$")
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj):`([^`]+)`")


def main(argv: list[str] | None = None) -> int:
    """Write docs/api.md, or with ``--check`` say whether it is current (exit status 1 if not)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
        if current != text:
            print(stale_message(current, text), file=sys.stderr)
            return 1
        print(f"{OUTPUT.name} is up to date")
        return 0
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT}")
    return 0


def stale_message(current: str, expected: str, context: int = 40) -> str:
    """Why docs/api.md is stale: the fix, and the start of the diff from it to what it should be."""
    diff = difflib.unified_diff(
        current.splitlines(), expected.splitlines(), "docs/api.md", "generated", lineterm=""
    )
    lines = list(diff)
    shown = "\n".join(lines[:context]) + ("\n..." if len(lines) > context else "")
    return f"docs/api.md is out of date: run `python docs/make_api.py`.\n{shown}"


# What is documented.


def public_names(module: ModuleType) -> list[str]:
    """A module's public names: its ``__all__``, or else the functions and classes it defines
    (imported ones and names starting with ``_`` left out), in source order."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isfunction(obj) or inspect.isclass(obj))
        and obj.__module__ == module.__name__
    ]


def module_names(module: ModuleType, order: tuple[str, ...] | None) -> list[str]:
    """The names of ``module``'s section, in order; ``ValueError`` if ``order`` leaves out a
    public name (a new export must be placed, not dropped)."""
    if order is None:
        return public_names(module)
    exported = set(public_names(module))
    placed = set(order) - {COMMON}
    if module.__name__ in SELECTED:
        exported = placed
    missing = sorted(n for n in exported - placed if not inspect.ismodule(getattr(module, n)))
    if missing:
        raise ValueError(
            f"{module.__name__} exports {missing}, which docs/make_api.py does not place: "
            "add them to MODULES"
        )
    unknown = sorted(placed - exported)
    if unknown:
        raise ValueError(f"MODULES names {unknown}, which {module.__name__} does not export")
    return list(order)


_LEFT_OUT: set[str] = set()
"""The :data:`INTERNAL` members met so far, so that :func:`render` can check each still exists."""


def documented_members(cls: type, stop: type | None = None) -> list[tuple[str, Any, type]]:
    """``(name, member, defining class)`` of the public, documented methods and properties of
    ``cls`` and its onebit bases up to ``stop`` (excluded), nearest definition first, in source
    order; :data:`INTERNAL` left out."""
    seen: set[str] = set()
    members = []
    for klass in cls.__mro__:
        if klass is stop or not klass.__module__.startswith("onebit"):
            break
        for name, member in vars(klass).items():
            if name in seen or (name.startswith("_") and name not in PUBLIC_DUNDERS):
                continue
            function = _function_of(member)
            if function is None:
                continue
            seen.add(name)
            key = f"{klass.__name__}.{name}"
            if key in INTERNAL:
                _LEFT_OUT.add(key)
            elif function.__doc__:
                members.append((name, member, klass))
    return members


def _function_of(member: Any) -> Callable[..., Any] | None:
    """The function a class member documents: a method, or a property's getter."""
    if isinstance(member, property):
        return member.fget
    if isinstance(member, (staticmethod, classmethod)):
        return member.__func__
    return member if inspect.isfunction(member) else None


# Rendering.


class Page:
    """The markdown being written, with the GitHub anchor of each heading for the contents."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.toc: list[tuple[int, str, str]] = []
        self._slugs: dict[str, int] = {}

    def heading(self, level: int, text: str) -> None:
        slug = github_anchor(text)
        count = self._slugs.get(slug, 0)
        self._slugs[slug] = count + 1
        self.toc.append((level, text, slug if count == 0 else f"{slug}-{count}"))
        self.add(f"{'#' * level} {text}")

    def add(self, *blocks: str) -> None:
        for block in blocks:
            if block:
                self.lines.extend([block, ""])

    def code(self, text: str, language: str = "python") -> None:
        self.add(f"```{language}\n{text}\n```")


def render() -> str:
    """docs/api.md's text."""
    from onebit.optim.base import CompressedOptimizer

    modules = {name: importlib.import_module(name) for name, _, _ in MODULES}
    paths = _public_paths(modules)
    page = Page()
    for module_name, order, intro in MODULES:
        module = modules[module_name]
        page.heading(2, f"`{module_name}`")
        if intro:
            page.add(markdown(module.__doc__))
        for name in module_names(module, order):
            if name == COMMON:
                _common_members(page, CompressedOptimizer, paths)
                continue
            obj = getattr(module, name)
            path = f"{module_name}.{name}"
            first = paths.get(id(obj))
            if first is not None and first != path:
                page.heading(3, f"`{path}`")
                page.add(f"The same object as [`{first}`](#{github_anchor(f'`{first}`')}).")
            elif inspect.ismodule(obj):
                continue
            else:
                _entry(page, path, obj, modules, paths)
    stale = sorted(INTERNAL - _LEFT_OUT)
    if stale:
        raise ValueError(f"INTERNAL names members that no documented class has: {stale}")
    return _assemble(page)


def _assemble(page: Page) -> str:
    contents = ["## Contents", ""]
    for level, text, slug in page.toc:
        if level in (2, 3):
            indent = "  " * (level - 2)
            contents.append(f"{indent}- [{text}](#{slug})")
    body = "\n".join(page.lines).rstrip() + "\n"
    return f"{HEADER}\n" + "\n".join(contents) + "\n\n" + body


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading (the first of that text; later ones get ``-1``...)."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _public_paths(modules: dict[str, ModuleType]) -> dict[int, str]:
    """``id(object) -> the first import path it is documented under``, for defaults and for
    names exported twice."""
    paths: dict[int, str] = {}
    for module_name, order, _ in MODULES:
        module = modules[module_name]
        for name in module_names(module, order):
            if name != COMMON:
                obj = getattr(module, name)
                if not isinstance(obj, (int, float, str, tuple)):  # constants may share ids
                    paths.setdefault(id(obj), f"{module_name}.{name}")
    return paths


def _entry(page: Page, path: str, obj: Any, modules: dict, paths: dict[int, str]) -> None:
    page.heading(3, f"`{path}`")
    if inspect.isclass(obj):
        _class(page, path, obj, paths)
    elif callable(obj):
        page.code(signature(obj, paths, path))
        page.add(markdown(obj.__doc__))
    else:
        page.code(_data_line(path, obj, modules, paths))
        page.add(markdown(attribute_doc(obj, path.rsplit(".", 1)[-1])))


def _class(page: Page, path: str, cls: type, paths: dict[int, str]) -> None:
    from onebit.optim.base import CompressedOptimizer

    if issubclass(cls, BaseException):
        bases = ", ".join(_type_name(b, paths) for b in cls.__bases__)
        page.code(f"class {path}({bases})")
    else:
        page.code(signature(cls, paths, f"class {path}", drop_return=True))
    page.add(markdown(cls.__doc__))
    if _is_namedtuple(cls):
        page.add(_fields(cls))
    stop = CompressedOptimizer if issubclass(cls, CompressedOptimizer) else None
    members = documented_members(cls, stop)
    if stop is not None:
        shared = f"[those the optimizers share](#{github_anchor(COMMON_HEADING)})"
        page.add(f"Its methods and attributes: {shared}{', and those below' if members else ''}.")
    for name, member, _ in members:
        _member(page, f"{cls.__name__}.{name}", member, paths)


def _common_members(page: Page, base: type, paths: dict[int, str]) -> None:
    page.heading(3, COMMON_HEADING)
    page.add(COMMON_INTRO)
    for name, member, _ in documented_members(base):
        _member(page, f"{COMMON}.{name}", member, paths)
    attributes = dict(google_entries(base.__doc__, "Attributes"))
    for name in COMMON_ATTRIBUTES:
        if name not in attributes:
            raise ValueError(f"CompressedOptimizer's docstring does not document {name!r}")
        page.heading(4, f"`{COMMON}.{name}`")
        text = convert_inline(attributes[name])
        page.add(text[:1].upper() + text[1:])


def _member(page: Page, path: str, member: Any, paths: dict[int, str]) -> None:
    page.heading(4, f"`{path}`")
    if isinstance(member, property):
        returns = inspect.signature(member.fget).return_annotation
        annotation = "" if returns is inspect.Signature.empty else f": {_annotation(returns)}"
        page.code(f"{path}{annotation}")
        page.add(markdown(member.fget.__doc__))
    else:
        function = _function_of(member)
        page.code(signature(function, paths, path, drop_self=True))
        page.add(markdown(function.__doc__))


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and hasattr(cls, "_fields")


def _fields(cls: type) -> str:
    """A NamedTuple's fields with their types and the docstrings that follow them in its source."""
    docs = _class_attribute_docs(cls)
    hints = getattr(cls, "__annotations__", {})
    lines = ["Fields:", ""]
    for name in cls._fields:
        hint = f" ({_annotation(hints[name])})" if name in hints else ""
        doc = convert_inline(docs.get(name, "")).replace("\n", " ")
        lines.append(f"- `{name}`{hint}{': ' + doc if doc else ''}")
    return "\n".join(lines)


def _class_attribute_docs(cls: type) -> dict[str, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    return _attribute_docs(tree.body[0].body)


def _attribute_docs(body: list[ast.stmt]) -> dict[str, str]:
    """``name -> docstring`` for the assignments in ``body`` followed by a string literal."""
    docs = {}
    for statement, following in zip(body, body[1:]):
        targets = statement.targets if isinstance(statement, ast.Assign) else []
        if isinstance(statement, ast.AnnAssign):
            targets = [statement.target]
        if (
            targets
            and isinstance(targets[0], ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[targets[0].id] = inspect.cleandoc(following.value.value)
    return docs


def attribute_doc(obj: Any, name: str) -> str:
    """The docstring under the module-level assignment of ``name`` that holds ``obj``, in the
    onebit module that makes it (the first, by module name, whose ``name`` is ``obj``)."""
    for module_name in sorted(sys.modules):
        module = sys.modules[module_name]
        if not module_name.startswith("onebit") or vars(module).get(name) is not obj:
            continue
        docs = _attribute_docs(ast.parse(inspect.getsource(module)).body)
        if name in docs:
            return docs[name]
    return ""


def _data_line(path: str, obj: Any, modules: dict, paths: dict[int, str]) -> str:
    module_name, name = path.rsplit(".", 1)
    hint = modules[module_name].__dict__.get("__annotations__", {}).get(name)
    line = path + (f": {_annotation(hint)}" if hint is not None else "")
    value = _value(obj, paths)
    return line if value is None or len(value) > 120 else f"{line} = {value}"


def _value(obj: Any, paths: dict[int, str]) -> str | None:
    """A short, deterministic rendering of a constant, or ``None`` where there is none."""
    if inspect.isclass(obj):
        return _type_name(obj, paths)
    if isinstance(obj, dict):
        items = [(_value(k, paths), _value(v, paths)) for k, v in obj.items()]
        if any(k is None or v is None for k, v in items):
            return None
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(obj, (bool, int, float, str, type(None))) or _is_namedtuple(type(obj)):
        text = repr(obj)
        return None if " at 0x" in text else text
    return None


# Signatures.


def signature(
    obj: Callable[..., Any],
    paths: dict[int, str],
    name: str = "",
    drop_self: bool = False,
    drop_return: bool = False,
) -> str:
    """``name`` and ``obj``'s parameters and return annotation as written in its source, with
    defaults; one parameter per line where one line would be longer than 88 characters."""
    sig = inspect.signature(obj)
    params = list(sig.parameters.values())
    if drop_self and params and params[0].name in ("self", "cls"):
        params = params[1:]
    parts: list[str] = []
    star_done = False
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        if p.kind is p.VAR_POSITIONAL:
            star_done = True
        parts.append(_parameter(p, obj, paths))
        last_positional = p.kind is p.POSITIONAL_ONLY and (
            i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY
        )
        if last_positional:
            parts.append("/")
    returns = ""
    if not drop_return and sig.return_annotation is not inspect.Signature.empty:
        returns = f" -> {_annotation(sig.return_annotation)}"
    one_line = f"{name}({', '.join(parts)}){returns}"
    if len(one_line) <= 88 or not parts:
        return one_line
    return f"{name}(\n" + "".join(f"    {part},\n" for part in parts) + f"){returns}"


def _parameter(p: inspect.Parameter, owner: Any, paths: dict[int, str]) -> str:
    prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
    text = prefix + p.name
    annotated = p.annotation is not inspect.Parameter.empty
    if annotated:
        text += f": {_annotation(p.annotation)}"
    if p.default is not inspect.Parameter.empty:
        default = _default(p, owner, paths)
        text += f" = {default}" if annotated else f"={default}"
    return text


def _default(p: inspect.Parameter, owner: Any, paths: dict[int, str]) -> str:
    if p.default is dataclasses.MISSING or repr(p.default) == "<factory>":
        field = next(f for f in dataclasses.fields(owner) if f.name == p.name)
        factory = field.default_factory
        return {dict: "{}", list: "[]"}.get(factory, f"{getattr(factory, '__name__', '?')}()")
    if inspect.isclass(p.default):
        return _type_name(p.default, paths)
    text = repr(p.default)
    if " at 0x" in text:
        raise ValueError(f"the default of {p.name!r} has no deterministic repr: {text}")
    return text


def _annotation(annotation: Any) -> str:
    if isinstance(annotation, str):
        return annotation
    if isinstance(annotation, typing.ForwardRef):
        return annotation.__forward_arg__
    if inspect.isclass(annotation) and not typing.get_args(annotation):
        return annotation.__qualname__
    return inspect.formatannotation(annotation)


def _type_name(cls: type, paths: dict[int, str]) -> str:
    if id(cls) in paths:
        return paths[id(cls)]
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


# Docstrings: reST to markdown.


def convert_inline(text: str) -> str:
    """reST's inline markup as markdown's: ``x`` -> `x`; :class:`~a.b.X` -> `X`; :func:`a.b` ->
    `a.b`; :meth:`text <target>` -> `text`."""

    def role(match: re.Match) -> str:
        target = match.group(1)
        shown = re.match(r"(.*?)\s*<.*>$", target)
        if shown:
            target = shown.group(1)
        elif target.startswith("~"):
            target = target[1:].rsplit(".", 1)[-1]
        return f"`{target}`"

    return _ROLE.sub(role, text).replace("``", "`")


def google_entries(doc: str | None, section: str) -> list[tuple[str, str]]:
    """The ``(name, text)`` entries of a Google-style section (``"Args"``, ``"Attributes"``...)
    of ``doc``, continuation lines joined."""
    entries: list[tuple[str, str]] = []
    inside = False
    for line in inspect.cleandoc(doc or "").splitlines():
        if _SECTION.match(line):
            inside = line.rstrip(":").strip() == section
            continue
        if inside and line and not line.startswith(" "):
            inside = False
        if not inside or not line.strip():
            continue
        entry = _ENTRY.match(line[4:]) if line.startswith("    ") and line[4] != " " else None
        if entry:
            entries.append((entry.group(1), entry.group(3)))
        elif entries:
            entries[-1] = (entries[-1][0], f"{entries[-1][1]} {line.strip()}")
    return entries


def markdown(doc: str | None) -> str:
    """A docstring as markdown: inline markup converted, Google-style sections as lists, ``::``
    literal blocks fenced, reST bullets as markdown's."""
    if not doc:
        return ""
    lines = inspect.cleandoc(doc).splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        section = _SECTION.match(line)
        if section:
            i = _section(lines, i + 1, section.group(1), out)
            continue
        if line.rstrip().endswith("::"):
            stripped = line.rstrip()[:-2].rstrip()
            if stripped:
                out.append(_prose(stripped + ":"))
            i = _literal(lines, i + 1, out)
            continue
        out.append(_prose(line))
        i += 1
    return "\n".join(out).strip("\n")


def _prose(line: str) -> str:
    stripped = line.lstrip()
    indent = len(line) - len(stripped)
    if stripped.startswith("* "):
        stripped = "- " + stripped[2:]
    return " " * min(indent, 2) + convert_inline(stripped)


def _literal(lines: list[str], i: int, out: list[str]) -> int:
    """Fence the indented block from line ``i`` (after blank lines); the index after it."""
    while i < len(lines) and not lines[i].strip():
        i += 1
    block: list[str] = []
    while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
        block.append(lines[i])
        i += 1
    while block and not block[-1].strip():
        block.pop()
    out.extend(["", "```python", textwrap.dedent("\n".join(block)), "```", ""])
    return i


def _section(lines: list[str], i: int, name: str, out: list[str]) -> int:
    """Render the Google-style section ``name`` whose entries start at line ``i`` as a list;
    the index after it."""
    end = i
    while end < len(lines) and (not lines[end].strip() or lines[end].startswith(" ")):
        end += 1
    title = {"Args": "Arguments", "Yields": "Yields"}.get(name, name)
    out.extend([f"{title}:", ""])
    if name in ("Returns", "Yields"):
        text = " ".join(line.strip() for line in lines[i:end] if line.strip())
        out.extend([convert_inline(text), ""])
        return end
    items: list[list[str]] = []
    for line in lines[i:end]:
        if not line.strip():
            continue
        entry = _ENTRY.match(line[4:]) if line.startswith("    ") and line[4] != " " else None
        if entry:
            names = ", ".join(f"`{n}`" for n in entry.group(1).split(", "))
            kind = f" ({entry.group(2)})" if entry.group(2) else ""
            items.append([f"- {names}{kind}: {convert_inline(entry.group(3))}".rstrip()])
        elif items:
            items[-1].append("  " + convert_inline(line.strip()))
        else:
            items.append(["- " + convert_inline(line.strip())])
    for item in items:
        out.extend(item)
    out.append("")
    return end


if __name__ == "__main__":
    sys.exit(main())
