"""The C library's ABI as ctypes types, each written once: the struct mirrors (one table of every
struct's fields, from which the ctypes classes, the ``struct`` formats and field positions are derived), and
one prototype table of every exported function (:data:`PROTOTYPES`). :mod:`._loading` checks the
loaded library against them; nothing here loads anything."""

from __future__ import annotations

import ctypes
import re
import struct

ABI_VERSION = 7  # PAKV_ABI_VERSION in pakv_core.h
MAX_RANK = 8  # PAKV_MAX_RANK in pakv_contract.h
DEVICE_LEN = 24  # PAKV_DEVICE_LEN in pakv_contract.h
ERROR_LEN = 1024  # PAKV_ERR_LEN in pakv_core.h
ERR_VALUE, ERR_TYPE = 1, 2  # PAKV_ERR_* in pakv_core.h: what the validator's answer raises
NUM_INPUTS = 6  # PAKV_NUM_INPUTS (the most inputs an op has: PagedAttention's)
LAYOUT_NORM, LAYOUT_NZ = 0, 1  # PAKV_LAYOUT_*
FUSED_STRING_LEN = 32  # PAKV_FUSED_STRING_LEN in pakv_fused.h
FUSED_RECORDS = 20  # PAKV_FUSED_RECORDS: com.microsoft::PagedAttention's 17 inputs and 3 outputs


class LibraryABIError(ImportError):
    """The built library does not match this Python package (a stale build)."""


# Scalar C types of the tables: ctypes type and struct format letter.
_SCALARS = {
    "u32": (ctypes.c_uint32, "I"),
    "i32": (ctypes.c_int32, "i"),
    "i64": (ctypes.c_int64, "q"),
    "f32": (ctypes.c_float, "f"),
    "ptr": (ctypes.c_void_p, "P"),
    "str": (ctypes.c_char_p, "P"),
    "char": (ctypes.c_char, "s"),
}
_MIRRORS: dict[str, type[ctypes.Structure]] = {}


def _ctype(name: str):
    """``"i64"`` / ``"i64[3]"`` / ``"Tensor[7]"`` -> its ctypes type (a mirror named by its class)."""
    base, _, count = name.partition("[")
    scalar = _SCALARS[base][0] if base in _SCALARS else _MIRRORS[base]
    return scalar * int(count.rstrip("]")) if count else scalar


def struct_format(cls: type[ctypes.Structure]) -> str:
    """The ``struct`` format of a mirror of scalars and scalar arrays (native order and alignment)."""
    parts = []
    for _, ctype in cls._fields_:
        count = getattr(ctype, "_length_", 1)
        element = ctype._type_ if hasattr(ctype, "_length_") else ctype
        letter = next(fmt for t, fmt in _SCALARS.values() if t is element)
        parts.append(f"{count}{letter}" if count > 1 or letter == "s" else letter)
    fmt = "@" + "".join(parts)
    if struct.calcsize(fmt) != ctypes.sizeof(cls):  # pragma: no cover - a platform with other padding
        raise LibraryABIError(f"the struct format of {cls.__name__} does not match its ctypes mirror here")
    return fmt


def field_positions(cls: type[ctypes.Structure]) -> dict[str, int]:
    """Each field's position in the tuple ``struct_format(cls)`` unpacks (an array: its first element)."""
    positions, at = {}, 0
    for name, ctype in cls._fields_:
        positions[name] = at
        is_text = hasattr(ctype, "_length_") and ctype._type_ is ctypes.c_char  # one bytes value
        at += 1 if is_text else getattr(ctype, "_length_", 1)
    return positions


def _mirrors(table: str) -> dict[str, type[ctypes.Structure]]:
    """The ctypes mirrors of ``table``: per struct a line ``Name c_name``, its doc as ``#`` lines, then its
    fields as lines ``TYPE name name ...`` in the C struct's order (TYPE: a scalar of :data:`_SCALARS`, an
    array ``i64[3]``, or a struct of an earlier entry, ``Tensor[7]``). A struct with ``abi_version`` and
    ``struct_size`` fields starts with them filled in."""
    for entry in re.split(r"\n(?=\S)", table.strip()):
        head, *rows = entry.splitlines()
        name, c_name = head.split()
        doc = " ".join(row.strip()[1:].strip() for row in rows if row.strip().startswith("#"))
        fields = []
        for row in rows:
            if not row.strip().startswith("#"):
                kind, *names = row.split()
                fields += [(field, _ctype(kind)) for field in names]
        namespace = {"__doc__": doc, "C_NAME": c_name, "_fields_": fields, "__module__": __name__}
        if fields[:2] == [("abi_version", ctypes.c_uint32), ("struct_size", ctypes.c_uint32)]:
            namespace["__init__"] = _versioned_init
        _MIRRORS[name] = type(name, (ctypes.Structure,), namespace)
    return _MIRRORS


