"""The contract of GatherPaKvCache (and of ScatterPaKvCache and PagedAttention), declared: names,
attributes, dtype and layout tables, shapes (the plans the validator returns are
:mod:`pakv_onnx.plans`).

This module is the single source of the operator's names and tables. Every backend, the
exporter and the runtime plugin import them from here. The contract's *rules* (what a valid
call is, and the message for each way a call can be invalid) are written once, in the C
validator ``pakv_onnx/native_lib/pakv_contract_*.c``; :func:`pakv_onnx.validator.plan_gather`
hands it a call and returns its :class:`~pakv_onnx.plans.GatherPlan` or raises what it said.

Layouts (``nb`` = num_blocks, ``bs`` = block_size, ``T`` = total tokens)::

    cache_mode "Norm"  (ND):          cache [nb, bs, H, D]         -> out [T, H, D]
    cache_mode "PA_NZ" (FRACTAL_NZ):  cache [nb, H*D // E, bs, E]  -> out [T, H*D]
                                      E = 32 bytes / element size

    is_seq_lens_cumsum = 1: seq_lens [Q+1], starts at 0, non-decreasing; T = seq_lens[-1]
    is_seq_lens_cumsum = 0: seq_lens [Q] are per-sequence lengths; T = sum(seq_lens)
    seq_offset [Q] (optional): any non-negative token offsets (see FLOOR RULE below)

    token t of sequence q:  block = block_tables[q, seq_offset[q] // bs + t // bs]
                            slot  = t % bs
                            out[out_start[q] + t] = cache[block, slot]   (Norm)

FLOOR RULE (AscendC, op-plugin's and ATB's goldens and vLLM floor the same way): sequence q's
first block-table column is ``seq_offset[q] // bs`` (floor division), and its token 0 is slot 0
of that column's block, whatever ``seq_offset[q] % bs`` is. The remainder is ignored; only
negative offsets are an error.

dtypes: each cache may have any contract dtype, and the two may differ (e.g. a float8 key
cache with a bfloat16 value cache); the key output has key_cache's dtype, the value output
value_cache's. PA_NZ's E is per cache (32 bytes / that cache's element size).

Pool views: a cache may be a view of a larger pool that is strided on dim 0 only (each
block's inner dims row-major contiguous, any block stride ``cache.stride(0)`` >= 0 in elements:
``pool[:, 0]`` of a ``[nb, 2, bs, H, D]`` pool, or an ``expand``ed pool whose blocks overlap).
Other layouts are refused. Caller-given outputs must be contiguous and must not overlap each
other or any input (checked before anything is written).

Only the block-table entries a sequence actually uses are validated; unused
columns may hold anything (padding, stale ids).
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

import torch

# --------------------------------------------------------------------------- #
# ONNX identity
# --------------------------------------------------------------------------- #
DOMAIN = "pakv"
OP_TYPE = "GatherPaKvCache"
OPSET_VERSION = 1
# The ONNX IR version every model the package writes states at most (export.cap_ir_version): what
# onnxruntime 1.20, the oldest the package supports (pyproject), reads. onnx's helper.make_model stamps
# its own newest IR (onnx 1.23: 14), which a newer onnx raises past what an installed ORT reads (ORT 1.31
# refuses 14: FACTS §14); the models use nothing newer than IR 10 (float8 is IR 9).
MAX_IR_VERSION = 10

INPUT_NAMES = ("key_cache", "value_cache", "block_tables", "seq_lens", "seq_offset")
OPTIONAL_INPUTS = frozenset({"seq_offset"})
OUTPUT_NAMES = ("key", "value")

ATTR_CACHE_MODE = "cache_mode"
ATTR_IS_SEQ_LENS_CUMSUM = "is_seq_lens_cumsum"


class CacheMode(str, enum.Enum):
    """Physical layout of the paged caches."""

    NORM = "Norm"
    PA_NZ = "PA_NZ"


DEFAULT_CACHE_MODE = CacheMode.NORM
DEFAULT_IS_SEQ_LENS_CUMSUM = True


@dataclasses.dataclass(frozen=True)
class OpSignature:
    """One op's signature: the tensor inputs in order (optional ones may be None), then the
    attributes with their defaults, and the outputs. The torch op's schema, its fake and eager
    implementations, the ONNX translations, the OpSchema and the builder derive theirs from this."""

    op_type: str
    input_names: tuple[str, ...]
    optional_inputs: frozenset[str]
    output_names: tuple[str, ...]
    attribute_defaults: dict[str, str | bool | float | int]

    @property
    def parameter_names(self) -> tuple[str, ...]:
        return (*self.input_names, *self.attribute_defaults)

    def inputs_of(self, args: Sequence[Any], named: dict[str, Any] | None = None) -> tuple[Any, ...]:
        """``args`` (then the inputs ``named`` gives by name) as the op's tensor inputs, in order, absent
        optional ones ``None``: the one binder of the entry points that take them positionally
        (``plan_gather(*inputs)``, ``plan_scatter(*inputs)``, ``plan_attention(*inputs)``,
        ``make_attention_model_for(*examples)``).

        Raises:
            TypeError: too few or too many inputs (the message names them in order), or a name that
                is not an input, given twice, or a required input missing.
        """
        names = self.input_names
        if named:
            return self._merged(args, named)
        if len(args) == len(names):
            return tuple(args)
        required = len(names)
        while required and names[required - 1] in self.optional_inputs:
            required -= 1
        if required <= len(args) < len(names):
            return (*args, *(None,) * (len(names) - len(args)))
        count = f"{required} to {len(names)}" if required < len(names) else f"{len(names)}"
        raise TypeError(f"{self.op_type} takes {count} inputs ({', '.join(names)}), got {len(args)}")

    def _merged(self, args: Sequence[Any], named: dict[str, Any]) -> tuple[Any, ...]:
        """:meth:`inputs_of` where some inputs come by name: ``args`` fill the first ones."""
        names = self.input_names
        if len(args) > len(names):
            return self.inputs_of(args)  # the count's refusal
        for name in named:
            if name not in names:
                raise TypeError(f"{self.op_type} got an unknown input {name!r} (inputs: {', '.join(names)})")
            if names.index(name) < len(args):
                raise TypeError(f"{self.op_type} got {name!r} twice")
        rest = names[len(args) :]
        for name in rest:
            if name not in named and name not in self.optional_inputs:
                raise TypeError(f"{self.op_type} is missing the required input {name!r}")
        return (*args, *(named.get(name) for name in rest))

    def bind(self, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Positional/keyword arguments as ``{name: value}`` in signature order, defaults filled.

        Raises:
            TypeError: too many arguments, an unknown or repeated name, or a missing required input.
        """
        names = self.parameter_names
        if len(args) > len(names):
            raise TypeError(f"{self.op_type} takes at most {len(names)} arguments, got {len(args)}")
        bound = dict(zip(names, args))
        for name, value in kwargs.items():
            if name not in names:
                raise TypeError(f"{self.op_type} got an unknown argument {name!r} (arguments: {', '.join(names)})")
            if name in bound:
                raise TypeError(f"{self.op_type} got {name!r} twice")
            bound[name] = value
        for name in self.input_names:
            if name not in bound:
                if name not in self.optional_inputs:
                    raise TypeError(f"{self.op_type} is missing the required input {name!r}")
                bound[name] = None
        for name, default in self.attribute_defaults.items():
            bound.setdefault(name, default)
        return {name: bound[name] for name in names}


