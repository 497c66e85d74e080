"""Every Python block of the README and of ``docs/`` runs on its own, as written, in a fresh
namespace.

A block that cannot run here (it needs a trained workdir or many devices, or only
illustrates) is marked by a comment on the line before its fence, with the reason:
``<!-- not-run: needs 8 devices -->``.
"""

import re
from importlib.util import find_spec
from pathlib import Path

import jax
import pytest

import linattn_jax

ROOT = Path(__file__).parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(
    r"^(?:<!--\s*not-run(?P<reason>[^>]*)-->[ \t]*\n(?:[ \t]*\n)*)?```python[ \t]*\n(?P<code>.*?)^```",
    flags=re.M | re.S,
)


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """``(line, code, not-run reason or None)`` for each fenced Python block."""
    blocks = []
    for match in BLOCK.finditer(text):
        line = text.count("\n", 0, match.start("code"))  # the fence's line, 1-based
        reason = match.group("reason")
        blocks.append((line, match.group("code"), None if reason is None else reason.strip(": ")))
    return blocks


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


BLOCKS = [
    (_name(path), line, code, reason)
    for path in FILES
    for line, code, reason in python_blocks(path.read_text())
]


def test_blocks_are_found_and_skips_give_reasons():
    assert len(FILES) >= 10 and len(BLOCKS) >= 15
    for path in FILES:
        text = path.read_text()
        # No block escapes the pattern (a fence indented, or a marker the pattern misreads).
        assert len(python_blocks(text)) == text.count("```python"), _name(path)
    for name, line, _, reason in BLOCKS:
        assert reason is None or reason, f"{name}:{line}: a not-run block needs a reason"


def test_every_docs_page_is_linked_from_the_readme_and_the_nav():
    readme = (ROOT / "README.md").read_text()
    nav = (ROOT / "mkdocs.yml").read_text()
    for path in FILES[1:]:
        page = path.relative_to(ROOT / "docs").as_posix()
        if page.startswith("_"):
            continue
        assert f"](docs/{page}" in readme, f"README.md has no link to docs/{page}"
        assert re.search(rf":\s*{re.escape(page)}\s*$", nav, flags=re.M), (
            f"mkdocs.yml's nav lacks {page}"
        )


def test_the_parser_sees_markers_and_fences():
    text = "x\n```python\na = 1\n```\n<!-- not-run: needs 8 devices -->\n\n```python\nb = 2\n```\n"
    assert python_blocks(text) == [(2, "a = 1\n", None), (7, "b = 2\n", "needs 8 devices")]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, line, code, reason", BLOCKS, ids=[f"{name}:{line}" for name, line, _, _ in BLOCKS]
)
def test_block_runs_on_its_own(name, line, code, reason):
    if reason is not None:
        pytest.skip(f"marked not-run: {reason}")
    for module in ("torch", "transformers"):  # the dev extra's, not the test extra's
        if re.search(rf"^(import|from) {module}\b", code, flags=re.M) and not find_spec(module):
            pytest.skip(f"{module} is not installed (the dev extra): the block imports it")
    # The docs' reader has JAX's default promotion rules, not the tests' strict ones.
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        exec(compile("\n" * line + code, str(ROOT / name), "exec"), {"__name__": "__docs__"})


def test_version_is_the_changelogs_latest_release():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", changelog, flags=re.M)
    assert releases and releases[0] == linattn_jax.__version__
    assert "## [Unreleased]" in changelog
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'version = { attr = "linattn_jax.__version__" }' in pyproject