def _versioned_init(self, **values) -> None:
    """A plan mirror: the library's ABI version and the struct's size filled in."""
    ctypes.Structure.__init__(self, abi_version=ABI_VERSION, struct_size=ctypes.sizeof(type(self)), **values)


# Every struct the library and Python share, in one table (the C declarations' order of fields).
STRUCTS = f"""
Plan pakv_plan
    # ``pakv_plan`` (pakv_core.h): one gather in bytes, made by the validator, run by ``pakv_gather``.
    u32 abi_version struct_size
    i32 layout tables64
    i64 num_blocks block_size
    ptr key_cache value_cache
    i64 key_block_stride value_block_stride key_row_bytes value_row_bytes
    ptr key_out value_out
    i64 num_seqs table_cols
    ptr block_tables
    i64 table_row_stride table_col_stride
    ptr seq_lengths out_starts col_starts
    i64 num_tokens
    i32 out_rank reserved
    i64[3] key_out_dims value_out_dims
Tensor pakv_tensor
    # ``pakv_tensor`` (pakv_contract.h): one tensor as the validator sees it.
    ptr data host_data
    i32 present elem_type ndim reserved
    char[{DEVICE_LEN}] device
    i64[{MAX_RANK}] dims strides
GatherCall pakv_gather_call
    # ``pakv_gather_call`` (pakv_contract.h): one validation handed over in one piece.
    Plan plan
    Tensor[7] records
    i32 nz cumsum
    i64 scratch_len
    ptr scratch error
ScatterPlan pakv_scatter_plan
    # ``pakv_scatter_plan`` (pakv_core.h): one scatter in bytes, made by the validator, run by
    # ``pakv_scatter``.
    u32 abi_version struct_size
    i32 layout slots64
    i64 num_blocks block_size
    ptr key_cache value_cache
    i64 key_block_stride value_block_stride key_row_bytes value_row_bytes
    ptr key value
    i64 key_token_stride value_token_stride num_tokens
    ptr slot_mapping
    i64 slot_stride
ScatterCall pakv_scatter_call
    # ``pakv_scatter_call`` (pakv_contract.h): one scatter validation handed over in one piece.
    ScatterPlan plan
    Tensor[7] records
    i32 nz reserved
    i64 scratch_len
    ptr scratch error
AttentionPlan pakv_attention_plan
    # ``pakv_attention_plan`` (pakv_core.h): one paged attention in bytes, made by a validator, run by
    # ``pakv_attention``.
    u32 abi_version struct_size
    i32 query_type out_type tables64 causal
    i64 num_blocks block_size
    ptr key_cache value_cache
    i32 key_type value_type key_quant value_quant
    ptr key_scale value_scale
    i64 key_block_stride value_block_stride key_row_stride value_row_stride key_head_stride value_head_stride
    i64 num_heads num_kv_heads head_dim value_head_dim
    ptr query
    i64 query_token_stride query_head_stride
    ptr out
    i64 num_tokens num_seqs table_cols
    ptr block_tables
    i64 table_row_stride table_col_stride
    ptr query_starts query_counts context_lens
    f32 scale softcap
    i64 window
    ptr head_sink
    i32 dequantized_type reserved
AttentionCall pakv_attention_call
    # ``pakv_attention_call`` (pakv_contract.h): one attention validation handed over in one piece.
    AttentionPlan plan
    Tensor[7] records
    f32 scale
    i32 reserved
    i64 scratch_len
    ptr scratch error
FusedAttributes pakv_fused_attributes
    # ``pakv_fused_attributes`` (pakv_fused.h): com.microsoft::PagedAttention's attributes as given.
    i64 num_heads kv_num_heads local_window_size is_causal do_rotary rotary_interleaved v_head_size rotary_offset
    f32 scale softcap qk_norm_epsilon
    i32 given
    char[{FUSED_STRING_LEN}] k_quant_type v_quant_type k_cache_dtype v_cache_dtype kv_cache_layout
FusedPlan pakv_fused_plan
    # ``pakv_fused_plan`` (pakv_fused.h): one com.microsoft::PagedAttention in bytes (prologue, then its
    # ``attention`` plan), made by the validator, run by ``pakv_fused_attention``.
    u32 abi_version struct_size
    i32 query_type cache_type key_quant value_quant latent normalize rotary_interleaved prepare_query
    i64 num_tokens num_heads num_kv_heads head_dim
    ptr query
    i64 query_token_stride
    ptr key
    i64 key_token_stride
    ptr value
    i64 value_token_stride
    ptr q_norm_weight k_norm_weight
    f32 epsilon
    i32 reserved
    ptr cos_cache sin_cache
    i64 rotary_dim rotary_offset rotary_rows
    ptr key_scale value_scale key_cache value_cache
    i64 num_blocks block_size key_block_stride value_block_stride key_row_bytes value_row_bytes
    ptr slots positions query_rows
    AttentionPlan attention
FusedCall pakv_fused_call
    # ``pakv_fused_call`` (pakv_fused.h): one com.microsoft::PagedAttention validation handed over in one
    # piece.
    FusedPlan plan
    Tensor[{FUSED_RECORDS}] records
    FusedAttributes attributes
    i64 scratch_len
    ptr scratch error
Request pakv_request
    # ``pakv_request`` (pakv_bridge.h): one kernel call routed to a Python backend (``scale``:
    # PagedAttention's attribute; ``stream``: ORT's compute stream on a device EP, else NULL).
    str backend op cache_mode
    i64 is_seq_lens_cumsum
    f32 scale
    i32 num_inputs
    Tensor[{NUM_INPUTS}] inputs
    ptr ctx api stream
    char[{ERROR_LEN}] error
"""
MIRRORS = _mirrors(STRUCTS)  # name -> class, in the table's order (tests/test_native_abi.py checks the names below)
(Plan, Tensor, GatherCall, ScatterPlan, ScatterCall, AttentionPlan, AttentionCall, FusedAttributes, FusedPlan, FusedCall,
 Request) = MIRRORS.values()  # fmt: skip


CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(Request))

# Every function the library exports besides RegisterCustomOps and the struct sizes (``<C name>_size()``, one
# per mirror of SIZED_MIRRORS, added by signatures()): ``RESULT name(ARG, ...)`` per line.
PROTOTYPES = """
    i32  pakv_abi_version()
    i32  pakv_plan_gather(ptr)
    i32  pakv_check_gather_outputs(ptr)
    i32  pakv_gather(ptr, ptr, size)
    i32  pakv_plan_scatter(ptr)
    i32  pakv_scatter(ptr, ptr, size)
    i32  pakv_scatter_writable(ptr, ptr, size)
    i32  pakv_buffer_writable(ptr, i64, str, ptr, size)
    i32  pakv_plan_attention(ptr)
    i32  pakv_check_attention_output(ptr)
    i32  pakv_attention(ptr, ptr, size)
    void pakv_fused_defaults(ptr)
    void pakv_fused_string_attribute(ptr, str, size)
    i64  pakv_fused_scratch_needed(ptr)
    void pakv_fused_bind_plan(ptr, ptr, ptr, ptr, ptr)
    i32  pakv_plan_fused(ptr)
    i32  pakv_check_fused_outputs(ptr)
    i32  pakv_fused_attention(ptr, ptr, size)
    i32  pakv_fused_writable(ptr, ptr, size)
    void pakv_cuda_copy_paths(ptr)
    i32  pakv_attention_threads(ptr, i32, ptr, size)
    i32  pakv_bind_next_registration(str)
    void pakv_bind_next_alias(i32)
    void pakv_set_python_callback(callback)
    long pakv_python_shutdown(long, long)
    ptr  pakv_request_output(ptr, i32, ptr, i32)
    void pakv_request_set_error(request, str)
"""
_PROTOTYPE_TYPES = {
    **{name: ctype for name, (ctype, _) in _SCALARS.items()},
    "size": ctypes.c_size_t,
    "long": ctypes.c_long,
    "void": None,
    "callback": CALLBACK,
    "request": ctypes.POINTER(Request),
}


def signatures(table: str = PROTOTYPES) -> dict[str, tuple[list, object]]:
    """name -> (argtypes, restype) of every prototype line of ``table``."""
    found = {}
    for line in table.strip().splitlines():
        result, rest = line.split(None, 1)
        name, _, args = rest.partition("(")
        argtypes = [_PROTOTYPE_TYPES[a.strip()] for a in args.rstrip(")").split(",") if a.strip()]
        found[name.strip()] = (argtypes, _PROTOTYPE_TYPES[result])
    return found


# The mirrors whose size the library reports (``<C_NAME>_size``), checked when it loads.
SIZED_MIRRORS = (Plan, Tensor, GatherCall, ScatterPlan, ScatterCall, AttentionPlan, AttentionCall, FusedPlan,
                 FusedCall, Request)  # fmt: skip
SIGNATURES = {**signatures(), **{f"{cls.C_NAME}_size": ([], ctypes.c_size_t) for cls in SIZED_MIRRORS}}

# The plans as struct formats, and each field's position in the unpacked tuple (the validator reads
# a plan's fields from its bytes in one unpack).
PLAN_FORMAT, PLAN_FIELD_AT = struct_format(Plan), field_positions(Plan)
SCATTER_PLAN_FORMAT, SCATTER_PLAN_FIELD_AT = struct_format(ScatterPlan), field_positions(ScatterPlan)
ATTENTION_PLAN_FORMAT, ATTENTION_PLAN_FIELD_AT = struct_format(AttentionPlan), field_positions(AttentionPlan)

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
