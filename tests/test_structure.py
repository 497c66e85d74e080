"""The house's shape, read from the sources: no import circle, no private reach, short classes.

Every module of ``linattn_jax/`` and ``experiments/`` is parsed (never imported). An import
anywhere in a module, at its top or inside a function, is an arrow from it to the module it
names: ``from a.b import c`` points at ``a.b.c`` when that is a module, else at ``a.b``;
importing a submodule does not count as importing its package's ``__init__``. The tests fail
on (a) a circle of such arrows, (b) a name with a leading underscore taken from another module
(``from m import _name`` or ``m._name`` on an imported module), (c) a class over 200 lines.
The tests themselves are not read: a test may reach into the module it tests.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("linattn_jax", "experiments")
MAX_CLASS_LINES = 200


def module_files() -> dict[str, Path]:
    """Every module of the checked packages, by dotted name (a package by its own name)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = module_files()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if MODULES[module].name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str) -> list[tuple[str, str | None, int]]:
    """``(target module, name taken from it or None, line)`` for each import in a module.

    For ``from a import b`` where ``a.b`` is a module, the target is ``a.b`` and no name is
    taken; otherwise the target is ``a`` and the name is ``b``.
    """
    found = []
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = resolve(module, node)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in MODULES:
                    found.append((submodule, None, node.lineno))
                else:
                    found.append((source, alias.name, node.lineno))
    return found


def graph() -> dict[str, set[str]]:
    """The arrows between the checked modules."""
    return {
        module: {
            target for target, _, _ in imports(module) if target in MODULES and target != module
        }
        for module in MODULES
    }


def circles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(arrows[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(arrows):
        if node not in index:
            visit(node)
    return found


def module_aliases(module: str) -> dict[str, str]:
    """Local names bound to a checked module by an import (``import a.b as m``, ``import a.b``
    (which binds ``a``), ``from a import b``)."""
    aliases = {}
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.name if alias.asname else alias.name.split(".")[0]
                if name in MODULES:
                    aliases[alias.asname or name] = name
        elif isinstance(node, ast.ImportFrom):
            source = resolve(module, node)
            for alias in node.names:
                if f"{source}.{alias.name}" in MODULES:
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
    return aliases


def dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``, or None for anything but names and attributes."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        inner = dotted(node.value)
        return None if inner is None else [*inner, node.attr]
    return None


def module_of(parts: list[str] | None, aliases: dict[str, str]) -> str | None:
    """The checked module an expression such as ``la.ops.chunking`` names, or None."""
    if not parts or parts[0] not in aliases:
        return None
    name = ".".join([aliases[parts[0]], *parts[1:]])
    return name if name in MODULES else None


def private_reaches(module: str) -> list[str]:
    """Each private name this module takes from another checked module, with its line."""
    found = [
        f"{module}:{line}: from {target} import {name}"
        for target, name, line in imports(module)
        if name is not None and is_private(name) and target in MODULES and target != module
    ]
    aliases = module_aliases(module)
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            target = module_of(dotted(node.value), aliases)
            if target is not None and target != module:
                found.append(f"{module}:{node.lineno}: {target}.{node.attr}")
    return found


def long_classes(module: str) -> list[str]:
    """Each class of the module longer than ``MAX_CLASS_LINES``, with its length."""
    return [
        f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(TREES[module])
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    ]


def test_the_checker_sees_every_package():
    assert {"linattn_jax.layers.blocks", "linattn_jax.hf", "experiments.trainer"} <= set(MODULES)
    assert "linattn_jax.ops" in graph()["linattn_jax"]


def test_no_import_circle():
    assert circles(graph()) == []


def test_no_private_name_crosses_a_module():
    assert [reach for module in MODULES for reach in private_reaches(module)] == []


def test_no_class_over_200_lines():
    assert [long for module in MODULES for long in long_classes(module)] == []


def test_the_checks_catch_what_they_look_for():
    """The three rules fire on a small made-up case each (a checker that sees nothing fails)."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse(
        "from linattn_jax.ops import chunking\nimport linattn_jax as la\n"
        "chunking._masked_diff\nla.ops.chunking._masked_diff\nla.ops.chunking.x._y\n"
    )
    TREES["linattn_jax.probe"], MODULES["linattn_jax.probe"] = tree, ROOT / "probe.py"
    try:
        assert private_reaches("linattn_jax.probe") == [
            "linattn_jax.probe:3: linattn_jax.ops.chunking._masked_diff",
            "linattn_jax.probe:4: linattn_jax.ops.chunking._masked_diff",
        ]
        TREES["linattn_jax.probe"] = ast.parse(
            "from linattn_jax.ops.chunking import _masked_diff as m\n"
            + "class Long:\n"
            + "    x = 1\n" * MAX_CLASS_LINES
        )
        assert private_reaches("linattn_jax.probe") == [
            "linattn_jax.probe:1: from linattn_jax.ops.chunking import _masked_diff"
        ]
        assert long_classes("linattn_jax.probe") == [
            f"linattn_jax.probe.Long: {MAX_CLASS_LINES + 1} lines"
        ]
    finally:
        del TREES["linattn_jax.probe"], MODULES["linattn_jax.probe"]
