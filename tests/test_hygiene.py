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
