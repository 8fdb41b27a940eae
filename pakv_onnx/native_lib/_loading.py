"""Where the C library is and how it loads: the built file's path, its ABI checked against the
mirrors of :mod:`._abi` (a stale build is refused with a message saying how to rebuild), every
exported function's prototype declared from :data:`._abi.PROTOTYPES`."""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from pathlib import Path

from pakv_onnx.native_lib._abi import ABI_VERSION, SIGNATURES, SIZED_MIRRORS, LibraryABIError

LIBRARY_NAME = "libpakv_ort.dylib" if sys.platform == "darwin" else "libpakv_ort.so"


class LibraryNotBuiltError(FileNotFoundError):
    """The C library is missing (the package was not built, e.g. a bare source checkout)."""


def library_path() -> str:
    """Absolute real path of the library; ``LibraryNotBuiltError`` if it was not built."""
    path = Path(__file__).resolve().parent / LIBRARY_NAME
    if not path.is_file():
        raise LibraryNotBuiltError(
            f"{path} is missing: the C library is built by the package build; run "
            "`pip install -e .` (or `python setup.py build_ext --inplace`) in the repository"
        )
    return os.path.realpath(path)


def check_abi(lib: ctypes.CDLL, path: str) -> None:
    """Refuse a library whose ABI version or struct sizes differ from the ctypes mirrors."""
    found = {"ABI version": (lib.pakv_abi_version(), ABI_VERSION)}
    for cls in SIZED_MIRRORS:
        found[f"sizeof({cls.C_NAME})"] = (getattr(lib, f"{cls.C_NAME}_size")(), ctypes.sizeof(cls))
    wrong = [f"{name} is {got} in the library, {want} here" for name, (got, want) in found.items() if got != want]
    if wrong:
        raise LibraryABIError(
            f"{path} does not match this pakv_onnx ({'; '.join(wrong)}): rebuild it with "
            "`pip install -e .` (or `python setup.py build_ext --inplace`)"
        )


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set argtypes/restype of every exported function; ``LibraryABIError`` if one is missing."""
    for name, (argtypes, restype) in SIGNATURES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise LibraryABIError(f"the C library has no function {name}: rebuild it (pip install -e .)") from None
        fn.argtypes = argtypes
        fn.restype = restype
    return lib


@functools.cache
def load() -> ctypes.CDLL:
    """The loaded library, signatures declared and ABI checked (cached; never unloaded)."""
    path = library_path()
    lib = declare(ctypes.CDLL(path))
    check_abi(lib, path)
    return lib


@functools.cache
def function(name: str):
    """The library's exported function ``name`` (declared)."""
    return getattr(load(), name)
