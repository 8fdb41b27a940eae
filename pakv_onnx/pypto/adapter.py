"""A narrow adapter that hands the real inputs to PyPTO's pass-verify interpreter (pypto 0.2.0 only).

Why: in pypto 0.2.0, ``pypto.frontend.jit`` stages the verify inputs with
``JitCallableWrapper._setup_verify_data``, which allocates zero-filled host tensors and fills
them by a device-to-host copy. Without an NPU that copy does nothing, so the interpreter
runs the kernel on zeros. When every input already lives on the CPU, the adapter registers
the caller's own CPU tensors with ``SetVerifyData`` instead (no copy); the interpreter then
reads the real data and writes its results into the caller's output tensors.

It also caches the interpreter's helper library (``libtile_fwk_calculator.so``, which pypto
otherwise rebuilds with cmake in a temporary directory in every process, 40-90 s) under
:func:`pakv_onnx.paths.cache_dir`, keyed by the pypto and torch versions, built once under a
file lock so concurrent processes share it.

The patched method is private pypto API: :func:`install` refuses any pypto version other than
:data:`SUPPORTED_PYPTO_VERSION` and checks that the pieces it relies on exist.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from pakv_onnx.paths import cache_dir

SUPPORTED_PYPTO_VERSION = "0.2.0"
CALCULATOR_LIB = "lib/libtile_fwk_calculator.so"
HELPER_DIR_ENV = "PAKV_ONNX_PYPTO_HELPER_DIR"


class AdapterError(RuntimeError):
    """The installed pypto is not the version this adapter was written against."""


def pypto_version() -> str | None:
    try:
        return importlib.metadata.version("pypto")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_version() -> None:
    """Raise :class:`AdapterError` unless pypto is exactly the supported version."""
    version = pypto_version()
    try:
        importable = importlib.util.find_spec("pypto") is not None
    except (ImportError, ValueError):  # ValueError: a "pypto" in sys.modules without a spec
        importable = False
    if version is None or not importable:
        raise AdapterError("pypto is not installed (pip install 'pakv-onnx[pypto]')")
    if version != SUPPORTED_PYPTO_VERSION:
        raise AdapterError(
            f"verify-kernel's interpreter adapter was written for pypto {SUPPORTED_PYPTO_VERSION}, "
            f"but pypto {version} is installed; its private verify-data setup may differ, so "
            f"the check refuses to run rather than compare against zeros "
            f"(install pypto=={SUPPORTED_PYPTO_VERSION} or update pakv_onnx/pypto/adapter.py)"
        )


def unavailable_reason() -> str | None:
    """Why PyPTO's CPU toolchain cannot run here (pypto missing or another version), else ``None``."""
    try:
        check_version()
    except AdapterError as err:
        return str(err)
    return None


def _calculator_key() -> str:
    import torch

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return f"pypto-{pypto_version()}-torch-{torch.__version__}-abi{abi}".replace("+", "_")


def calculator_dir() -> Path:
    """Where the cached interpreter helper library lives (installed prefix).

    ``$PAKV_ONNX_PYPTO_HELPER_DIR`` overrides the parent directory, so a run with its own
    cache directory (the tests) can share one build of the helper.
    """
    shared = os.environ.get(HELPER_DIR_ENV)
    base = Path(shared) if shared else cache_dir("pypto", "calculator")
    base.mkdir(parents=True, exist_ok=True)
    return base / _calculator_key()


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_calculator() -> Path:
    """Build the helper library once (cached) and return its path."""
    from pypto._utils import BuildOnlineManager

    final = calculator_dir()
    library = final / CALCULATOR_LIB
    if library.exists():
        return library
    with _file_lock(final.parent / (final.name + ".lock")):
        if library.exists():  # another process built it while we waited
            return library
        manager = BuildOnlineManager()
        torch_ctx = manager._TorchContext()
        cmake = manager._CMakeContext()
        with tempfile.TemporaryDirectory(dir=final.parent) as scratch:
            ctx = cmake.CompileContext(src_dir=Path(manager.pkg_lib_dir, "calculator"), tmp_dir=Path(scratch))
            ctx.cfg_cmd_ext = (
                f"-DPY3_MOD_TORCH_VERSION={torch_ctx.torch_version}"
                f" -DPY3_MOD_TORCH_ROOT_PATH={torch_ctx.torch_root_dir}"
                f" -DPY3_MOD_TORCH_C_GLIBCXX_USE_CXX11_ABI={torch_ctx.torch_c_use_cxx11_abi}"
            )
            ctx.build_job_num = max(1, os.cpu_count() or 1)
            installed = cmake.compile(ctx)
            if not (installed / CALCULATOR_LIB).exists():
                raise RuntimeError(f"pypto's calculator build produced no {CALCULATOR_LIB} under {installed}")
            if final.exists():
                shutil.rmtree(final)
            os.replace(installed, final)
    return library


def _load_calculator() -> None:
    from pypto._utils import BuildOnlineManager

    manager = BuildOnlineManager()
    if manager.calculator_loaded:
        return
    ctypes.CDLL(str(build_calculator()), mode=ctypes.RTLD_GLOBAL)
    manager.calculator_loaded = True


def _setup_verify_data_from_host(pto_tensors) -> None:
    """Replacement for ``JitCallableWrapper._setup_verify_data`` (CPU tensors registered as they are)."""
    import pypto
    from pypto import pypto_impl
    from pypto.frontend.parser import entry
    from pypto.runtime import _pto_verify_datas

    if not pypto.get_verify_options().get("enable_pass_verify"):
        return
    _load_calculator()
    if any(t.device is None or getattr(t.device, "type", None) != "cpu" for t in pto_tensors):
        raise AdapterError("the verify adapter stages CPU tensors only; run verify on CPU inputs")
    pypto_impl.SetVerifyData(entry._pto_to_tensor_data(pto_tensors), [], _pto_verify_datas.get_data())


_installed = False


def install() -> None:
    """Patch pypto (once per process) so pass-verify sees the real CPU inputs."""
    global _installed
    if _installed:
        return
    check_version()
    from pypto import pypto_impl
    from pypto._utils import BuildOnlineManager
    from pypto.frontend.parser import entry
    from pypto.runtime import _pto_verify_datas

    needed = [
        (entry.JitCallableWrapper, "_setup_verify_data"),
        (entry, "_pto_to_tensor_data"),
        (pypto_impl, "SetVerifyData"),
        (_pto_verify_datas, "get_data"),
        (BuildOnlineManager, "_CMakeContext"),
        (BuildOnlineManager, "_TorchContext"),
    ]
    missing = [
        f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"
        for owner, name in needed
        if not hasattr(owner, name)
    ]
    if missing:
        raise AdapterError(f"pypto {pypto_version()} lacks {', '.join(missing)}; the verify adapter cannot run")
    entry.JitCallableWrapper._setup_verify_data = staticmethod(_setup_verify_data_from_host)
    _installed = True
