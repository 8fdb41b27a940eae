"""The C library (``libpakv_ort.so``): where it is, how to load it, and its ABI as ctypes types.

One shared library serves two callers, neither of which imports the other:

* :mod:`pakv_onnx.validator` hands calls to the C validator, :mod:`pakv_onnx.kernels.native` runs
  its plans in the copy core (:func:`run_plan`, :func:`run_scatter`) and the attention core
  (:func:`run_attention`);
* :mod:`pakv_onnx.runtime_plugin` hands the file to ONNX Runtime (``register_custom_ops_library``)
  and installs the Python callback for Python backends (:class:`Request`).

ORT dlopen's the same real path, so it gets the same loaded library (and the same callback).
When the library loads, its ABI version and struct sizes are checked against the ctypes mirrors
below; a stale build is refused with a message saying how to rebuild.

Layout of the C sources (this directory): ``pakv_contract.[ch]`` the contract's validator (every
rule and its message; :mod:`pakv_onnx.validator` calls it from Python), ``pakv_core.[ch]`` the copy
core (no ORT, no Python), ``pakv_attention*.c`` the attention core of both paged-attention ops (its
plan is declared in pakv_core.h: ``_check`` its checks, ``_part`` one part, ``pakv_attention.c`` the
run), ``pakv_ort.[ch]`` the ORT kernels and ``pakv_ort_register.c`` the ops ORT reads (the ORT
glue), ``pakv_bridge.[ch]`` the Python bridge,
``pakv_dtypes.h`` the cache dtype table (checked against :data:`pakv_onnx.spec.CACHE_DTYPES` by a
test), ``ort_abi.h`` the ORT ABI subset, ``pakv_ep.[ch]`` the execution providers (CPU, CUDA, CANN
entries; ORT's stream and intra-op pool), ``pakv_device.[ch]`` the device copies through the CUDA /
CANN driver opened with dlopen, ``device_abi.h`` those drivers' ABI subset.
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
ABI_VERSION = 6  # PAKV_ABI_VERSION in pakv_core.h
MAX_RANK = 8  # PAKV_MAX_RANK in pakv_contract.h
DEVICE_LEN = 24  # PAKV_DEVICE_LEN in pakv_contract.h
ERROR_LEN = 1024  # PAKV_ERR_LEN in pakv_core.h
ERR_VALUE, ERR_TYPE = 1, 2  # PAKV_ERR_* in pakv_core.h: what the validator's answer raises
NUM_INPUTS = 6  # PAKV_NUM_INPUTS (the most inputs an op has: PagedAttention's)
LAYOUT_NORM, LAYOUT_NZ = 0, 1  # PAKV_LAYOUT_*
# Session config entry the library writes on the SessionOptions it is registered on (pakv_ort.c).
CONFIG_KEY_BACKEND = "pakv_onnx.backend"
# Session config entry opting a registration into the write op's alias route ("1"; the library writes "0" or
# "1" when it registers: pakv_ort_register.c).
CONFIG_KEY_ALIAS = "pakv_onnx.alias_caches"


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
    """``pakv_plan`` (pakv_core.h): one gather in bytes, made by the validator, run by ``pakv_gather``."""

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
        ("table_row_stride", ctypes.c_int64),
        ("table_col_stride", ctypes.c_int64),
        ("seq_lengths", ctypes.c_void_p),
        ("out_starts", ctypes.c_void_p),
        ("col_starts", ctypes.c_void_p),
        ("num_tokens", ctypes.c_int64),
        ("out_rank", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("key_out_dims", ctypes.c_int64 * 3),
        ("value_out_dims", ctypes.c_int64 * 3),
    ]

    def __init__(self, **fields):
        super().__init__(abi_version=ABI_VERSION, struct_size=ctypes.sizeof(Plan), **fields)


# pakv_plan as one struct format (native byte order and alignment; the library checks sizeof at load).
PLAN_FORMAT = "@IIiiqqPPqqqqPPqqPqqPPPqii3q3q"
# Position of each Plan field in PLAN_FORMAT's unpacked tuple (an array field: its first element).
PLAN_FIELD_AT: dict[str, int] = {}
for _name, _ctype in Plan._fields_:
    PLAN_FIELD_AT[_name] = sum(getattr(t, "_length_", 1) for n, t in Plan._fields_[: len(PLAN_FIELD_AT)])
del _name, _ctype


def plan_dims(fields: tuple[int, ...], name: str, rank: int) -> tuple[int, ...]:
    """``key_out_dims`` / ``value_out_dims`` of an unpacked plan, ``rank`` of them."""
    at = PLAN_FIELD_AT[name]
    return fields[at : at + rank]


class Tensor(ctypes.Structure):
    """``pakv_tensor`` (pakv_contract.h): one tensor as the validator sees it."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("host_data", ctypes.c_void_p),
        ("present", ctypes.c_int32),
        ("elem_type", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("device", ctypes.c_char * DEVICE_LEN),
        ("dims", ctypes.c_int64 * MAX_RANK),
        ("strides", ctypes.c_int64 * MAX_RANK),
    ]


