"""The suite runs without the Hugging Face tests' reference: ``pip install -e ".[test]"``
installs neither torch nor transformers (``.ci/newest`` runs so), and a test module that
imports them at its top stops pytest's collection of the whole run instead of skipping its
own tests. So they are imported through ``pytest.importorskip`` or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

OPTIONAL = ("torch", "transformers")
TESTS = Path(__file__).parent


def top_level_imports(source: str) -> list[tuple[int, str]]:
    """``(line, module)`` of each import of an ``OPTIONAL`` package that runs when the module
    is imported: at its top, or in a class body or a top-level ``if``, ``try`` or ``with``
    (not in a function's body, which runs when called)."""
    found = []

    def visit(statements):
        for node in statements:
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else []
            else:
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    for field in ("body", "orelse", "finalbody", "handlers"):
                        visit(getattr(node, field, []))
                continue
            found.extend((node.lineno, n) for n in names if n.split(".")[0] in OPTIONAL)

    visit(ast.parse(source).body)
    return found


def test_the_checker_finds_imports_run_on_import_and_not_those_inside_functions():
    source = (
        "import numpy\nimport torch.nn\nif True:\n    from transformers import AutoConfig\n"
        "def f():\n    import torch\n"
        "class C:\n    import transformers\n"
        "torch = __import__('pytest').importorskip('torch')\n"
    )
    assert top_level_imports(source) == [(2, "torch.nn"), (4, "transformers"), (8, "transformers")]


@pytest.mark.parametrize("path", sorted(TESTS.glob("*.py")), ids=lambda p: p.name)
def test_no_module_of_the_suite_imports_torch_or_transformers_at_its_top(path):
    found = top_level_imports(path.read_text())
    assert not found, (
        f"{path.name} imports {', '.join(f'{m} (line {n})' for n, m in found)} at its top: "
        'use `pytest.importorskip("...")` so that its tests skip where it is not installed'
    )


@pytest.mark.parametrize("missing", ["safetensors", "tokenizers"])
def test_the_library_imports_without_the_hf_extra_and_hf_names_it(missing):
    # A Python without the extra's package (find_spec finds nothing): the library imports,
    # and linattn_jax.hf says what to install instead of a bare "No module named ...".
    import subprocess
    import sys

    hide = (
        "import importlib.util as u; find = u.find_spec; "
        f"u.find_spec = lambda name, *a: None if name == {missing!r} else find(name, *a); "
        "import linattn_jax, linattn_jax.layers, linattn_jax.models; "
    )
    ok = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    run = subprocess.run(
        [sys.executable, "-c", hide + "import linattn_jax.hf"], capture_output=True, text=True
    )
    assert run.returncode == 1
    assert f"ImportError: linattn_jax.hf needs {missing}: pip install 'linattn_jax[hf]'" in (
        run.stderr
    )
