"""The ONNX ``OpSchema`` of ``pakv::GatherPaKvCache``, ``pakv::ScatterPaKvCache`` and ``pakv::PagedAttention``,
with type and shape inference.

Registering it with :mod:`onnx.defs` lets ``onnx.checker.check_model(full_check=True)``,
``onnx.shape_inference`` and the dynamo exporter (onnxscript) understand graphs containing
the op. Every name, attribute default and dtype comes from :mod:`pakv_onnx.spec`.

Gather inference: each output has its own cache's element type (key_cache -> key, value_cache -> value); shapes ``[T, H, D]`` (Norm) or
``[T, H*D]`` (PA_NZ). T is a number when ``seq_lens`` is a constant (initializer or
``Constant``), otherwise a symbolic dim named after the node, unique per node, shared by
its two outputs. Scatter inference: each updated cache has its input cache's type and shape.
Attention inference: the output has query's type and shape ``[N, Hq, Dv]`` (query's first two
dims, value_cache's last).
"""

from __future__ import annotations

import itertools
import re
import threading

import numpy as np
import onnx
import onnx.defs
import onnx.numpy_helper
from onnx import TensorProto

from pakv_onnx.spec import (
    ATTENTION,
    ATTENTION_DTYPES,
    ATTR_SCALE,
    GATHER,
    SCATTER,
    ATTR_CACHE_MODE,
    ATTR_IS_SEQ_LENS_CUMSUM,
    CACHE_DTYPES,
    DEFAULT_CACHE_MODE,
    DEFAULT_IS_SEQ_LENS_CUMSUM,
    DOMAIN,
    INDEX_DTYPES,
    INPUT_NAMES,
    OP_TYPE,
    OPSET_VERSION,
    OUTPUT_NAMES,
    CacheMode,
    OpSignature,
)

# A type constraint of an op's schema: (symbol, the contract's dtypes it allows, the inputs and
# outputs it types, what it is in words).
Constraint = tuple[str, tuple, tuple[str, ...], str]

# The gather's: one symbol per cache (key and value dtypes may differ; each output takes its
# cache's), then one per index input (they may differ too).
_GATHER_TYPES: list[Constraint] = [
    *(
        (symbol, CACHE_DTYPES, (cache, output), f"{cache} element type (and its output's)")
        for symbol, cache, output in zip(("TK", "TV"), INPUT_NAMES[:2], OUTPUT_NAMES)
    ),
    *((f"T{i}", INDEX_DTYPES, (name,), f"{name} index type") for i, name in enumerate(INPUT_NAMES[2:], start=2)),
]

_DOC = (
    "Gather the paged KV cache blocks of a batch of sequences into contiguous tensors (see pakv_onnx.spec). "
    "Token t of sequence q is slot t % bs of block block_tables[q, seq_offset[q] // bs + t // bs]: the first "
    "column is seq_offset[q] // bs (floor; any non-negative offset). key_cache and value_cache may have "
    "different element types; each output has its cache's."
)

_lock = threading.Lock()
_symbol_counter = itertools.count()


def onnx_type_str(onnx_type: int) -> str:
    """``16`` -> ``"tensor(bfloat16)"``: the type string OpSchema constraints use."""
    return f"tensor({TensorProto.DataType.Name(onnx_type).lower()})"


def _attributes() -> list[onnx.defs.OpSchema.Attribute]:
    return [
        onnx.defs.OpSchema.Attribute(
            ATTR_CACHE_MODE,
            onnx.helper.make_attribute(ATTR_CACHE_MODE, DEFAULT_CACHE_MODE.value),
            "'Norm' (caches [nb, bs, H, D]) or 'PA_NZ' (caches [nb, H*D // E, bs, E])",
        ),
        onnx.defs.OpSchema.Attribute(
            ATTR_IS_SEQ_LENS_CUMSUM,
            onnx.helper.make_attribute(ATTR_IS_SEQ_LENS_CUMSUM, int(DEFAULT_IS_SEQ_LENS_CUMSUM)),
            "1: seq_lens [Q+1] cumulative from 0; 0: seq_lens [Q] lengths",
        ),
    ]


# --------------------------------------------------------------------------- #
# Inference
# --------------------------------------------------------------------------- #
def _attr(ctx, name: str, default):
    proto = ctx.get_attribute(name)
    if proto is None:
        return default
    return onnx.helper.get_attribute_value(proto)


def _constant_num_tokens(ctx, is_cumsum: bool) -> int | None:
    """T when seq_lens is a constant the inference can see, else None."""
    data = ctx.get_input_data(INPUT_NAMES.index("seq_lens"))
    if data is None:
        return None
    values = onnx.numpy_helper.to_array(data).astype(np.int64).reshape(-1)
    if is_cumsum:
        return int(values[-1]) if values.size else None
    return int(values.sum())


