"""The one validator, from Python: a call's tensors go to the C contract unit, a plan comes back.

Every Python path (the public front on every backend, ``torch.ops.pakv.gather_pa_kv_cache``,
the ORT plugin's Python callback) validates through :func:`plan_gather`, which describes each
tensor to ``pakv_contract_*.c`` as a record (element type, dims, strides, device, addresses) and
raises the ``TypeError`` / ``ValueError`` it answers, with its message. The rules and their
messages are written there and nowhere else; this module only translates Python objects into
records (and refuses what is not a tensor at all) and the answer into a
:class:`~pakv_onnx.plans.GatherPlan`.

Index tensors are read on the host: those on a device are copied there first (they are the small
part; the NPU kernel needs them there anyway). Caches and outputs contribute metadata and
addresses only, wherever they live.
"""

from __future__ import annotations

import array
import ctypes
import struct
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from pakv_onnx import native_lib
from pakv_onnx.plans import AttentionPlan, GatherPlan, OrtAttentionPlan, ScatterPlan
from pakv_onnx.spec import (
    ATTENTION,
    DEFAULT_CACHE_MODE,
    DEFAULT_IS_SEQ_LENS_CUMSUM,
    GATHER,
    ONNX_ELEMENT_TYPE_OF,
    ORT_ATTENTION,
    ORT_ATTENTION_HOST_INPUTS,
    SCATTER,
    CacheMode,
    parse_cache_mode,
    parse_cumsum_flag,
    parse_scale,
)

# The records of one gather, in the validator's order (pakv_contract.h).
RECORD_NAMES = ("key_cache", "value_cache", "block_tables", "seq_lens", "seq_offset", "key_out", "value_out")
# Each record's role in a call: (name, bits) with _OPTIONAL (may be None) and _INDEX (an index
# tensor: read on the host, copied there from a device); the bits pakv_front.c reads.
_OPTIONAL, _INDEX = 1, 2
_GATHER_ROLES = tuple((name, _OPTIONAL * (i >= 4) | _INDEX * (2 <= i <= 4)) for i, name in enumerate(RECORD_NAMES))
_OUTPUT_ROLES = (("key_out", 0), ("value_out", 0))
_SCATTER_ROLES = (
    *((name, _INDEX * (name == "slot_mapping")) for name in SCATTER.input_names),
    *((name, _OPTIONAL) for name in SCATTER.output_names),
)


def _call_layout(
    call: type[ctypes.Structure], tail_field: str, tail_format: str, plan_format: str
) -> tuple[int, int, int, struct.Struct, struct.Struct]:
    """Where the validator writes and reads one op's call block (a pakv_*_call of pakv_contract.h):
    its size in bytes, the offsets of its records and of its scalar tail (from ``tail_field`` on:
    the op's attributes, then scratch_len, scratch, error), the tail's struct (``tail_format``) and
    the struct of the plan fields at its start (``plan_format``)."""
    tail_at = getattr(call, tail_field).offset
    return ctypes.sizeof(call), call.records.offset, tail_at, struct.Struct(tail_format), struct.Struct(plan_format)


# One int64 array per call: the pakv_gather_call (plan, records, attributes), then the plan's
# 3 x Q index entries (its scratch). It stays with the plan: the C plan points into it.
# The tail: nz, cumsum, scratch_len, scratch, error.
_CALL_SIZE, _RECORDS_AT, _TAIL_AT, _TAIL, _PLAN_FIELDS = _call_layout(
    native_lib.GatherCall, "nz", "@iiqPP", native_lib.PLAN_FORMAT
)
_CALL_WORDS = _CALL_SIZE // 8
_RECORD_SIZE = ctypes.sizeof(native_lib.Tensor)
_AT = native_lib.PLAN_FIELD_AT
_NUM_BLOCKS, _BLOCK_SIZE, _NUM_SEQS, _NUM_TOKENS = (
    _AT[n] for n in ("num_blocks", "block_size", "num_seqs", "num_tokens")
)
_KEY_ROW, _VALUE_ROW, _OUT_RANK = _AT["key_row_bytes"], _AT["value_row_bytes"], _AT["out_rank"]
_KEY_DIMS, _VALUE_DIMS = _AT["key_out_dims"], _AT["value_out_dims"]


class _Errors(threading.local):
    def __init__(self) -> None:
        self.buffer = ctypes.create_string_buffer(native_lib.ERROR_LEN)
        self.address = ctypes.addressof(self.buffer)