GATHER = OpSignature(
    OP_TYPE,
    INPUT_NAMES,
    OPTIONAL_INPUTS,
    OUTPUT_NAMES,
    {ATTR_CACHE_MODE: DEFAULT_CACHE_MODE.value, ATTR_IS_SEQ_LENS_CUMSUM: DEFAULT_IS_SEQ_LENS_CUMSUM},
)
# ScatterPaKvCache (AscendC's companion op): token t of key/value [T, H, D] goes to slot
# s = slot_mapping[t] of its cache, block s // bs, row s % bs; a negative slot is padding.
# The updated caches are its outputs (in place where ORT or the host lets them be the inputs).
SCATTER = OpSignature(
    "ScatterPaKvCache",
    ("key", "value", "key_cache", "value_cache", "slot_mapping"),
    frozenset(),
    ("key_cache_out", "value_cache_out"),
    {ATTR_CACHE_MODE: DEFAULT_CACHE_MODE.value},
)
# PagedAttention: causal GQA attention of each sequence's new tokens (query [N, Hq, D], packed by
# cumulative_sequence_lengths [B+1]) over its whole context (past_sequence_lengths[b] cached tokens
# plus its new ones, already written), read from the Norm caches through block_table in place.
# Output [N, Hq, Dv] in query's dtype. scale 0 means 1 / sqrt(D). Read-only: ScatterPaKvCache writes.
ATTR_SCALE = "scale"
ATTENTION = OpSignature(
    "PagedAttention",
    ("query", "key_cache", "value_cache", "block_table", "cumulative_sequence_lengths", "past_sequence_lengths"),
    frozenset(),
    ("output",),
    {ATTR_SCALE: 0.0},
)
# com.microsoft::PagedAttention: ONNX Runtime's own fused paged-attention op (bert_defs.cc, opset 1),
# which ORT implements for CUDA and WebGPU and this package for the CPU (docs/ort-paged-attention.md):
# each new token's key / value (q/k RMSNorm, rotary at position past + j, int8 / float8 quantization)
# written into its slot of the caches in place, then attention over the updated caches (GQA, window,
# softcap, sinks, causal or not, LATENT absorbed MLA). query [N, Hq*D] (or packed QKV), output
# [N, Hq*Dv] of query's dtype. Names, order and defaults are ORT's schema's; the Python front and the
# torch op take them as keywords (num_heads and kv_num_heads required).
MS_DOMAIN = "com.microsoft"
MS_OPSET_VERSION = 1
ORT_ATTENTION = OpSignature(
    "PagedAttention",
    (
        "query", "key", "value", "key_cache", "value_cache", "cumulative_sequence_length", "past_seqlens",
        "block_table", "cos_cache", "sin_cache", "slot_mapping", "head_sink", "q_norm_weight", "k_norm_weight",
        "k_scale", "v_scale", "attention_metadata",
    ),
    frozenset({
        "key", "value", "value_cache", "cos_cache", "sin_cache", "slot_mapping", "head_sink", "q_norm_weight",
        "k_norm_weight", "k_scale", "v_scale", "attention_metadata",
    }),
    ("output", "key_cache_out", "value_cache_out"),
    {
        "num_heads": 0, "kv_num_heads": 0, "scale": 0.0, "softcap": 0.0, "local_window_size": -1, "is_causal": 1,
        "do_rotary": 0, "rotary_interleaved": 0, "qk_norm_epsilon": 1e-6, "k_quant_type": "NONE",
        "v_quant_type": "NONE", "k_cache_dtype": "", "v_cache_dtype": "", "kv_cache_layout": "SEPARATE",
        "v_head_size": 0, "rotary_offset": 0,
    },
)  # fmt: skip
# The inputs com.microsoft::PagedAttention reads on the host (its index tensors, and the small
# tensors the validator copies or the prologue reads: rotary tables, norm weights, sinks, scales).
ORT_ATTENTION_HOST_INPUTS = frozenset(ORT_ATTENTION.input_names[5:])

