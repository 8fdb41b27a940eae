"""The C library built with ASan + UBSan (gcc -fsanitize=address,undefined, no recovery) and loaded
into ONNX Runtime: random valid/invalid calls, mixed dtypes, any seq_offset, extreme shapes ORT
accepts, a writer racing the block table, strict attributes, double registration, and the copy
core through ctypes (tests/native/sanitizer_session.py); in a process of its own, the CPU,
CUDA and CANN entries through the fake ORT runtime and the fake device driver (host memcpy, so
ASan checks every device copy's bounds); and, in another, PagedAttention inside ORT (random valid
calls against a numpy reference, every rule broken once, int64-edge shapes, a writer racing the
block table, outputs bound over inputs); and, in another, the attention core on plans built directly
(every type, quantization and feature of the plan, on the calling thread and the library's threads,
against tests/attention_reference.py, and malformed plans); and, in another, com.microsoft::PagedAttention
inside ORT (tests/native/ort_attention_session.py); and, in another, the write op's in-place routes and
the attention's non-finite rules (tests/native/write_session.py). Any invalid access or undefined behaviour
aborts the run.
Threads are forced on (PAKV_ONNX_PARALLEL_MIN_BYTES=0) so the thread split and ORT's ParallelFor
path are checked too; attention splits calls from a small size up (PAKV_ONNX_ATTENTION_PARALLEL_MIN),
so both its loop on the calling thread and its parts on ORT's pool run."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fake_ort_api import build_fake_driver

from pakv_onnx import native_lib

# Building the sanitized library takes about 40 s and the sessions as long again: the slow set (CI runs it).
pytestmark = pytest.mark.slow

SOURCES = Path(native_lib.__file__).parent
SESSION = Path(__file__).parent / "native" / "sanitizer_session.py"
CORE_SESSION = Path(__file__).parent / "native" / "attention_core_session.py"
ORT_ATTENTION_SESSION = Path(__file__).parent / "native" / "ort_attention_session.py"


def _setup_sources() -> list[str]:
    """setup.py's SOURCES (the one list of the library's C files), read without running setup.py."""
    tree = ast.parse((Path(__file__).resolve().parents[1] / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["SOURCES"]:
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no SOURCES list")


C_FILES = _setup_sources()


def _runtime(name: str) -> str:
    path = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    assert os.path.isabs(path) and os.path.exists(path), f"gcc has no {name} (install gcc's sanitizer runtimes)"
    return path


@pytest.fixture(scope="module")
def sanitized_library(tmp_path_factory) -> Path:
    assert shutil.which("gcc"), "gcc is needed for the sanitizer build"
    out = tmp_path_factory.mktemp("asan") / native_lib.LIBRARY_NAME
    flags = ["-std=c11", "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
    flags += ["-fno-omit-frame-pointer", "-fvisibility=hidden", "-pthread", "-shared", "-fPIC", "-Wall", "-Werror"]
    flags += ["-Wno-unused-parameter"]
    subprocess.run(["gcc", *flags, "-o", str(out), *[str(SOURCES / f) for f in C_FILES]], check=True)
    return out


WRITE_SESSION = Path(__file__).parent / "native" / "write_session.py"


def _sanitized_run(library: Path, *args: str, session: Path = SESSION, **env_extra: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        # libstdc++ first: ASan's __cxa_throw interceptor needs it loaded (ORT throws C++ exceptions).
        LD_PRELOAD=f"{_runtime('libasan.so')} {_runtime('libstdc++.so')}",
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",  # CPython's own allocations are not ours
        UBSAN_OPTIONS="print_stacktrace=1",
        PAKV_ONNX_PARALLEL_MIN_BYTES="0",
        PAKV_ONNX_ATTENTION_PARALLEL_MIN="16384",  # multiply-adds: about half the random calls split
        ORT_LOGGING_LEVEL="3",
        **env_extra,
    )
    result = subprocess.run(
        [sys.executable, str(session), str(library), str(SOURCES / "__init__.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    report = result.stdout[-2000:] + result.stderr[-6000:]
    assert result.returncode == 0, f"exit {result.returncode}\n{report}"
    assert "runtime error" not in result.stderr and "AddressSanitizer" not in result.stderr, report
    assert "clean" in result.stdout
    return result


def test_library_is_clean_under_asan_and_ubsan_inside_ort(sanitized_library: Path) -> None:
    _sanitized_run(sanitized_library, "300")


def test_device_entries_are_clean_under_asan_and_ubsan_through_the_fakes(sanitized_library: Path, tmp_path) -> None:
    _sanitized_run(sanitized_library, "400", "--device", str(build_fake_driver(tmp_path)))


def test_paged_attention_is_clean_under_asan_and_ubsan_inside_ort(sanitized_library: Path) -> None:
    _sanitized_run(sanitized_library, "300", "--attention")


@pytest.mark.parametrize("width", ["16", "8"])
def test_attention_core_features_are_clean_under_asan_and_ubsan(sanitized_library: Path, width: str) -> None:
    # Both walks: the widest the CPU runs, and the 8-float one (PAKV_ONNX_ATTENTION_WIDTH=8).
    _sanitized_run(sanitized_library, "300", session=CORE_SESSION, PAKV_ONNX_ATTENTION_WIDTH=width)


def test_ort_paged_attention_is_clean_under_asan_and_ubsan_inside_ort(sanitized_library: Path) -> None:
    """com.microsoft::PagedAttention inside ORT: random valid calls of every feature (caches exact,
    outputs close to the reference), broken calls refused with nothing written, a writer racing the
    block table, cache outputs bound over the other cache (tests/native/ort_attention_session.py)."""
    _sanitized_run(sanitized_library, "150", session=ORT_ATTENTION_SESSION)


def test_the_write_routes_and_attentions_non_finite_rules_are_clean_under_asan_and_ubsan(sanitized_library: Path) -> None:
    """tests/native/write_session.py (issue 27): the write op's routes (copy, bound, fed, alias opt-in), a
    second reader, two writes of one pool, initializer pools, read-only pools and outputs (refused by the
    kernel's writability probe: no signal), degenerate writes, and the attention's non-finite rules."""
    _sanitized_run(sanitized_library, str(Path(__file__).parent), session=WRITE_SESSION)
