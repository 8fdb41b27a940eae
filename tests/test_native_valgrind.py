"""The C library under valgrind: a standalone driver (tests/native/fake_ort_driver.c) calls it
through a fake OrtApi table with random valid and invalid inputs, each allocated at its exact
size; valgrind must report no invalid access and no definite leak, and every accepted call must
match a per-token reference (any seq_offset: the floor rule; mixed key/value dtypes). The driver
also checks registration (opset range, a second registration on the same options refused, one
domain reused) and the direct entry point (a bad plan refused, a strided pool view gathered in
place, a plan of the wrong struct size refused). With the fake device driver
(tests/native/fake_device_driver.c) the CUDA and CANN entries run too, caches and outputs
labelled device memory (every driver call checked for ORT's stream), and large CPU copies go
through the fake ORT's ParallelFor. Threads are forced on for one run (tiny parallel threshold)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from fake_ort_api import build_fake_driver

from pakv_onnx import native_lib, runtime_plugin

DRIVER = Path(__file__).parent / "native" / "fake_ort_driver.c"
HEADERS = Path(native_lib.__file__).parent  # the driver uses the library's own ABI headers


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("driver") / "fake_ort_driver"
    subprocess.run(
        ["gcc", "-O1", "-g", "-std=c11", "-Wall", "-Werror", "-Wno-unused-parameter", f"-I{HEADERS}", "-o", str(out)]
        + [str(DRIVER), "-ldl"],
        check=True,
    )
    return out


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory) -> str:
    return str(build_fake_driver(tmp_path_factory.mktemp("fake_driver")))


def _run(cmd, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def test_driver_without_valgrind(driver, fake_driver) -> None:
    result = _run([str(driver), runtime_plugin.library_path(), "20000", "3", fake_driver],
                  {"PAKV_ONNX_PARALLEL_MIN_BYTES": "256"})  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "wrong=0" in result.stdout and "device_ok=0 " not in result.stdout and "parallel=0" not in result.stdout


@pytest.mark.parametrize(("seed", "parallel_min_bytes"), [(11, None), (12, "1")])
def test_c_library_is_clean_under_valgrind(driver, fake_driver, seed, parallel_min_bytes) -> None:
    valgrind = shutil.which("valgrind")
    assert valgrind, "valgrind is required for this test (apt-get install valgrind)"
    env = {"PAKV_ONNX_PARALLEL_MIN_BYTES": parallel_min_bytes} if parallel_min_bytes else {}
    result = _run(
        [
            valgrind,
            "-q",
            "--error-exitcode=99",
            "--leak-check=full",
            "--errors-for-leak-kinds=definite",
            str(driver),
            runtime_plugin.library_path(),
            "3000",
            str(seed),
            fake_driver,
        ],
        env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "wrong=0" in result.stdout and "ok=0 " not in result.stdout and "device_ok=0 " not in result.stdout