# The gather's signature under its historical names (most of the package reads these).
ATTRIBUTE_DEFAULTS = GATHER.attribute_defaults
PARAMETER_NAMES: tuple[str, ...] = GATHER.parameter_names
bind_arguments = GATHER.bind

# Bytes of one FRACTAL_NZ fractal row: the PA_NZ last dim is this / element size.
NZ_FRACTAL_BYTES = 32

INT64_MAX = 2**63 - 1


# --------------------------------------------------------------------------- #
# dtypes
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(frozen=True)
class DType:
    """One element type of the contract, under its torch and ONNX names."""

    name: str
    torch_dtype: torch.dtype
    onnx_type: int  # onnx.TensorProto.DataType value (kept numeric: onnx is not needed here)
    itemsize: int


# The ONNX enum values are fixed by onnx.proto3 and never renumbered.
CACHE_DTYPES: tuple[DType, ...] = (
    DType("bfloat16", torch.bfloat16, 16, 2),
    DType("float16", torch.float16, 10, 2),
    DType("float32", torch.float32, 1, 4),
    DType("int8", torch.int8, 3, 1),
    DType("uint8", torch.uint8, 2, 1),
    DType("int16", torch.int16, 5, 2),
    DType("uint16", torch.uint16, 4, 2),
    DType("int32", torch.int32, 6, 4),
    DType("uint32", torch.uint32, 12, 4),
    DType("float8_e4m3fn", torch.float8_e4m3fn, 17, 1),
    DType("float8_e5m2", torch.float8_e5m2, 19, 1),
)
INDEX_DTYPES: tuple[DType, ...] = (
    DType("int32", torch.int32, 6, 4),
    DType("int64", torch.int64, 7, 8),
)

# The dtypes PagedAttention computes in (query, caches and output share one; fp32 accumulation).
ATTENTION_DTYPES: tuple[DType, ...] = tuple(d for d in CACHE_DTYPES if d.name in ("bfloat16", "float16", "float32"))

_CACHE_BY_TORCH = {d.torch_dtype: d for d in CACHE_DTYPES}
_CACHE_BY_NAME = {d.name: d for d in CACHE_DTYPES}
_INDEX_BY_TORCH = {d.torch_dtype: d for d in INDEX_DTYPES}

