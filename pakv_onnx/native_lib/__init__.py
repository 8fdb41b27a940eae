"""The C library (``libpakv_ort.so``): where it is, how to load it, and its ABI as ctypes types.

One shared library serves two callers, neither of which imports the other:

* :mod:`pakv_onnx.kernels.native` calls the copy core directly (:func:`gather` with a :class:`Plan`);
* :mod:`pakv_onnx.runtime_plugin` hands the file to ONNX Runtime (``register_custom_ops_library``)
  and installs the Python callback for Python backends (:class:`Request`).

ORT dlopen's the same real path, so it gets the same loaded library (and the same callback).
When the library loads, its ABI version and struct sizes are checked against the ctypes mirrors
below; a stale build is refused with a message saying how to rebuild.

Layout of the C sources (this directory): ``pakv_core.[ch]`` the copy core (no ORT, no Python),
``pakv_ort.c`` the ORT glue, ``pakv_bridge.[ch]`` the Python bridge, ``pakv_dtypes.h`` the cache
dtype table (checked against :data:`pakv_onnx.spec.CACHE_DTYPES` by a test), ``ort_abi.h`` the
ORT ABI subset.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
import sys
import threading
from pathlib import Path

LIBRARY_NAME = "libpakv_ort.dylib" if sys.platform == "darwin" else "libpakv_ort.so"
ABI_VERSION = 2  # PAKV_ABI_VERSION in pakv_core.h
MAX_RANK = 16  # PAKV_MAX_RANK in pakv_bridge.h
ERROR_LEN = 1024  # PAKV_ERR_LEN in pakv_core.h
NUM_INPUTS = 5  # PAKV_NUM_INPUTS
LAYOUT_NORM, LAYOUT_NZ = 0, 1  # PAKV_LAYOUT_*
# Session config entry the library writes on the SessionOptions it is registered on (pakv_ort.c).
CONFIG_KEY_BACKEND = "pakv_onnx.backend"


class LibraryNotBuiltError(FileNotFoundError):
    """The C library is missing (the package was not built, e.g. a bare source checkout)."""


class LibraryABIError(ImportError):
    """The built library does not match this Python package (a stale build)."""


def _default_path() -> Path:
    return Path(__file__).resolve().parent / LIBRARY_NAME


def library_path() -> str:
    """Absolute real path of the library; ``LibraryNotBuiltError`` if it was not built."""
    path = _default_path()
    if not path.is_file():
        raise LibraryNotBuiltError(
            f"{path} is missing: the C library is built by the package build; run "
            "`pip install -e .` (or `python setup.py build_ext --inplace`) in the repository"
        )
    return os.path.realpath(path)


class Plan(ctypes.Structure):
    """``pakv_plan`` (pakv_core.h): one gather in bytes, handed to ``pakv_gather``."""

    _fields_ = [
        ("abi_version", ctypes.c_uint32),
        ("struct_size", ctypes.c_uint32),
        ("layout", ctypes.c_int32),
        ("tables64", ctypes.c_int32),
        ("num_blocks", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("key_cache", ctypes.c_void_p),
        ("value_cache", ctypes.c_void_p),
        ("key_block_stride", ctypes.c_int64),
        ("value_block_stride", ctypes.c_int64),
        ("key_row_bytes", ctypes.c_int64),
        ("value_row_bytes", ctypes.c_int64),
        ("key_out", ctypes.c_void_p),
        ("value_out", ctypes.c_void_p),
        ("num_seqs", ctypes.c_int64),
        ("table_cols", ctypes.c_int64),
        ("block_tables", ctypes.c_void_p),
        ("seq_lengths", ctypes.c_void_p),
        ("out_starts", ctypes.c_void_p),
        ("col_starts", ctypes.c_void_p),
        ("num_tokens", ctypes.c_int64),
    ]

    def __init__(self, **fields):
        super().__init__(abi_version=ABI_VERSION, struct_size=ctypes.sizeof(Plan), **fields)


class Tensor(ctypes.Structure):
    """``pakv_tensor`` (pakv_bridge.h): one input as ORT hands it to the kernel."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("present", ctypes.c_int32),
        ("elem_type", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("dims", ctypes.c_int64 * MAX_RANK),
    ]


class Request(ctypes.Structure):
    """``pakv_request`` (pakv_bridge.h): one kernel call routed to a Python backend."""

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

