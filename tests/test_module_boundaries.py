"""No module of onebit reads another module's private names.

A name with a leading underscore belongs to the module that defines it (a function, a class, a
class attribute or an attribute it assigns on ``self``). Another module may call what it makes
public, never the rest: the optimizers' stages work on their optimizer's public face
(``hyper``, ``masks``, the flat buffers, ``set_frozen``...), the Triton launchers on kernels
that their own modules export. The check reads the source, so it needs no GPU and no backend.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import onebit
from onebit.optim import registry

ROOT = Path(onebit.__file__).resolve().parent


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own(node: ast.expr) -> bool:
    """Whether ``node`` is the object a method works on: ``self``, ``cls`` or ``super()``."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and ast.unparse(node.func) == "super"


def _scan() -> tuple[dict[str, set[str]], list[tuple[str, int, str]]]:
    """Where each private name is defined (module paths), and every use of a private name on
    an object other than the module's own (``x._name``, ``from m import _name``)."""
    defined: dict[str, set[str]] = defaultdict(set)
    uses = []
    for path in sorted(ROOT.rglob("*.py")):
        module = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if _private(node.name):
                    defined[node.name].add(module)
            if isinstance(node, ast.ClassDef):
                for statement in node.body:
                    targets = (
                        statement.targets
                        if isinstance(statement, ast.Assign)
                        else [statement.target]
                        if isinstance(statement, ast.AnnAssign)
                        else []
                    )
                    for target in targets:
                        if isinstance(target, ast.Name) and _private(target.id):
                            defined[target.id].add(module)
            if isinstance(node, ast.Attribute) and _private(node.attr):
                if _own(node.value):
                    if isinstance(node.ctx, ast.Store):
                        defined[node.attr].add(module)
                else:
                    uses.append((module, node.lineno, node.attr))
            if isinstance(node, ast.ImportFrom):
                uses += [(module, node.lineno, a.name) for a in node.names if _private(a.name)]
    return defined, uses


def test_no_module_reads_another_modules_private_names():
    defined, uses = _scan()
    foreign = [
        f"{module}:{line} uses {name}, private to {', '.join(sorted(defined[name]))}"
        for module, line, name in uses
        if defined[name] and module not in defined[name]
    ]
    assert not foreign, "\n".join(foreign)


def test_the_scan_finds_a_private_read(tmp_path, monkeypatch):
    """The check above can fail: a module that reads another's private attribute is found."""
    (tmp_path / "owner.py").write_text("class A:\n    def __init__(self):\n        self._x = 1\n")
    (tmp_path / "reader.py").write_text("def f(a):\n    return a._x\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    defined, uses = _scan()
    assert defined["_x"] == {"owner.py"} and ("reader.py", 2, "_x") in uses


def test_stages_show_public_buffers():
    """What each stage shows in ``optimizer.state`` is named by a public attribute of its
    optimizer, which ``show_side`` reads from outside the optimizer's module."""
    for entry in registry.OPTIMIZERS:
        for stage in entry.cls._stage_types:
            private = [a for a in stage.shows.values() if _private(a)]
            assert not private, f"{entry.cls.__name__}'s {stage.name} shows {private}"