_errors = _Errors()


def _on_host(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the tensor a record describes, its readable host copy) of an index tensor on a device: made
    contiguous there (so one stride serves both) and copied to the host."""
    dense = tensor.contiguous()
    return dense, dense.cpu()


def _describe_other(name: str, value: Any, is_index: bool) -> tuple[torch.Tensor, int, torch.Tensor | None, str]:
    """What pakv_front.c does not read itself (a non-tensor, a tensor subclass, a tensor on a device):
    (the tensor to describe, its data address, the host tensor to read or None, its device)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.is_cpu:
        return value, value.data_ptr(), value if is_index else None, "cpu"
    if value.is_meta:  # no data anywhere: the validator refuses an index tensor there by name
        return value, 0, None, "meta"
    if is_index:
        value, host = _on_host(value)
        return value, value.data_ptr(), host, str(value.device)
    return value, value.data_ptr(), None, str(value.device)


_describe = None  # pakv_front.c's describe(address, values, roles) -> hosts, bound on first use


def _describer():
    """Bind the front's extension to torch and the dtype tables once (native code loads on first use).

    Where torch offers DLPack's C exchange table, the extension reads CPU tensors through it (no
    Python object made per tensor); otherwise through their attributes (pakv_front.c)."""
    global _describe
    front = native_lib.front()
    exchange = getattr(torch.Tensor, "__dlpack_c_exchange_api__", None)
    dl_types = None if exchange is None else _dlpack_element_types(front, exchange)
    front.configure(torch.Tensor, dict(ONNX_ELEMENT_TYPE_OF), _describe_other, exchange, dl_types)
    _describe = front.describe
    return _describe


def _dlpack_element_types(front: Any, exchange: Any) -> dict[int, int]:
    """{DLPack element type: ONNX element type} of the DLPack types exactly one torch dtype has, read off
    an empty tensor of each dtype; a type two dtypes share (or one torch cannot make) is left to the
    extension's lookup by dtype."""
    seen: dict[int, set[int]] = {}
    for dtype in {value for value in vars(torch).values() if isinstance(value, torch.dtype)}:
        try:
            with warnings.catch_warnings():  # complex32 and the quantized dtypes warn when made
                warnings.simplefilter("ignore")
                probe = torch.empty(0, dtype=dtype)
        except (RuntimeError, TypeError):
            continue
        key = front.dlpack_key(exchange, probe)
        if key is not None:
            seen.setdefault(key, set()).add(ONNX_ELEMENT_TYPE_OF.get(dtype, 0))
    return {key: types.pop() for key, types in seen.items() if len(types) == 1}


def _call_array(call_size: int, words: int, entries: int, one_per_entry: Any) -> tuple[array.array, int]:
    """A call's int64 array: the call (``call_size`` bytes), then the validator's scratch of ``words``
    int64 per entry; returns it and the scratch's length in words.

    The scratch never counts more entries than ``one_per_entry`` (the index tensor a valid call gives one
    entry per entry) has: a call with more is refused by its shapes before the scratch is used, so a
    block table of 2**63 - 1 rows is never allocated for. A scratch that cannot be had is -1 words: the
    validator still checks the call's shapes first and then says there is no room (as the C kernels do).
    """
    if isinstance(one_per_entry, torch.Tensor) and one_per_entry.numel() < entries:
        entries = one_per_entry.numel()
    try:
        return array.array("q", bytes(call_size + 8 * words * entries)), words * entries
    except (OverflowError, MemoryError):
        return array.array("q", bytes(call_size)), -1


def _raise(kind: int) -> None:
    message = _errors.buffer.value.decode(errors="replace")
    raise (TypeError if kind == native_lib.ERR_TYPE else ValueError)(message)