# Same-width integer views: a gather is a byte copy, so backends may move any
# cache dtype through the integer type of its width (some torch ops lack fp8/uint kernels).
_BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def cache_dtype(name_or_dtype: str | torch.dtype) -> DType:
    """Look up a cache dtype by name (``"bfloat16"``) or torch dtype; ``ValueError`` if outside the contract."""
    table = _CACHE_BY_NAME if isinstance(name_or_dtype, str) else _CACHE_BY_TORCH
    try:
        return table[name_or_dtype]
    except KeyError:
        allowed = ", ".join(d.name for d in CACHE_DTYPES)
        raise ValueError(
            f"no cache dtype of the contract is called {name_or_dtype} (the cache dtypes: {allowed})"
        ) from None


def index_dtype(dtype: torch.dtype) -> DType:
    """Look up an index dtype (int32 or int64) by torch dtype; ``ValueError`` if outside the contract."""
    try:
        return _INDEX_BY_TORCH[dtype]
    except KeyError:
        raise ValueError(f"{dtype} is no index dtype of the contract (the index dtypes: int32, int64)") from None


def nz_last_dim(itemsize: int) -> int:
    """E of the PA_NZ layout: elements in one 32-byte fractal row."""
    return NZ_FRACTAL_BYTES // itemsize


def block_size_axis(mode: CacheMode) -> int:
    """Axis of a cache shape that holds block_size (token slots within a block)."""
    return 1 if mode is CacheMode.NORM else 2


def token_shape(cache_shape: Sequence[Any], mode: CacheMode) -> tuple[Any, ...]:
    """Shape of one output row for a rank-4 cache shape (ints or symbolic sizes).

    Norm ``[nb, bs, H, D]`` -> ``(H, D)``; PA_NZ ``[nb, H*D // E, bs, E]`` -> ``(H*D,)``.
    """
    if mode is CacheMode.NORM:
        return (cache_shape[2], cache_shape[3])
    return (cache_shape[1] * cache_shape[3],)


def bits_view(tensor: torch.Tensor) -> torch.Tensor:
    """View ``tensor`` as the unsigned/signed integer type of the same width (no copy)."""
    return tensor.view(_BITS_VIEW[tensor.element_size()])


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` have the same dtype, shape and bytes (NaN and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(bits_view(a.contiguous()), bits_view(b.contiguous()))


def parse_cache_mode(cache_mode: object) -> CacheMode:
    """The contract's reading of a ``cache_mode`` argument or attribute (str, bytes or CacheMode)."""
    if isinstance(cache_mode, CacheMode):
        return cache_mode
    if isinstance(cache_mode, bytes):
        cache_mode = cache_mode.decode(errors="replace")
    if not isinstance(cache_mode, str):
        raise TypeError(f"{ATTR_CACHE_MODE} must be a string, got {type(cache_mode).__name__}")
    mode = _MODE_BY_NAME.get(cache_mode)
    if mode is None:
        raise ValueError(f"{ATTR_CACHE_MODE} must be 'Norm' or 'PA_NZ', got {cache_mode!r}")
    return mode


_MODE_BY_NAME: dict[str, CacheMode] = {m.value: m for m in CacheMode}


def parse_cumsum_flag(is_seq_lens_cumsum: object) -> bool:
    """The contract's reading of an ``is_seq_lens_cumsum`` argument or attribute (bool, 0 or 1)."""
    if isinstance(is_seq_lens_cumsum, bool):
        return is_seq_lens_cumsum
    if isinstance(is_seq_lens_cumsum, int) and is_seq_lens_cumsum in (0, 1):
        return bool(is_seq_lens_cumsum)
    raise ValueError(f"{ATTR_IS_SEQ_LENS_CUMSUM} must be 0/1 or a bool, got {is_seq_lens_cumsum!r}")


def parse_scale(scale: object) -> float:
    """The contract's reading of PagedAttention's ``scale`` (a real number; 0 means 1 / sqrt(head_dim)),
    as the float32 value the op uses (a value past float32's range becomes inf, which the validator refuses)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{ATTR_SCALE} must be a float, got {type(scale).__name__}")
    return ctypes.c_float(scale).value


# torch dtype -> ONNX element type of every contract dtype (cache and index).
ONNX_TYPE_OF: dict[torch.dtype, int] = {d.torch_dtype: d.onnx_type for d in (*CACHE_DTYPES, *INDEX_DTYPES)}
# ... and of the other torch dtypes ONNX has a type for, so the validator can name a wrong one.
ONNX_ELEMENT_TYPE_OF: dict[torch.dtype, int] = {
    **ONNX_TYPE_OF,
    torch.bool: 9,
    torch.float64: 11,
    torch.uint64: 13,
    torch.complex64: 14,
    torch.complex128: 15,
    torch.float8_e4m3fnuz: 18,
    torch.float8_e5m2fnuz: 20,
}