# name -> (argtypes, restype) of every exported function besides RegisterCustomOps.
_SIGNATURES = {
    "pakv_abi_version": ([], ctypes.c_int),
    "pakv_plan_size": ([], ctypes.c_size_t),
    "pakv_request_size": ([], ctypes.c_size_t),
    "pakv_gather": ([ctypes.POINTER(Plan), ctypes.c_char_p, ctypes.c_size_t], ctypes.c_int),
    "pakv_bind_next_registration": ([ctypes.c_char_p], ctypes.c_int),
    "pakv_set_python_callback": ([CALLBACK], None),
    "pakv_python_shutdown": ([ctypes.c_long, ctypes.c_long], ctypes.c_long),
    "pakv_request_output": (
        [ctypes.POINTER(Request), ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.c_int],
        ctypes.c_void_p,
    ),
    "pakv_request_set_error": ([ctypes.POINTER(Request), ctypes.c_char_p], None),
    "pakv_gather_raw": ([ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int),
}


def check_abi(lib: ctypes.CDLL, path: str) -> None:
    """Refuse a library whose ABI version or struct sizes differ from the ctypes mirrors here."""
    found = {
        "ABI version": (lib.pakv_abi_version(), ABI_VERSION),
        "sizeof(pakv_plan)": (lib.pakv_plan_size(), ctypes.sizeof(Plan)),
        "sizeof(pakv_request)": (lib.pakv_request_size(), ctypes.sizeof(Request)),
    }
    wrong = [f"{name} is {got} in the library, {want} here" for name, (got, want) in found.items() if got != want]
    if wrong:
        raise LibraryABIError(
            f"{path} does not match this pakv_onnx ({'; '.join(wrong)}): rebuild it with "
            "`pip install -e .` (or `python setup.py build_ext --inplace`)"
        )


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set argtypes/restype of every exported function; ``LibraryABIError`` if one is missing."""
    for name, (argtypes, restype) in _SIGNATURES.items():
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


class _Scratch(threading.local):
    """Per-thread reusable ctypes objects for the hot path: a Plan to fill and an error buffer.

    One Plan per thread (calls on several threads never share one); filling it with one
    ``struct.pack_into`` costs a fraction of building a Structure from 21 keyword arguments.
    """

    def __init__(self) -> None:
        self.plan = Plan()
        self.plan_bytes = memoryview(self.plan).cast("B")
        self.error = ctypes.create_string_buffer(ERROR_LEN)
        self.tensors = (Tensor * (NUM_INPUTS + 2))()
        self.tensor_bytes = memoryview(self.tensors).cast("B")


_scratch = _Scratch()
# pakv_plan in field order, native byte order and alignment (the library checks sizeof at load).
_PLAN_PACKING = struct.Struct("@IIiiqqPPqqqqPPqqPPPPq")
if _PLAN_PACKING.size != ctypes.sizeof(Plan):  # pragma: no cover - a platform with other padding
    _PLAN_PACKING = None


def fill_plan(*values: int) -> Plan:
    """This thread's scratch :class:`Plan`, set to ``values`` (every field after ``struct_size``,
    in :attr:`Plan._fields_` order). Valid until this thread's next call."""
    plan = _scratch.plan
    if _PLAN_PACKING is not None:
        _PLAN_PACKING.pack_into(_scratch.plan_bytes, 0, ABI_VERSION, ctypes.sizeof(Plan), *values)
    else:  # pragma: no cover
        for (name, _), value in zip(Plan._fields_[2:], values):
            setattr(plan, name, value)
    return plan


@functools.cache
def _raw_gather():
    """``pakv_gather`` taking plain addresses (no per-call pointer conversion of a Structure)."""
    fn = load()["pakv_gather"]  # a separate function object: the declared one keeps its argtypes
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


# pakv_tensor is {void* data; int32 present, elem_type, ndim, reserved; int64 dims[MAX_RANK]}.
_TENSOR_HEAD = "Piiii"
_TENSOR_PACKINGS: dict[tuple[int, ...], struct.Struct] = {}


def _tensor_packing(ranks: tuple[int, ...]) -> struct.Struct:
    """One Struct writing len(ranks) pakv_tensor records (dims past each rank left as padding)."""
    packing = _TENSOR_PACKINGS.get(ranks)
    if packing is None:
        fmt = "@" + "".join(f"{_TENSOR_HEAD}{rank}q{(MAX_RANK - rank) * 8}x" for rank in ranks)
        packing = struct.Struct(fmt)
        if packing.size != ctypes.sizeof(Tensor) * len(ranks):  # pragma: no cover - other padding rules
            raise LibraryABIError("pakv_tensor packing does not match its ctypes mirror")
        _TENSOR_PACKINGS[ranks] = packing
    return packing


# One pakv_tensor record with every dim field (how the ORT bridge's request lists its inputs).
TENSOR_RECORD = _tensor_packing((MAX_RANK,))

RAW_DONE, RAW_DECLINED = 0, 1


def gather_raw(ranks: tuple[int, ...], fields: list[int], nz: bool, cumsum: bool) -> int:
    """``pakv_gather_raw`` over 7 tensor records (5 inputs, 2 outputs) of the given ranks.

    ``fields`` holds, per record, ``data, present, elem_type (ONNX), ndim, 0, *dims``. Returns
    :data:`RAW_DONE` or :data:`RAW_DECLINED` (nothing written; the caller takes the full path);
    ``ValueError`` with the core's message if the copy itself failed.
    """
    scratch = _scratch
    _tensor_packing(ranks).pack_into(scratch.tensor_bytes, 0, *fields)
    error = scratch.error
    rc = _raw_gather_inputs()(ctypes.addressof(scratch.tensors), nz, cumsum, ctypes.addressof(error), ERROR_LEN)
    if rc < 0:
        raise ValueError(error.value.decode(errors="replace"))
    return rc


@functools.cache
def _raw_gather_inputs():
    return load().pakv_gather_raw


@functools.cache
def _request_output():
    """``pakv_request_output`` taking plain addresses (a separate function object of the library)."""
    fn = load()["pakv_request_output"]
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    fn.restype = ctypes.c_void_p
    return fn


def request_output(request_address: int, index: int, dims_address: int, rank: int) -> int:
    """``pakv_request_output``: ORT's buffer for output ``index`` of the shape at ``dims_address``
    (``rank`` int64s), or 0 with the request's error set."""
    return _request_output()(request_address, index, dims_address, rank) or 0


def gather(plan: Plan) -> None:
    """Run ``plan`` in the copy core; ``ValueError`` with the core's message if it is refused."""
    error = _scratch.error
    if _raw_gather()(ctypes.addressof(plan), ctypes.addressof(error), ERROR_LEN) != 0:
        raise ValueError(error.value.decode(errors="replace"))