def plan_gather(
    *inputs: torch.Tensor | None,
    cache_mode: str | CacheMode = DEFAULT_CACHE_MODE,
    is_seq_lens_cumsum: bool | int = DEFAULT_IS_SEQ_LENS_CUMSUM,
    key_out: torch.Tensor | None = None,
    value_out: torch.Tensor | None = None,
    **named_inputs: torch.Tensor | None,
) -> GatherPlan:
    """Validate one GatherPaKvCache call and return its plan.

    ``inputs`` are the op's, in ``spec.GATHER.input_names`` order (key_cache, value_cache,
    block_tables, seq_lens, then optionally seq_offset), the later ones also by name
    (``named_inputs``), bound by ``spec.GATHER.inputs_of``.

    Args:
        key_cache: ``[nb, bs, Hk, Dk]`` (Norm) or ``[nb, Hk*Dk // E, bs, E]`` (PA_NZ); any
            contract dtype; may be strided on dim 0 (a pool view, see :mod:`pakv_onnx.spec`).
        value_cache: same layout, nb and bs as ``key_cache``; its heads/dim and dtype may differ.
        block_tables: int32/int64 ``[Q, cols]``, physical block ids per sequence.
        seq_lens: int32/int64 ``[Q+1]`` cumulative (``is_seq_lens_cumsum``) or ``[Q]`` lengths.
        seq_offset: optional int32/int64 ``[Q]``, non-negative token offsets; sequence q starts
            at block-table column ``seq_offset[q] // bs`` (the FLOOR RULE of :mod:`pakv_onnx.spec`).
        cache_mode: ``"Norm"`` or ``"PA_NZ"``.
        is_seq_lens_cumsum: how ``seq_lens`` is given.
        key_out, value_out: optional caller-given outputs ``[T, ...]`` to check: contiguous, of
            their own cache's dtype, on the caches' device, overlapping neither each other nor any input.

    Raises:
        TypeError: a non-tensor input or a dtype outside the contract.
        ValueError: any other contract violation; the message (the C validator's) names the
            input, the index and the bad value.
    """
    mode = cache_mode if type(cache_mode) is CacheMode else parse_cache_mode(cache_mode)
    is_cumsum = is_seq_lens_cumsum if type(is_seq_lens_cumsum) is bool else parse_cumsum_flag(is_seq_lens_cumsum)
    if len(inputs) != 5 or named_inputs:  # the fronts pass all five positionally: no binding to do
        inputs = GATHER.inputs_of(inputs, named_inputs)
    key_cache, value_cache, block_tables, seq_lens, seq_offset = inputs
    values = (key_cache, value_cache, block_tables, seq_lens, seq_offset, key_out, value_out)
    num_seqs = block_tables.shape[0] if isinstance(block_tables, torch.Tensor) and block_tables.dim() == 2 else 0
    call, scratch = _call_array(_CALL_SIZE, 3, num_seqs, seq_lens)
    base = call.buffer_info()[0]
    hosts = (_describe or _describer())(base + _RECORDS_AT, values, _GATHER_ROLES)
    _TAIL.pack_into(call, _TAIL_AT, mode is CacheMode.PA_NZ, is_cumsum, scratch, base + _CALL_SIZE, _errors.address)
    kind = native_lib.plan_gather_call(base)
    if kind:
        _raise(kind)
    fields = _PLAN_FIELDS.unpack_from(call, 0)
    rank = fields[_OUT_RANK]
    plan = object.__new__(GatherPlan)  # a frozen dataclass, filled without 15 __setattr__ calls
    plan.__dict__.update(
        cache_mode=mode,
        is_seq_lens_cumsum=is_cumsum,
        num_blocks=fields[_NUM_BLOCKS],
        block_size=fields[_BLOCK_SIZE],
        num_seqs=fields[_NUM_SEQS],
        num_tokens=fields[_NUM_TOKENS],
        key_token_shape=fields[_KEY_DIMS + 1 : _KEY_DIMS + rank],
        value_token_shape=fields[_VALUE_DIMS + 1 : _VALUE_DIMS + rank],
        key_dtype=key_cache.dtype,
        value_dtype=value_cache.dtype,
        key_row_bytes=fields[_KEY_ROW],
        value_row_bytes=fields[_VALUE_ROW],
        index=memoryview(call)[_CALL_WORDS:],
        tables=hosts[2],
        native=(call, hosts),  # the host copies stay alive as long as the C plan points at them
    )
    return plan


def check_outputs(plan: GatherPlan, key_out: torch.Tensor, value_out: torch.Tensor) -> None:
    """The validator's output rules for outputs obtained after ``plan`` was made (ORT's buffers, an
    allocator's): the plan's shapes, their caches' dtypes and device, contiguous, no overlap with
    each other or any input. Raises what the validator said; on success the plan runs into them."""
    call = plan.native[0]
    (_describe or _describer())(
        call.buffer_info()[0] + _RECORDS_AT + 5 * _RECORD_SIZE, (key_out, value_out), _OUTPUT_ROLES
    )
    kind = native_lib.check_gather_outputs_call(call.buffer_info()[0])
    if kind:
        _raise(kind)
    _OUTPUTS.pack_into(call, native_lib.Plan.key_out.offset, key_out.data_ptr(), value_out.data_ptr())