def _token_symbol(ctx) -> str:
    """``T_<node name>``; nodes without a name get ``T_<op>_<n>`` from a process-wide counter."""
    # The display name reads "node GatherPaKvCache[pakv] (<node name>)".
    match = re.search(r"\((.*)\)\s*$", ctx.get_display_name() or "")
    name = match.group(1) if match else ""
    if not name:
        name = f"{OP_TYPE}_{next(_symbol_counter)}"
    return "T_" + re.sub(r"[^0-9A-Za-z_]", "_", name)


def _token_dims(shape: onnx.TensorShapeProto | None, mode: CacheMode) -> list[onnx.TensorShapeProto.Dimension] | None:
    """Dims of one output row from a cache shape; None when the cache rank is unknown."""
    if shape is None or len(shape.dim) != 4:
        return None
    d = shape.dim
    if mode is CacheMode.NORM:
        return [d[2], d[3]]
    merged = onnx.TensorShapeProto.Dimension()
    if d[1].HasField("dim_value") and d[3].HasField("dim_value"):
        merged.dim_value = d[1].dim_value * d[3].dim_value
    return [merged]


def _infer(ctx) -> None:
    mode_raw = _attr(ctx, ATTR_CACHE_MODE, DEFAULT_CACHE_MODE.value)
    mode = CacheMode(mode_raw.decode() if isinstance(mode_raw, bytes) else mode_raw)
    is_cumsum = bool(_attr(ctx, ATTR_IS_SEQ_LENS_CUMSUM, int(DEFAULT_IS_SEQ_LENS_CUMSUM)))

    num_tokens = onnx.TensorShapeProto.Dimension()
    known = _constant_num_tokens(ctx, is_cumsum)
    if known is not None:
        num_tokens.dim_value = known
    else:
        num_tokens.dim_param = _token_symbol(ctx)

    for index, _name in enumerate(OUTPUT_NAMES):
        if not ctx.has_output(index):
            continue
        cache_type = ctx.get_input_type(index)  # key_cache -> key, value_cache -> value
        if cache_type is None or not cache_type.HasField("tensor_type"):
            continue
        tensor_type = cache_type.tensor_type
        shape = tensor_type.shape if tensor_type.HasField("shape") else None
        out = onnx.TypeProto()
        out.tensor_type.elem_type = tensor_type.elem_type
        dims = _token_dims(shape, mode)
        if dims is not None:
            out.tensor_type.shape.dim.add().CopyFrom(num_tokens)
            for dim in dims:
                out.tensor_type.shape.dim.add().CopyFrom(dim)
        ctx.set_output_type(index, out)


def make_schema() -> onnx.defs.OpSchema:
    """A fresh OpSchema for the contract (not registered).

    onnx 1.16 (the oldest supported) has neither node determinism nor Python inference functions:
    there the schema still gives the checker the names, types and attributes, and shape inference
    leaves the outputs as declared.
    """
    return _op_schema(GATHER, _DOC, _GATHER_TYPES, attributes=_attributes(), infer=_infer)


def _formal(signature: OpSignature, names: tuple[str, ...], symbols: dict[str, str]):
    """``names`` (of ``signature``'s inputs or outputs) as OpSchema parameters typed by ``symbols``
    (name -> type-constraint symbol); the signature's optional inputs are optional."""
    option = onnx.defs.OpSchema.FormalParameterOption
    return [
        onnx.defs.OpSchema.FormalParameter(
            name, symbols[name], param_option=option.Optional if name in signature.optional_inputs else option.Single
        )
        for name in names
    ]


def _op_schema(signature: OpSignature, doc: str, types: list[Constraint], *, infer, **parameters) -> onnx.defs.OpSchema:
    """An OpSchema of the pakv domain for ``signature``'s inputs and outputs, each typed by the one of
    ``types`` that names it: deterministic and with ``infer`` as its shape inference where this onnx
    has them (>= 1.17; onnx 1.16 takes neither, see :func:`make_schema`)."""
    determinism = getattr(onnx.defs.OpSchema, "NodeDeterminism", None)
    if determinism is not None:
        parameters["node_determinism"] = determinism.Deterministic
    symbols = {name: symbol for symbol, _, names, _ in types for name in names}
    parameters["inputs"] = _formal(signature, signature.input_names, symbols)
    parameters["outputs"] = _formal(signature, signature.output_names, symbols)
    parameters["type_constraints"] = [
        (symbol, [onnx_type_str(d.onnx_type) for d in dtypes], what) for symbol, dtypes, _, what in types
    ]
    schema = onnx.defs.OpSchema(signature.op_type, DOMAIN, OPSET_VERSION, doc, **parameters)
    if hasattr(schema, "set_type_and_shape_inference_function"):
        schema.set_type_and_shape_inference_function(infer)
    return schema


