"""The byte-level text task reads a fixed, recorded list of files and says when they differ."""

import hashlib
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from experiments import data

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def copy_files(tmp_path, num_files):
    for name, _, _ in data.TEXT_FILES[:num_files]:
        shutil.copy(STDLIB / f"{name}.py", tmp_path / f"{name}.py")
    return tmp_path


def test_the_file_list_is_fixed_hand_written_and_recorded():
    names = [name for name, _, _ in data.TEXT_FILES]
    assert len(names) == len(set(names)) == 64
    assert not [n for n in names if n.startswith("_sysconfigdata")]  # generated per install
    for _, size, digest in data.TEXT_FILES:
        assert size > 0 and len(digest) == 16 and int(digest, 16) >= 0


def test_only_the_listed_files_are_read_in_order(tmp_path):
    root = copy_files(tmp_path, 4)
    # A generated file that sorts among the listed ones must not enter the data.
    (root / "_sysconfigdata__linux.py").write_text("build_time_vars = {'CC': 'gcc'}\n")
    (root / "aaa.py").write_text("x = 1\n")
    train, val = data.stdlib_text(4, 0.25, root=root, report=False)
    expected = b"\n".join((STDLIB / f"{n}.py").read_bytes() for n, _, _ in data.TEXT_FILES[:4])
    assert bytes(train) + bytes(val) == expected
    assert len(val) == len(expected) - int(len(expected) * 0.75)


def test_a_missing_file_fails_naming_it(tmp_path):
    root = copy_files(tmp_path, 3)
    (root / f"{data.TEXT_FILES[1][0]}.py").unlink()
    with pytest.raises(FileNotFoundError, match=rf"\['{data.TEXT_FILES[1][0]}\.py'\]"):
        data.stdlib_text(3, root=root, report=False)


def test_a_changed_file_warns_naming_it_and_strict_fails(tmp_path):
    root = copy_files(tmp_path, 3)
    name = data.TEXT_FILES[2][0]
    path = root / f"{name}.py"
    path.write_bytes(path.read_bytes().replace(b"def ", b"def  ", 1))  # one byte more
    with pytest.warns(data.StdlibTextWarning, match=rf"differ from CPython 3\.11\.7's: {name} "):
        train, val = data.stdlib_text(3, root=root, report=False)
    assert data.stdlib_text_split(3, root=root).differing == (name,)
    with pytest.raises(ValueError, match=rf"{name} \(1 of 3"):
        data.stdlib_text(3, root=root, strict=True, report=False)
    # Same size, different content: the digest catches it.
    path.write_bytes((STDLIB / f"{name}.py").read_bytes()[:-1] + b"#")
    with pytest.raises(ValueError, match=name):
        data.stdlib_text(3, root=root, strict=True, report=False)


def test_report_states_the_split_bytes(tmp_path, capsys):
    root = copy_files(tmp_path, 2)
    train, val = data.stdlib_text(2, 0.5, root=root)
    err = capsys.readouterr().err
    assert f"{len(train):,} train bytes, {len(val):,} validation bytes" in err
    assert "identical to CPython 3.11.7's" in err
    assert isinstance(train, np.ndarray) and train.dtype == np.uint8


@pytest.mark.parametrize(
    "num_files, val_fraction, match",
    [(0, 0.1, "num_files must be in"), (65, 0.1, "num_files must be in"), (4, 1.0, "val_fraction")],
)
def test_bad_arguments(num_files, val_fraction, match):
    with pytest.raises(ValueError, match=match):
        data.stdlib_text(num_files, val_fraction, report=False)


@pytest.mark.skipif(
    sys.version_info[:3] != (3, 11, 7), reason="the recorded files are CPython 3.11.7's"
)
def test_the_record_matches_cpython_3_11_7():
    for name, size, digest in data.TEXT_FILES:
        text = (STDLIB / f"{name}.py").read_bytes()
        assert (len(text), hashlib.sha256(text).hexdigest()[:16]) == (size, digest), name
    split = data.stdlib_text_split(16)
    assert (split.train_bytes, split.val_bytes, split.differing) == (246_617, 27_402, ())


def test_the_data_imports_without_the_trainers_tools():
    script = (
        "import sys, experiments, experiments.data\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'optax', 'orbax', 'flax'})\n"
        "assert not heavy, heavy\n"
        "assert callable(experiments.load) and 'orbax' in sys.modules  # load on first use\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=Path(__file__).parents[1])