_OUTPUTS = struct.Struct("@PP")  # the plan's key_out, value_out: validated outputs it may write


# The tail: nz, reserved, scratch_len, scratch, error.
_SCATTER_SIZE, _SCATTER_RECORDS_AT, _SCATTER_TAIL_AT, _SCATTER_TAIL, _SCATTER_FIELDS = _call_layout(
    native_lib.ScatterCall, "nz", "@iiqPP", native_lib.SCATTER_PLAN_FORMAT
)
_SAT = native_lib.SCATTER_PLAN_FIELD_AT


def plan_scatter(
    *inputs: torch.Tensor,
    cache_mode: str | CacheMode = DEFAULT_CACHE_MODE,
    key_cache_out: torch.Tensor | None = None,
    value_cache_out: torch.Tensor | None = None,
    **named_inputs: torch.Tensor,
) -> ScatterPlan:
    """Validate one ScatterPaKvCache call and return its plan.

    ``inputs`` are the op's five, in ``spec.SCATTER.input_names`` order (key, value, key_cache,
    value_cache, slot_mapping), the later ones also by name (``named_inputs``), bound by
    ``spec.SCATTER.inputs_of``.

    Args:
        key, value: ``[T, Hk, Dk]`` / ``[T, Hv, Dv]`` rows of their caches' dtypes (each token
            row-major; any token stride, e.g. a slice of a fused QKV projection).
        key_cache, value_cache: the gather's layouts (Norm ``[nb, bs, H, D]``, PA_NZ
            ``[nb, H*D // E, bs, E]``), pool views included; written in place by a backend.
        slot_mapping: int32/int64 ``[T]``: token t goes to block ``s // bs``, row ``s % bs`` of
            ``s = slot_mapping[t]``; a negative slot is padding (skipped); no slot twice.
        cache_mode: ``"Norm"`` or ``"PA_NZ"``.
        key_cache_out, value_cache_out: where the updated caches go when not in place (an ORT
            host's output buffers): each its cache's shape, dtype and device, contiguous, either
            that cache itself or overlapping no input and not each other. The plan still writes
            the input caches; a caller copies each cache to its output first and plans again there.

    Raises:
        TypeError: a non-tensor or a dtype outside the contract (or unlike its cache's).
        ValueError: any other contract violation, named by the C validator.
    """
    mode = cache_mode if type(cache_mode) is CacheMode else parse_cache_mode(cache_mode)
    if len(inputs) != 5 or named_inputs:  # the fronts pass all five positionally: no binding to do
        inputs = SCATTER.inputs_of(inputs, named_inputs)
    key, value, key_cache, value_cache, slot_mapping = inputs
    values = (key, value, key_cache, value_cache, slot_mapping, key_cache_out, value_cache_out)
    num_tokens = key.shape[0] if isinstance(key, torch.Tensor) and key.dim() >= 1 else 0
    call, scratch = _call_array(_SCATTER_SIZE, 2, num_tokens, slot_mapping)
    base = call.buffer_info()[0]
    hosts = (_describe or _describer())(base + _SCATTER_RECORDS_AT, values, _SCATTER_ROLES)
    _SCATTER_TAIL.pack_into(
        call, _SCATTER_TAIL_AT, mode is CacheMode.PA_NZ, 0, scratch, base + _SCATTER_SIZE, _errors.address
    )
    kind = native_lib.plan_scatter_call(base)
    if kind:
        _raise(kind)
    fields = _SCATTER_FIELDS.unpack_from(call, 0)
    token = {CacheMode.NORM: lambda c: (c.shape[2], c.shape[3]), CacheMode.PA_NZ: lambda c: (c.shape[1] * c.shape[3],)}
    plan = object.__new__(ScatterPlan)
    plan.__dict__.update(
        cache_mode=mode,
        num_blocks=fields[_SAT["num_blocks"]],
        block_size=fields[_SAT["block_size"]],
        num_tokens=fields[_SAT["num_tokens"]],
        key_token_shape=tuple(token[mode](key_cache)),
        value_token_shape=tuple(token[mode](value_cache)),
        key_dtype=key_cache.dtype,
        value_dtype=value_cache.dtype,
        key_row_bytes=fields[_SAT["key_row_bytes"]],
        value_row_bytes=fields[_SAT["value_row_bytes"]],
        slots=hosts[4],
        native=(call, hosts),
    )
    return plan