# --------------------------------------------------------------------------- #
# ScatterPaKvCache
# --------------------------------------------------------------------------- #
_SCATTER_DOC = (
    "Write key/value rows [T, H, D] into their slots of paged caches (see pakv_onnx.spec): token t goes to block "
    "s // bs, row s % bs of s = slot_mapping[t]; a negative slot is padding. The outputs are the updated caches "
    "(a runtime may make them the input caches' own buffers: bound so by the host, or aliased where the plugin's "
    "registration opted in)."
)
# key, key_cache and key_cache_out share TK, the value side TV; slot_mapping TS.
_SCATTER_TYPES: list[Constraint] = [
    *(
        (symbol, CACHE_DTYPES, (rows, cache, out), f"{rows} and {cache} element type (and {out}'s)")
        for symbol, rows, cache, out in zip(
            ("TK", "TV"), SCATTER.input_names[:2], SCATTER.input_names[2:4], SCATTER.output_names
        )
    ),
    ("TS", INDEX_DTYPES, SCATTER.input_names[4:], "slot_mapping index type"),
]


def _infer_scatter(ctx) -> None:
    for index in range(len(SCATTER.output_names)):
        cache_type = ctx.get_input_type(2 + index)  # key_cache -> key_cache_out, value_cache -> value_cache_out
        if ctx.has_output(index) and cache_type is not None and cache_type.HasField("tensor_type"):
            ctx.set_output_type(index, cache_type)


def make_scatter_schema() -> onnx.defs.OpSchema:
    """A fresh OpSchema for ScatterPaKvCache (not registered); see :func:`make_schema` for old onnx."""
    return _op_schema(SCATTER, _SCATTER_DOC, _SCATTER_TYPES, attributes=[_attributes()[0]], infer=_infer_scatter)


# --------------------------------------------------------------------------- #
# PagedAttention
# --------------------------------------------------------------------------- #
_ATTENTION_DOC = (
    "Causal attention of each sequence's new tokens (query [N, Hq, D], packed by cumulative_sequence_lengths "
    "[B+1]) over its whole context (past_sequence_lengths[b] + its new tokens, already in the caches), read from "
    "Norm caches [nb, bs, Hk, D] / [nb, bs, Hk, Dv] through block_table [B, cols] in place (see pakv_onnx.spec). "
    "New token j of a sequence with n new tokens and a context of L sits at position L - n + j and sees positions "
    "0 .. L - n + j. Hq is a multiple of Hk (GQA). fp32 scores and softmax; output [N, Hq, Dv] in query's type."
)
# query, both caches and the output share T; the index inputs each their own (int32 or int64).
_ATTENTION_TYPES: list[Constraint] = [
    (
        "T",
        ATTENTION_DTYPES,
        (*ATTENTION.input_names[:3], *ATTENTION.output_names),
        "query, key_cache, value_cache and output type",
    ),
    *(
        (symbol, INDEX_DTYPES, (name,), f"{name} index type")
        for symbol, name in zip(("TB", "TC", "TP"), ATTENTION.input_names[3:])
    ),
]


def _infer_attention(ctx) -> None:
    query, value_cache = ctx.get_input_type(0), ctx.get_input_type(2)
    if not ctx.has_output(0) or query is None or not query.HasField("tensor_type"):
        return
    out = onnx.TypeProto()
    out.tensor_type.elem_type = query.tensor_type.elem_type
    q_shape = query.tensor_type.shape if query.tensor_type.HasField("shape") else None
    v_shape = None
    if value_cache is not None and value_cache.HasField("tensor_type") and value_cache.tensor_type.HasField("shape"):
        v_shape = value_cache.tensor_type.shape
    if q_shape is not None and len(q_shape.dim) == 3 and v_shape is not None and len(v_shape.dim) == 4:
        for dim in (q_shape.dim[0], q_shape.dim[1], v_shape.dim[3]):
            out.tensor_type.shape.dim.add().CopyFrom(dim)
    ctx.set_output_type(0, out)


def make_attention_schema() -> onnx.defs.OpSchema:
    """A fresh OpSchema for PagedAttention (not registered); see :func:`make_schema` for old onnx."""
    return _op_schema(
        ATTENTION,
        _ATTENTION_DOC,
        _ATTENTION_TYPES,
        attributes=[
            onnx.defs.OpSchema.Attribute(
                ATTR_SCALE,
                onnx.helper.make_attribute(ATTR_SCALE, ATTENTION.attribute_defaults[ATTR_SCALE]),
                "the scores' scale; 0 (the default) means 1 / sqrt(head_dim)",
            )
        ],
        infer=_infer_attention,
    )


def register_schema() -> onnx.defs.OpSchema:
    """Register the ops' schemas with ``onnx.defs`` once per process (idempotent); return the gather's."""
    with _lock:
        if not onnx.defs.has(OP_TYPE, OPSET_VERSION, DOMAIN):
            onnx.defs.register_schema(make_schema())
        if not onnx.defs.has(SCATTER.op_type, OPSET_VERSION, DOMAIN):
            onnx.defs.register_schema(make_scatter_schema())
        if not onnx.defs.has(ATTENTION.op_type, OPSET_VERSION, DOMAIN):
            onnx.defs.register_schema(make_attention_schema())
    from pakv_onnx.export.ort_attention import register_ort_attention_schema  # (it imports the torch ops)

    register_ort_attention_schema()
    return onnx.defs.get_schema(OP_TYPE, OPSET_VERSION, DOMAIN)
