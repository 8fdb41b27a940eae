"""A test run leaves nothing behind: temporary files, pip's cache and torch's compile cache go under
pytest's base temporary folder (tests/conftest.py), which a green run removes (pyproject.toml)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import CONTAINED_ENV


def _inside(path: str | os.PathLike, root: Path) -> bool:
    return Path(path).resolve().is_relative_to(root.resolve())


def test_temporary_files_and_caches_go_under_pytests_folder(tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.getbasetemp()
    for name in CONTAINED_ENV:
        assert _inside(os.environ[name], root), (name, os.environ[name], root)
    assert _inside(tempfile.gettempdir(), root)
    with tempfile.TemporaryDirectory() as made:
        assert _inside(made, root)
    child = subprocess.run(
        [sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert _inside(child.stdout.strip(), root)  # and so in every process a test starts


def test_torch_compile_cache_goes_under_pytests_folder(tmp_path_factory: pytest.TempPathFactory) -> None:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert _inside(cache_dir(), tmp_path_factory.getbasetemp())


def test_a_green_run_removes_its_temporary_folder(request: pytest.FixtureRequest) -> None:
    assert request.config.getini("tmp_path_retention_policy") == "failed"


def test_a_green_run_leaves_nothing_in_the_temporary_directory(tmp_path: Path) -> None:
    """A whole pytest session (one quick test of this suite, through tests/conftest.py) with TMPDIR
    pointed at an empty folder leaves it empty: pytest's pytest-of-$USER folder goes too."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_hygiene.py::test_a_green_run_removes_its_temporary_folder"],
        check=False, capture_output=True, text=True, cwd=root, env={**os.environ, "TMPDIR": str(tmp)}, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert sorted(p.name for p in tmp.iterdir()) == []