# The tail: scale, reserved, scratch_len, scratch, error.
_ATTENTION_SIZE, _ATTENTION_RECORDS_AT, _ATTENTION_TAIL_AT, _ATTENTION_TAIL, _ATTENTION_FIELDS = _call_layout(
    native_lib.AttentionCall, "scale", "@fiqPP", native_lib.ATTENTION_PLAN_FORMAT
)
_AAT = native_lib.ATTENTION_PLAN_FIELD_AT
# query, the caches, the three index tensors (read on the host), then the output (may be None).
_ATTENTION_ROLES = (
    *((name, _INDEX * (i >= 3)) for i, name in enumerate(ATTENTION.input_names)),
    (ATTENTION.output_names[0], _OPTIONAL),
)
_OUTPUT_ROLE = (_ATTENTION_ROLES[-1],)
_ATTENTION_OUT_AT = native_lib.AttentionPlan.out.offset


def plan_attention(*inputs: torch.Tensor, scale: float = 0.0, out: torch.Tensor | None = None) -> AttentionPlan:
    """Validate one PagedAttention call and return its plan.

    ``inputs`` are the op's six, in ``spec.ATTENTION.input_names`` order (query, key_cache, value_cache,
    block_table, cumulative_sequence_lengths, past_sequence_lengths), bound by ``spec.ATTENTION.inputs_of``.

    Args:
        query: ``[N, Hq, D]`` float32 / float16 / bfloat16 (each token row-major; any token stride).
        key_cache, value_cache: Norm caches ``[nb, bs, Hk, D]`` / ``[nb, bs, Hk, Dv]`` of query's
            dtype (pool views strided on dim 0 included); Hq a multiple of Hk.
        block_table: int32/int64 ``[B, cols]``; sequence b's position p is row ``p % bs`` of block
            ``block_table[b, p // bs]``. Only the columns a sequence with new tokens reads are
            validated (entries past its context may be -1).
        cumulative_sequence_lengths: int32/int64 ``[B+1]``: 0, then each sequence's end in query.
        past_sequence_lengths: int32/int64 ``[B]``: tokens each sequence had before this step's
            (its context is past + new; the new rows must already be in the caches).
        scale: the scores' scale; 0 means ``1 / sqrt(D)``.
        out: optional ``[N, Hq, Dv]`` output to check (contiguous, query's dtype and device,
            overlapping no input).

    Raises:
        TypeError: a non-tensor, a dtype outside the op's, caches of another dtype than query's.
        ValueError: any other contract violation, named by the C validator.
    """
    query, _, _, block_table, _, past_sequence_lengths = ATTENTION.inputs_of(inputs)
    scale = parse_scale(scale)
    tensors = (*inputs, out)
    num_seqs = block_table.shape[0] if isinstance(block_table, torch.Tensor) and block_table.dim() == 2 else 0
    call, scratch = _call_array(_ATTENTION_SIZE, 3, num_seqs, past_sequence_lengths)
    base = call.buffer_info()[0]
    hosts = (_describe or _describer())(base + _ATTENTION_RECORDS_AT, tensors, _ATTENTION_ROLES)
    tables = hosts[3]
    _ATTENTION_TAIL.pack_into(call, _ATTENTION_TAIL_AT, scale, 0, scratch, base + _ATTENTION_SIZE, _errors.address)
    kind = native_lib.plan_attention_call(base)
    if kind:
        _raise(kind)
    fields = _ATTENTION_FIELDS.unpack_from(call, 0)
    plan = object.__new__(AttentionPlan)
    plan.__dict__.update(
        num_blocks=fields[_AAT["num_blocks"]],
        block_size=fields[_AAT["block_size"]],
        num_seqs=fields[_AAT["num_seqs"]],
        num_tokens=fields[_AAT["num_tokens"]],
        num_heads=fields[_AAT["num_heads"]],
        num_kv_heads=fields[_AAT["num_kv_heads"]],
        head_dim=fields[_AAT["head_dim"]],
        value_head_dim=fields[_AAT["value_head_dim"]],
        scale=fields[_AAT["scale"]],
        dtype=query.dtype,
        index=memoryview(call)[_ATTENTION_SIZE // 8 :],
        tables=tables,
        native=(call, hosts),
    )
    return plan


def check_attention_output(plan: AttentionPlan, out: torch.Tensor) -> None:
    """The validator's output rule for an output obtained after ``plan`` was made (ORT's buffer):
    ``[N, Hq, Dv]``, query's dtype and device, contiguous, overlapping no input. Raises what the
    validator said; on success the plan's C form writes there."""
    call = plan.native[0]
    (_describe or _describer())(call.buffer_info()[0] + _ATTENTION_RECORDS_AT + 6 * _RECORD_SIZE, (out,), _OUTPUT_ROLE)
    kind = native_lib.check_attention_output_call(call.buffer_info()[0])
    if kind:
        _raise(kind)
    struct.pack_into("@P", call, _ATTENTION_OUT_AT, out.data_ptr())


# com.microsoft::PagedAttention: its 17 inputs (the host-read ones with _INDEX), then its 3 outputs.
_ORT_ROLES = (
    *(
        (name, _OPTIONAL * (name in ORT_ATTENTION.optional_inputs) | _INDEX * (name in ORT_ATTENTION_HOST_INPUTS))
        for name in ORT_ATTENTION.input_names
    ),
    *((name, _OPTIONAL) for name in ORT_ATTENTION.output_names),
)
_ORT_OUTPUT_ROLES = _ORT_ROLES[len(ORT_ATTENTION.input_names) :]
_FUSED_RECORDS_AT = native_lib.FusedCall.records.offset
_FUSED_OUTPUTS_AT = _FUSED_RECORDS_AT + len(ORT_ATTENTION.input_names) * _RECORD_SIZE
_QUANT_NAMES = ("NONE", "PER_TENSOR", "PER_CHANNEL")
_STRING_ATTRIBUTES = ("k_quant_type", "v_quant_type", "k_cache_dtype", "v_cache_dtype", "kv_cache_layout")
_FLOAT_ATTRIBUTES = ("scale", "softcap", "qk_norm_epsilon")


def _set_attributes(target: Any, attributes: dict[str, Any]) -> None:
    """ORT's attributes into a pakv_fused_attributes (defaults already there): the Python types the
    node's attribute types are (INT, FLOAT, STRING); their values are the validator's to judge."""
    for name, value in attributes.items():
        if name not in ORT_ATTENTION.attribute_defaults:
            raise TypeError(f"PagedAttention got an unknown attribute {name!r}")
        if name in _STRING_ATTRIBUTES:
            if isinstance(value, bytes):
                value = value.decode(errors="replace")
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a string, got {type(value).__name__}")
            field = ctypes.addressof(target) + getattr(type(target), name).offset
            native_lib.fused_string_attribute(field, value.encode(errors="surrogatepass"))
        elif name in _FLOAT_ATTRIBUTES:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a float, got {type(value).__name__}")
            setattr(target, name, ctypes.c_float(value).value)
        else:
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            setattr(target, name, max(min(value, 2**63 - 1), -(2**63)))
    target.given = 3  # num_heads and kv_num_heads: the front's required arguments


def _read(address: int, count: int, ctype: Any, dtype: torch.dtype) -> torch.Tensor:
    """``count`` C values at ``address`` as a CPU tensor (a copy)."""
    if count <= 0 or not address:
        return torch.empty(0, dtype=dtype)
    return torch.tensor(list((ctype * count).from_address(address)), dtype=dtype)


def plan_ort_attention(
    inputs: Sequence[torch.Tensor | None], attributes: dict[str, Any], *, out: torch.Tensor | None = None
) -> OrtAttentionPlan:
    """Validate one com.microsoft::PagedAttention call and return its plan.

    Args:
        inputs: the op's 17 inputs in ORT's order (``spec.ORT_ATTENTION.input_names``), None for an
            absent optional one: query ``[N, Hq*D]`` (or packed QKV), key / value ``[N, Hk*D]``, the
            caches ``[nb, bs, Hk, D]`` (T, int8 or float8_e4m3fn), cumulative_sequence_length
            ``[B+1]``, past_seqlens ``[B]``, block_table ``[B, cols]``, cos / sin ``[rows, rotary/2]``,
            slot_mapping ``[N]``, head_sink ``[Hq]``, the norm weights ``[D]``, the scales ``[1]`` or
            ``[Hk, 1, D]`` (float32), attention_metadata ``[2|3]``.
        attributes: ORT's attributes by name (num_heads and kv_num_heads needed; others default).
        out: an optional ``[N, Hq * Dv]`` output to check (contiguous, query's dtype, apart from every input).

    Raises:
        TypeError: a non-tensor, a dtype the op does not take; ValueError: any other rule, named by
            the C validator (pakv_contract_fused*.c).
    """
    values = tuple(inputs)
    if len(values) != len(ORT_ATTENTION.input_names):
        raise TypeError(f"PagedAttention takes {len(ORT_ATTENTION.input_names)} inputs, got {len(values)}")
    call = native_lib.FusedCall()
    base = ctypes.addressof(call)
    native_lib.fused_defaults(ctypes.addressof(call.attributes))
    _set_attributes(call.attributes, attributes)
    hosts = (_describe or _describer())(base + _FUSED_RECORDS_AT, (*values, out, None, None), _ORT_ROLES)
    needed = native_lib.fused_scratch_needed(base)
    scratch = array.array("q", bytes(8 * max(needed, 1)))
    call.scratch_len, call.scratch, call.error = needed, scratch.buffer_info()[0], _errors.address
    kind = native_lib.plan_fused_call(base)
    if kind:
        _raise(kind)
    plan, attention = call.plan, call.plan.attention
    b, n = attention.num_seqs, plan.num_tokens
    def scale_count(quant: int) -> int:  # PAKV_QUANT_*: NONE, PER_TENSOR, PER_CHANNEL
        return (0, 1, plan.num_kv_heads * plan.head_dim)[quant]

    def floats(address: int | None, count: int) -> torch.Tensor | None:
        return _read(address, count, ctypes.c_float, torch.float32) if address else None

    key_cache = values[3]
    result = object.__new__(OrtAttentionPlan)
    result.__dict__.update(
        num_tokens=n, num_heads=plan.num_heads, num_kv_heads=plan.num_kv_heads, head_dim=plan.head_dim,
        value_head_dim=attention.value_head_dim, num_seqs=b, num_blocks=plan.num_blocks, block_size=plan.block_size,
        dtype=values[0].dtype, cache_dtype=key_cache.dtype, latent=bool(plan.latent),
        packed=values[1] is None and not plan.latent, normalize=bool(plan.normalize), epsilon=plan.epsilon,
        rotary_dim=plan.rotary_dim, rotary_offset=plan.rotary_offset, rotary_interleaved=bool(plan.rotary_interleaved),
        key_quant=_QUANT_NAMES[plan.key_quant], value_quant=_QUANT_NAMES[plan.value_quant], scale=attention.scale,
        softcap=attention.softcap, window=attention.window, causal=bool(attention.causal),
        query_starts=_read(attention.query_starts, b, ctypes.c_int64, torch.int64),
        query_counts=_read(attention.query_counts, b, ctypes.c_int64, torch.int64),
        context_lens=_read(attention.context_lens, b, ctypes.c_int64, torch.int64),
        positions=_read(plan.positions, n, ctypes.c_int64, torch.int64),
        slots=_read(plan.slots, n, ctypes.c_int64, torch.int64),
        key_scale=floats(plan.key_scale, scale_count(plan.key_quant)),
        value_scale=floats(plan.value_scale, scale_count(plan.value_quant)),
        head_sink=floats(attention.head_sink, plan.num_heads),
        tables=hosts[7], native=(call, scratch, hosts),
    )  # fmt: skip
    return result


def check_ort_attention_outputs(
    plan: OrtAttentionPlan,
    out: torch.Tensor,
    key_cache_out: torch.Tensor | None = None,
    value_cache_out: torch.Tensor | None = None,
) -> None:
    """The validator's output rules for outputs obtained after ``plan`` was made: ``out`` ``[N, Hq*Dv]``
    of query's dtype, contiguous, apart from every input; a cache output its cache's shape and dtype,
    the cache itself (in place) or apart from every input. Raises what the validator said."""
    call = plan.native[0]
    base = ctypes.addressof(call)
    (_describe or _describer())(base + _FUSED_OUTPUTS_AT, (out, key_cache_out, value_cache_out), _ORT_OUTPUT_ROLES)
    kind = native_lib.check_fused_outputs_call(base)
    if kind:
        _raise(kind)
