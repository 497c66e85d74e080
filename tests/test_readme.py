"""The README's Python examples run, in order, as written."""

import re
from pathlib import Path

import jax
import pytest

README = Path(__file__).parents[1] / "README.md"


@pytest.mark.slow
def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 6
    namespace: dict = {}
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        for block in blocks:
            exec(compile(block, str(README), "exec"), namespace)
