"""ctypes view of the custom-op library (``libpakv_ort.so``): loading, signatures, the request struct.

The library is the same file ONNX Runtime dlopen's in ``register_custom_ops_library``; loading it
here by the same real path gives the same handle, so the backend selection and the Python
callback set here are seen by the kernels ORT runs.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from pathlib import Path

LIBRARY_NAME = "libpakv_ort.dylib" if sys.platform == "darwin" else "libpakv_ort.so"
MAX_RANK = 16  # PAKV_MAX_RANK in gather_pa_kv_cache.c
ERROR_LEN = 1024  # PAKV_ERR_LEN
NUM_INPUTS = 5


class LibraryNotBuiltError(FileNotFoundError):
    """The C library is missing (the package was not built, e.g. a bare source checkout)."""


@functools.cache
def _find_library() -> str:
    path = Path(__file__).resolve().parent / LIBRARY_NAME
    return os.path.realpath(path) if path.is_file() else ""


def library_path() -> str:
    """Absolute real path of the custom-op library; ``LibraryNotBuiltError`` if it was not built."""
    found = _find_library()
    if not found:
        _find_library.cache_clear()  # it may be built later in this process
        path = Path(__file__).resolve().parent / LIBRARY_NAME
        raise LibraryNotBuiltError(
            f"{path} is missing: the ONNX Runtime plugin is built by the package build; run "
            "`pip install -e .` (or `python setup.py build_ext --inplace`) in the repository"
        )
    return found


class Tensor(ctypes.Structure):
    """``pakv_tensor``: one input as ORT hands it to the kernel."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("present", ctypes.c_int32),
        ("elem_type", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("dims", ctypes.c_int64 * MAX_RANK),
    ]


class Request(ctypes.Structure):
    """``pakv_request``: one kernel call routed to a Python backend."""

    _fields_ = [
        ("backend", ctypes.c_char_p),
        ("cache_mode", ctypes.c_char_p),
        ("is_seq_lens_cumsum", ctypes.c_int64),
        ("inputs", Tensor * NUM_INPUTS),
        ("ctx", ctypes.c_void_p),
        ("api", ctypes.c_void_p),
        ("error", ctypes.c_char * ERROR_LEN),
    ]


CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(Request))

_I64P = ctypes.POINTER(ctypes.c_int64)


@functools.cache
def load() -> ctypes.CDLL:
    """The loaded library with argument types declared (cached; never unloaded)."""
    lib = ctypes.CDLL(library_path())
    lib.pakv_select_backend_for_next_registration.argtypes = [ctypes.c_char_p]
    lib.pakv_select_backend_for_next_registration.restype = ctypes.c_int
    lib.pakv_set_python_callback.argtypes = [CALLBACK]
    lib.pakv_set_python_callback.restype = None
    lib.pakv_python_shutdown.argtypes = [ctypes.c_int]
    lib.pakv_python_shutdown.restype = ctypes.c_long
    lib.pakv_request_output.argtypes = [ctypes.POINTER(Request), ctypes.c_int, _I64P, ctypes.c_int]
    lib.pakv_request_output.restype = ctypes.c_void_p
    lib.pakv_request_set_error.argtypes = [ctypes.POINTER(Request), ctypes.c_char_p]
    lib.pakv_request_set_error.restype = None
    lib.pakv_api_version.restype = ctypes.c_int
    lib.pakv_cache_dtype_count.restype = ctypes.c_int
    lib.pakv_cache_dtype_at.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
    lib.pakv_cache_dtype_at.restype = ctypes.c_int
    i64 = ctypes.c_int64
    vp = ctypes.c_void_p
    lib.pakv_gather_plan.argtypes = [
        ctypes.c_int,
        i64,
        i64,
        vp,
        vp,
        i64,
        i64,
        vp,
        vp,
        i64,
        i64,
        vp,
        vp,
        vp,
        vp,
        i64,
        ctypes.c_char_p,
        ctypes.c_size_t,
    ]
    lib.pakv_gather_plan.restype = ctypes.c_int
    return lib


def cache_dtypes() -> list[tuple[int, int]]:
    """(ONNX type, itemsize) of every cache dtype the C library registers a kernel for."""
    lib = load()
    out = []
    for i in range(lib.pakv_cache_dtype_count()):
        onnx_type, itemsize = ctypes.c_int(), ctypes.c_int()
        lib.pakv_cache_dtype_at(i, ctypes.byref(onnx_type), ctypes.byref(itemsize))
        out.append((onnx_type.value, itemsize.value))
    return out