class GatherCall(ctypes.Structure):
    """``pakv_gather_call`` (pakv_contract.h): one validation handed over in one piece."""

    _fields_ = [
        ("plan", Plan),
        ("records", Tensor * 7),
        ("nz", ctypes.c_int32),
        ("cumsum", ctypes.c_int32),
        ("scratch_len", ctypes.c_int64),
        ("scratch", ctypes.c_void_p),
        ("error", ctypes.c_void_p),
    ]


class ScatterPlan(ctypes.Structure):
    """``pakv_scatter_plan`` (pakv_core.h): one scatter in bytes, made by the validator, run by ``pakv_scatter``."""

    _fields_ = [
        ("abi_version", ctypes.c_uint32),
        ("struct_size", ctypes.c_uint32),
        ("layout", ctypes.c_int32),
        ("slots64", ctypes.c_int32),
        ("num_blocks", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("key_cache", ctypes.c_void_p),
        ("value_cache", ctypes.c_void_p),
        ("key_block_stride", ctypes.c_int64),
        ("value_block_stride", ctypes.c_int64),
        ("key_row_bytes", ctypes.c_int64),
        ("value_row_bytes", ctypes.c_int64),
        ("key", ctypes.c_void_p),
        ("value", ctypes.c_void_p),
        ("key_token_stride", ctypes.c_int64),
        ("value_token_stride", ctypes.c_int64),
        ("num_tokens", ctypes.c_int64),
        ("slot_mapping", ctypes.c_void_p),
        ("slot_stride", ctypes.c_int64),
    ]


class ScatterCall(ctypes.Structure):
    """``pakv_scatter_call`` (pakv_contract.h): one scatter validation handed over in one piece."""

    _fields_ = [
        ("plan", ScatterPlan),
        ("records", Tensor * 7),
        ("nz", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("scratch_len", ctypes.c_int64),
        ("scratch", ctypes.c_void_p),
        ("error", ctypes.c_void_p),
    ]


class AttentionPlan(ctypes.Structure):
    """``pakv_attention_plan`` (pakv_core.h): one paged attention in bytes, made by a validator, run by ``pakv_attention``."""

    _fields_ = [
        ("abi_version", ctypes.c_uint32),
        ("struct_size", ctypes.c_uint32),
        ("query_type", ctypes.c_int32),
        ("out_type", ctypes.c_int32),
        ("tables64", ctypes.c_int32),
        ("causal", ctypes.c_int32),
        ("num_blocks", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("key_cache", ctypes.c_void_p),
        ("value_cache", ctypes.c_void_p),
        ("key_type", ctypes.c_int32),
        ("value_type", ctypes.c_int32),
        ("key_quant", ctypes.c_int32),
        ("value_quant", ctypes.c_int32),
        ("key_scale", ctypes.c_void_p),
        ("value_scale", ctypes.c_void_p),
        ("key_block_stride", ctypes.c_int64),
        ("value_block_stride", ctypes.c_int64),
        ("key_row_stride", ctypes.c_int64),
        ("value_row_stride", ctypes.c_int64),
        ("key_head_stride", ctypes.c_int64),
        ("value_head_stride", ctypes.c_int64),
        ("num_heads", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("value_head_dim", ctypes.c_int64),
        ("query", ctypes.c_void_p),
        ("query_token_stride", ctypes.c_int64),
        ("query_head_stride", ctypes.c_int64),
        ("out", ctypes.c_void_p),
        ("num_tokens", ctypes.c_int64),
        ("num_seqs", ctypes.c_int64),
        ("table_cols", ctypes.c_int64),
        ("block_tables", ctypes.c_void_p),
        ("table_row_stride", ctypes.c_int64),
        ("table_col_stride", ctypes.c_int64),
        ("query_starts", ctypes.c_void_p),
        ("query_counts", ctypes.c_void_p),
        ("context_lens", ctypes.c_void_p),
        ("scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
        ("window", ctypes.c_int64),
        ("head_sink", ctypes.c_void_p),
    ]


class AttentionCall(ctypes.Structure):
    """``pakv_attention_call`` (pakv_contract.h): one attention validation handed over in one piece."""

    _fields_ = [
        ("plan", AttentionPlan),
        ("records", Tensor * 7),
        ("scale", ctypes.c_float),
        ("reserved", ctypes.c_int32),
        ("scratch_len", ctypes.c_int64),
        ("scratch", ctypes.c_void_p),
        ("error", ctypes.c_void_p),
    ]


FUSED_STRING_LEN = 32  # PAKV_FUSED_STRING_LEN in pakv_fused.h
FUSED_RECORDS = 20  # PAKV_FUSED_RECORDS: com.microsoft::PagedAttention's 17 inputs and 3 outputs


class FusedAttributes(ctypes.Structure):
    """``pakv_fused_attributes`` (pakv_fused.h): com.microsoft::PagedAttention's attributes as given."""

    _fields_ = [
        ("num_heads", ctypes.c_int64),
        ("kv_num_heads", ctypes.c_int64),
        ("local_window_size", ctypes.c_int64),
        ("is_causal", ctypes.c_int64),
        ("do_rotary", ctypes.c_int64),
        ("rotary_interleaved", ctypes.c_int64),
        ("v_head_size", ctypes.c_int64),
        ("rotary_offset", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
        ("qk_norm_epsilon", ctypes.c_float),
        ("given", ctypes.c_int32),
        ("k_quant_type", ctypes.c_char * FUSED_STRING_LEN),
        ("v_quant_type", ctypes.c_char * FUSED_STRING_LEN),
        ("k_cache_dtype", ctypes.c_char * FUSED_STRING_LEN),
        ("v_cache_dtype", ctypes.c_char * FUSED_STRING_LEN),
        ("kv_cache_layout", ctypes.c_char * FUSED_STRING_LEN),
    ]


class FusedPlan(ctypes.Structure):
    """``pakv_fused_plan`` (pakv_fused.h): one com.microsoft::PagedAttention in bytes (prologue, then
    its ``attention`` plan), made by the validator, run by ``pakv_fused_attention``."""

    _fields_ = [
        ("abi_version", ctypes.c_uint32),
        ("struct_size", ctypes.c_uint32),
        ("query_type", ctypes.c_int32),
        ("cache_type", ctypes.c_int32),
        ("key_quant", ctypes.c_int32),
        ("value_quant", ctypes.c_int32),
        ("latent", ctypes.c_int32),
        ("normalize", ctypes.c_int32),
        ("rotary_interleaved", ctypes.c_int32),
        ("prepare_query", ctypes.c_int32),
        ("num_tokens", ctypes.c_int64),
        ("num_heads", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("query", ctypes.c_void_p),
        ("query_token_stride", ctypes.c_int64),
        ("key", ctypes.c_void_p),
        ("key_token_stride", ctypes.c_int64),
        ("value", ctypes.c_void_p),
        ("value_token_stride", ctypes.c_int64),
        ("q_norm_weight", ctypes.c_void_p),
        ("k_norm_weight", ctypes.c_void_p),
        ("epsilon", ctypes.c_float),
        ("reserved", ctypes.c_int32),
        ("cos_cache", ctypes.c_void_p),
        ("sin_cache", ctypes.c_void_p),
        ("rotary_dim", ctypes.c_int64),
        ("rotary_offset", ctypes.c_int64),
        ("rotary_rows", ctypes.c_int64),
        ("key_scale", ctypes.c_void_p),
        ("value_scale", ctypes.c_void_p),
        ("key_cache", ctypes.c_void_p),
        ("value_cache", ctypes.c_void_p),
        ("num_blocks", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("key_block_stride", ctypes.c_int64),
        ("value_block_stride", ctypes.c_int64),
        ("key_row_bytes", ctypes.c_int64),
        ("value_row_bytes", ctypes.c_int64),
        ("slots", ctypes.c_void_p),
        ("positions", ctypes.c_void_p),
        ("query_rows", ctypes.c_void_p),
        ("attention", AttentionPlan),
    ]


class FusedCall(ctypes.Structure):
    """``pakv_fused_call`` (pakv_fused.h): one com.microsoft::PagedAttention validation handed over in one piece."""

    _fields_ = [
        ("plan", FusedPlan),
        ("records", Tensor * FUSED_RECORDS),
        ("attributes", FusedAttributes),
        ("scratch_len", ctypes.c_int64),
        ("scratch", ctypes.c_void_p),
        ("error", ctypes.c_void_p),
    ]


class Request(ctypes.Structure):
    """``pakv_request`` (pakv_bridge.h): one kernel call routed to a Python backend."""

    _fields_ = [
        ("backend", ctypes.c_char_p),
        ("op", ctypes.c_char_p),
        ("cache_mode", ctypes.c_char_p),
        ("is_seq_lens_cumsum", ctypes.c_int64),
        ("scale", ctypes.c_float),  # PagedAttention's attribute
        ("num_inputs", ctypes.c_int32),
        ("inputs", Tensor * NUM_INPUTS),
        ("ctx", ctypes.c_void_p),
        ("api", ctypes.c_void_p),
        ("stream", ctypes.c_void_p),  # ORT's compute stream on a device EP, else NULL
        ("error", ctypes.c_char * ERROR_LEN),
    ]


CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(Request))

# name -> (argtypes, restype) of every exported function besides RegisterCustomOps.
_SIGNATURES = {
    "pakv_abi_version": ([], ctypes.c_int),
    "pakv_plan_size": ([], ctypes.c_size_t),
    "pakv_tensor_size": ([], ctypes.c_size_t),
    "pakv_request_size": ([], ctypes.c_size_t),
    "pakv_gather_call_size": ([], ctypes.c_size_t),
    "pakv_plan_gather": ([ctypes.c_void_p], ctypes.c_int),
    "pakv_check_gather_outputs": ([ctypes.c_void_p], ctypes.c_int),
    "pakv_gather": ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int),
    "pakv_scatter_plan_size": ([], ctypes.c_size_t),
    "pakv_scatter_call_size": ([], ctypes.c_size_t),
    "pakv_plan_scatter": ([ctypes.c_void_p], ctypes.c_int),
    "pakv_scatter": ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int),
    "pakv_scatter_writable": ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int),
    "pakv_buffer_writable": (
        [ctypes.c_void_p, ctypes.c_int64, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t],
        ctypes.c_int,
    ),
    "pakv_attention_plan_size": ([], ctypes.c_size_t),
    "pakv_attention_call_size": ([], ctypes.c_size_t),
    "pakv_plan_attention": ([ctypes.c_void_p], ctypes.c_int),
    "pakv_check_attention_output": ([ctypes.c_void_p], ctypes.c_int),
    "pakv_attention": ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int),
    "pakv_fused_plan_size": ([], ctypes.c_size_t),
    "pakv_fused_call_size": ([], ctypes.c_size_t),
    "pakv_fused_defaults": ([ctypes.c_void_p], None),
    "pakv_fused_string_attribute": ([ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t], None),
    "pakv_fused_scratch_needed": ([ctypes.c_void_p], ctypes.c_int64),
    "pakv_fused_bind_plan": ([ctypes.c_void_p] * 5, None),
    "pakv_plan_fused": ([ctypes.c_void_p], ctypes.c_int),
    "pakv_check_fused_outputs": ([ctypes.c_void_p], ctypes.c_int),
    "pakv_fused_attention": ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int),
    "pakv_fused_writable": ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int),
    "pakv_cuda_copy_paths": ([ctypes.c_void_p], None),
    "pakv_attention_threads": ([ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int),
    "pakv_bind_next_registration": ([ctypes.c_char_p], ctypes.c_int),
    "pakv_bind_next_alias": ([ctypes.c_int], None),
    "pakv_set_python_callback": ([CALLBACK], None),
    "pakv_python_shutdown": ([ctypes.c_long, ctypes.c_long], ctypes.c_long),
    "pakv_request_output": ([ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int], ctypes.c_void_p),
    "pakv_request_set_error": ([ctypes.POINTER(Request), ctypes.c_char_p], None),
}


def check_abi(lib: ctypes.CDLL, path: str) -> None:
    """Refuse a library whose ABI version or struct sizes differ from the ctypes mirrors here."""
    found = {
        "ABI version": (lib.pakv_abi_version(), ABI_VERSION),
        "sizeof(pakv_plan)": (lib.pakv_plan_size(), ctypes.sizeof(Plan)),
        "sizeof(pakv_tensor)": (lib.pakv_tensor_size(), ctypes.sizeof(Tensor)),
        "sizeof(pakv_gather_call)": (lib.pakv_gather_call_size(), ctypes.sizeof(GatherCall)),
        "sizeof(pakv_scatter_plan)": (lib.pakv_scatter_plan_size(), ctypes.sizeof(ScatterPlan)),
        "sizeof(pakv_scatter_call)": (lib.pakv_scatter_call_size(), ctypes.sizeof(ScatterCall)),
        "sizeof(pakv_attention_plan)": (lib.pakv_attention_plan_size(), ctypes.sizeof(AttentionPlan)),
        "sizeof(pakv_attention_call)": (lib.pakv_attention_call_size(), ctypes.sizeof(AttentionCall)),
        "sizeof(pakv_fused_plan)": (lib.pakv_fused_plan_size(), ctypes.sizeof(FusedPlan)),
        "sizeof(pakv_fused_call)": (lib.pakv_fused_call_size(), ctypes.sizeof(FusedCall)),
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
    """Per-thread reusable buffers for the hot path: a plan to run and an error buffer."""

    def __init__(self) -> None:
        self.plan = Plan()
        self.plan_address = ctypes.addressof(self.plan)
        self.plan_bytes = memoryview(self.plan).cast("B")
        self.error = ctypes.create_string_buffer(ERROR_LEN)
        self.error_address = ctypes.addressof(self.error)


_scratch = _Scratch()
if struct.calcsize(PLAN_FORMAT) != ctypes.sizeof(Plan):  # pragma: no cover - a platform with other padding
    raise LibraryABIError("PLAN_FORMAT does not match the Plan mirror on this platform")

_RECORD_PACKINGS: dict[tuple[int, ...], struct.Struct] = {}


def records_packing(ranks: tuple[int, ...]) -> struct.Struct:
    """The Struct writing consecutive pakv_tensor records of these kept ranks (-1: an absent record,
    all zero), each ``data, host_data, present, elem_type, ndim, reserved, device, *dims, *strides``."""
    packing = _RECORD_PACKINGS.get(ranks)
    if packing is None:
        parts = []
        for rank in ranks:
            pad = (MAX_RANK - rank) * 8
            parts.append(f"{ctypes.sizeof(Tensor)}x" if rank < 0 else f"PPiiii{DEVICE_LEN}s{rank}q{pad}x{rank}q{pad}x")
        packing = struct.Struct("@" + "".join(parts))
        if packing.size != ctypes.sizeof(Tensor) * len(ranks):  # pragma: no cover - other padding rules
            raise LibraryABIError("pakv_tensor packing does not match its ctypes mirror")
        _RECORD_PACKINGS[ranks] = packing
    return packing


# One full record, every dim and stride (how the ORT bridge's request lists its inputs).
TENSOR_RECORD = records_packing((MAX_RANK,))


@functools.cache
def _function(name: str):
    return getattr(load(), name)


class _Fast:
    """The hot calls without ctypes: the front's extension (``_front``, pakv_front.c) calls the
    library's functions through their addresses, the GIL released as ctypes does. Bound on first use
    (importing the package loads no native code)."""

    def __init__(self) -> None:
        module = front()
        self.call, self.run = module.call, module.run
        address = {name: ctypes.cast(_function(name), ctypes.c_void_p).value for name in _FAST_FUNCTIONS}
        self.plan_gather, self.check_gather_outputs, self.plan_scatter, self.gather, self.scatter = (
            address[name] for name in _FAST_FUNCTIONS
        )


_FAST_FUNCTIONS = ("pakv_plan_gather", "pakv_check_gather_outputs", "pakv_plan_scatter", "pakv_gather", "pakv_scatter")
_fast: _Fast | None = None


def fast() -> _Fast:
    """The bound hot calls (see :class:`_Fast`)."""
    global _fast
    if _fast is None:
        _fast = _Fast()
    return _fast


@functools.cache
def front():
    """The front's extension module, checked against the ctypes mirror; ``LibraryABIError`` if it is
    missing or was built against another ``pakv_tensor``."""
    try:
        from pakv_onnx.native_lib import _front
    except ImportError as exc:
        raise LibraryABIError(
            f"pakv_onnx's extension _front cannot be imported ({exc}): rebuild it with `pip install -e .` "
            "(or `python setup.py build_ext --inplace`)"
        ) from None
    if _front.record_size() != ctypes.sizeof(Tensor):
        raise LibraryABIError(
            f"{_front.__file__} writes pakv_tensor records of {_front.record_size()} bytes, this pakv_onnx "
            f"{ctypes.sizeof(Tensor)}: rebuild it with `pip install -e .`"
        )
    return _front


def plan_gather_call(call: int) -> int:
    """``pakv_plan_gather`` on the GatherCall at ``call``: 0, or :data:`ERR_VALUE` / :data:`ERR_TYPE`
    with the message at the call's ``error``."""
    hot = _fast or fast()
    return hot.call(hot.plan_gather, call)


def plan_scatter_call(call: int) -> int:
    """``pakv_plan_scatter`` on the ScatterCall at ``call`` (see :func:`plan_gather_call`)."""
    hot = _fast or fast()
    return hot.call(hot.plan_scatter, call)


def run_scatter(plan_address: int) -> None:
    """Run the validated pakv_scatter_plan at ``plan_address`` (it writes its caches in place)."""
    hot, scratch = _fast or fast(), _scratch
    if hot.run(hot.scatter, plan_address, scratch.error_address, ERROR_LEN) != 0:
        raise ValueError(scratch.error.value.decode(errors="replace"))


def check_scatter_writable(plan_address: int) -> None:
    """``ValueError`` (nothing written) unless the caches of the validated pakv_scatter_plan at
    ``plan_address`` can be written where it writes (asked of the kernel: a read-only pool is never a
    signal); what a Python backend calls before it writes host caches (the C scatter asks itself)."""
    hot, scratch = _fast or fast(), _scratch
    if hot.run(ctypes.cast(_function("pakv_scatter_writable"), ctypes.c_void_p).value, plan_address,
               scratch.error_address, ERROR_LEN) != 0:  # fmt: skip
        raise ValueError(scratch.error.value.decode(errors="replace"))


def check_buffer_writable(address: int, size: int, name: str) -> None:
    """``ValueError`` naming ``name`` unless the ``size`` bytes at ``address`` can be written (their first
    and last byte, asked of the kernel)."""
    scratch = _scratch
    if _function("pakv_buffer_writable")(address, size, name.encode(), scratch.error_address, ERROR_LEN) != 0:
        raise ValueError(scratch.error.value.decode(errors="replace"))


def check_gather_outputs_call(call: int) -> int:
    """``pakv_check_gather_outputs`` on the GatherCall at ``call`` (see :func:`plan_gather_call`)."""
    hot = _fast or fast()
    return hot.call(hot.check_gather_outputs, call)


def request_output(request_address: int, index: int, dims_address: int, rank: int) -> int:
    """``pakv_request_output``: ORT's buffer for output ``index`` of the shape at ``dims_address``
    (``rank`` int64s), or 0 with the request's error set."""
    return _function("pakv_request_output")(request_address, index, dims_address, rank) or 0


_OUT_OFFSETS = (Plan.key_out.offset, Plan.value_out.offset)


def run_gather(plan_address: int, key_out: int, value_out: int) -> None:
    """Run the plan at ``plan_address`` (a validated pakv_plan) in the copy core, writing to the two
    output addresses; ``ValueError`` with the core's message if it refuses. The plan is copied
    into this thread's scratch first, so one plan may run on several threads at once."""
    scratch = _scratch
    ctypes.memmove(scratch.plan_address, plan_address, ctypes.sizeof(Plan))
    struct.pack_into("@PP", scratch.plan_bytes, _OUT_OFFSETS[0], key_out, value_out)
    run_plan(scratch.plan_address)


def run_plan(plan_address: int) -> None:
    """Run the validated pakv_plan at ``plan_address`` as it is (its own output addresses)."""
    hot, scratch = _fast or fast(), _scratch
    if hot.run(hot.gather, plan_address, scratch.error_address, ERROR_LEN) != 0:
        raise ValueError(scratch.error.value.decode(errors="replace"))


# pakv_scatter_plan as one struct format, and each field's position in its unpacked tuple.
SCATTER_PLAN_FORMAT = "@IIiiqqPPqqqqPPqqqPq"
SCATTER_PLAN_FIELD_AT: dict[str, int] = {name: i for i, (name, _) in enumerate(ScatterPlan._fields_)}
if struct.calcsize(SCATTER_PLAN_FORMAT) != ctypes.sizeof(ScatterPlan):  # pragma: no cover
    raise LibraryABIError("SCATTER_PLAN_FORMAT does not match the ScatterPlan mirror on this platform")


def plan_attention_call(call: int) -> int:
    """``pakv_plan_attention`` on the AttentionCall at ``call`` (see :func:`plan_gather_call`)."""
    return _function("pakv_plan_attention")(call)


def check_attention_output_call(call: int) -> int:
    """``pakv_check_attention_output`` on the AttentionCall at ``call`` (see :func:`plan_gather_call`)."""
    return _function("pakv_check_attention_output")(call)


def run_attention(plan_address: int, threads: int = 1) -> None:
    """Run the validated pakv_attention_plan at ``plan_address`` (it writes its output) on this thread,
    or split over ``threads`` of the library's threads (the same answer, bit for bit)."""
    error = _scratch.error_address
    if threads == 1:
        kind = _function("pakv_attention")(plan_address, error, ERROR_LEN)
    else:
        kind = _function("pakv_attention_threads")(plan_address, threads, error, ERROR_LEN)
    if kind != 0:  # ERR_TYPE: the plan names a type the core does not read
        raise (TypeError if kind == ERR_TYPE else ValueError)(_scratch.error.value.decode(errors="replace"))


# pakv_attention_plan as one struct format, and each field's position in its unpacked tuple.
ATTENTION_PLAN_FORMAT = "@IIiiiiqqPPiiiiPPqqqqqqqqqqPqqPqqqPqqPPPffqP"
ATTENTION_PLAN_FIELD_AT: dict[str, int] = {name: i for i, (name, _) in enumerate(AttentionPlan._fields_)}
if struct.calcsize(ATTENTION_PLAN_FORMAT) != ctypes.sizeof(AttentionPlan):  # pragma: no cover
    raise LibraryABIError("ATTENTION_PLAN_FORMAT does not match the AttentionPlan mirror on this platform")


def plan_fused_call(call: int) -> int:
    """``pakv_plan_fused`` on the FusedCall at ``call`` (see :func:`plan_gather_call`)."""
    return _function("pakv_plan_fused")(call)


def check_fused_outputs_call(call: int) -> int:
    """``pakv_check_fused_outputs`` on the FusedCall at ``call`` (see :func:`plan_gather_call`)."""
    return _function("pakv_check_fused_outputs")(call)


def fused_scratch_needed(call: int) -> int:
    """int64 scratch entries the FusedCall at ``call`` needs (its records written), or -1."""
    return _function("pakv_fused_scratch_needed")(call)


def fused_defaults(attributes: int) -> None:
    """Fill the pakv_fused_attributes at ``attributes`` with ORT's schema defaults."""
    _function("pakv_fused_defaults")(attributes)


def fused_string_attribute(field: int, text: bytes) -> None:
    """A string attribute's bytes into the pakv_fused_attributes field at ``field`` as the C rules see it
    (cut past FUSED_STRING_LEN - 1 bytes; with a NUL byte inside, described, so the rule refuses it by name)."""
    _function("pakv_fused_string_attribute")(field, text, len(text))


def check_fused_writable(plan_address: int) -> None:
    """``ValueError`` (nothing written) unless the caches of the validated pakv_fused_plan at ``plan_address``
    can be written where its prologue writes (asked of the kernel): what a Python backend calls first."""
    error = _scratch.error_address
    if load().pakv_fused_writable(plan_address, error, ERROR_LEN) != 0:
        raise ValueError(_scratch.error.value.decode(errors="replace"))


def run_fused(plan_address: int, out: int, query_rows: int, key_cache: int, value_cache: int) -> None:
    """Bind the validated pakv_fused_plan at ``plan_address`` to its buffers and run it on this thread
    (the prologue writes the caches in place, then the attention writes ``out``)."""
    lib = load()
    lib.pakv_fused_bind_plan(plan_address, out, query_rows, key_cache, value_cache)
    error = _scratch.error_address
    if lib.pakv_fused_attention(plan_address, error, ERROR_LEN) != 0:
        raise ValueError(_scratch.error.value.decode(errors="replace"))


# How the CUDA entries issued a call's copies (pakv_device.c), in the order the C counters are kept.
CUDA_COPY_PATHS = ("runs", "batch", "kernel")


def cuda_copy_paths() -> dict[str, int]:
    """Calls of the CUDA device entries since the library loaded, per copy path: ``runs`` (one
    cuMemcpyDtoDAsync per run: an old driver, a single copy, or ``PAKV_ONNX_CUDA_COPY=runs``),
    ``batch`` (one cuMemcpyBatchAsync) and ``kernel`` (one launch of the embedded copy kernel).
    What ORT loaded is this same library file, so its counters are these."""
    counts = (ctypes.c_longlong * len(CUDA_COPY_PATHS))()
    load().pakv_cuda_copy_paths(ctypes.addressof(counts))
    return dict(zip(CUDA_COPY_PATHS, counts))
