"""Every Python block of the README runs on its own, as written, in a fresh namespace.

A block that cannot run here (it needs a trained workdir or many devices) is marked by a
comment on the line before its fence, with the reason: ``<!-- not-run: needs 8 devices -->``.
"""

import re
from pathlib import Path

import jax
import pytest

import linattn_jax

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
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


BLOCKS = python_blocks(README.read_text())


def test_blocks_are_found_and_skips_give_reasons():
    text = README.read_text()
    assert len(BLOCKS) >= 8
    assert len(BLOCKS) == text.count("```python")  # no block escapes the pattern
    for line, _, reason in BLOCKS:
        assert reason is None or reason, f"README.md:{line}: a not-run block needs a reason"


def test_the_parser_sees_markers_and_fences():
    text = "x\n```python\na = 1\n```\n<!-- not-run: needs 8 devices -->\n\n```python\nb = 2\n```\n"
    assert python_blocks(text) == [(2, "a = 1\n", None), (7, "b = 2\n", "needs 8 devices")]


@pytest.mark.slow
@pytest.mark.parametrize(
    "line, code, reason", BLOCKS, ids=[f"README.md:{line}" for line, _, _ in BLOCKS]
)
def test_readme_block_runs_on_its_own(line, code, reason):
    if reason is not None:
        pytest.skip(f"marked not-run: {reason}")
    # The README's reader has JAX's default promotion rules, not the tests' strict ones.
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        exec(compile("\n" * line + code, str(README), "exec"), {"__name__": "__readme__"})


def test_version_is_the_changelogs_latest_release():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", changelog, flags=re.M)
    assert releases and releases[0] == linattn_jax.__version__
    assert "## [Unreleased]" in changelog
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'version = { attr = "linattn_jax.__version__" }' in pyproject
