"""Hand-built graphs: ``pakv::GatherPaKvCache`` (``ScatterPaKvCache``, ``PagedAttention``) in an ONNX graph
without the exporter.

Every node and model here comes from the op's one declaration in :mod:`pakv_onnx.spec` (input
names in order, which are optional, output names, attribute names and defaults), the way
onnxruntime-extensions' ``SingleOpGraph`` builds each one-node graph from its op's declaration.

* :func:`gather_node` — one ``NodeProto`` (for ``onnx.helper`` graphs).
* :func:`make_gather_model` — a model with one node whose graph inputs are the op's inputs,
  typed from dtypes; :func:`make_gather_model_for` takes the dtypes from example tensors.
  Options cover what tests need as well: mixed dtypes, an absent ``seq_offset``, symbolic,
  concrete or no input shapes, the default-domain opset, and ``strict=False`` for graphs the
  runtime must refuse (dtypes outside the contract, attributes of any type or value, or none).
* onnxscript users call ``PAKV_OPSET.GatherPaKvCache(...)`` (``_outputs=2``; from
  :mod:`pakv_onnx.export`) inside ``@onnxscript.script()`` functions.

This module needs onnx and torch only (no onnxscript; the fallback is imported when attached),
so hand-built graphs work wherever the runtime plugin does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
import onnx
import torch
from onnx import TensorProto
from onnx import helper as h

from pakv_onnx import spec
from pakv_onnx.export.ir import cap_ir_version
from pakv_onnx.export.schema import register_schema
from pakv_onnx.spec import CacheMode

__all__ = [
    "DEFAULT_OPSET",
    "attention_node",
    "gather_node",
    "make_attention_model_for",
    "make_gather_model",
    "make_gather_model_for",
    "make_scatter_model_for",
    "scatter_node",
]

# torch 2.13's dynamo exporter emits opset 20 by default; the fallback body needs >= 19.
DEFAULT_OPSET = 20

# Input shapes of a built model: "symbolic" (named dims, below), None (unranked: inputs of any
# rank reach the node), or {input name: dims} with ints (concrete) or strings (named dims);
# inputs the mapping leaves out keep their symbolic dims.
Shapes = Literal["symbolic"] | Mapping[str, Sequence[int | str]] | None

_KEY_CACHE, _VALUE_CACHE, _BLOCK_TABLES, _SEQ_LENS, _SEQ_OFFSET = spec.INPUT_NAMES
_CACHE_INPUTS = (_KEY_CACHE, _VALUE_CACHE)
_INT32_INDICES = (torch.int32,) * len(spec.INPUT_NAMES[2:])
_OP_NAME = f"{spec.DOMAIN}::{spec.OP_TYPE}"


def _symbolic_shapes(mode: CacheMode, is_seq_lens_cumsum: bool) -> dict[str, list[str]]:
    """Named dims of every input: caches share num_blocks, index inputs share num_seqs."""
    if mode is CacheMode.NORM:
        key, value = ["num_blocks", "block_size", "Hk", "Dk"], ["num_blocks", "block_size", "Hv", "Dv"]
    else:
        # E is per cache (32 bytes / that cache's element size): the two may differ.
        key, value = ["num_blocks", "Fk", "block_size", "Ek"], ["num_blocks", "Fv", "block_size", "Ev"]
    return {
        _KEY_CACHE: key,
        _VALUE_CACHE: value,
        _BLOCK_TABLES: ["num_seqs", "table_cols"],
        _SEQ_LENS: ["num_seqs_plus_1" if is_seq_lens_cumsum else "num_seqs"],
        _SEQ_OFFSET: ["num_seqs"],
    }


def node_attributes(cache_mode: object, is_seq_lens_cumsum: object) -> dict[str, object]:
    """The node attributes as the contract writes them, read by spec's own parsers (``TypeError`` /
    ``ValueError`` naming a bad one, word for word as the op)."""
    return {
        spec.ATTR_CACHE_MODE: spec.parse_cache_mode(cache_mode).value,
        spec.ATTR_IS_SEQ_LENS_CUMSUM: int(spec.parse_cumsum_flag(is_seq_lens_cumsum)),
    }


def gather_node(
    key_cache: str,
    value_cache: str,
    block_tables: str,
    seq_lens: str,
    seq_offset: str | None = None,
    *,
    outputs: Sequence[str] = spec.OUTPUT_NAMES,
    cache_mode: str | CacheMode | object = spec.DEFAULT_CACHE_MODE,
    is_seq_lens_cumsum: bool | object = spec.DEFAULT_IS_SEQ_LENS_CUMSUM,
    name: str | None = None,
    strict: bool = True,
) -> onnx.NodeProto:
    """A ``pakv::GatherPaKvCache`` node reading the named values (``seq_offset`` optional).

    With ``strict=False`` the attributes are written as given (any ONNX attribute type or
    value; ``None`` leaves one out) and a required input may be empty: a node the runtime must
    refuse, for tests.

    Raises:
        ValueError: (strict) an empty required input, a bad attribute value, or not two outputs.
        TypeError: (strict) a ``cache_mode`` that is not a string.
    """
    if len(outputs) != len(spec.OUTPUT_NAMES):
        raise ValueError(f"outputs must name {len(spec.OUTPUT_NAMES)} values {spec.OUTPUT_NAMES}, got {list(outputs)}")
    inputs = [key_cache, value_cache, block_tables, seq_lens, seq_offset or ""]
    if strict:
        missing = [n for n, v in zip(spec.INPUT_NAMES, inputs) if not v and n not in spec.OPTIONAL_INPUTS]
        if missing:
            raise ValueError(f"{_OP_NAME} needs a value for the required input(s) {missing}")
        attributes = node_attributes(cache_mode, is_seq_lens_cumsum)
    else:
        attributes = {spec.ATTR_CACHE_MODE: cache_mode, spec.ATTR_IS_SEQ_LENS_CUMSUM: is_seq_lens_cumsum}
    while inputs and not inputs[-1]:
        inputs.pop()  # an absent trailing optional input is left out, not named ""
    node = h.make_node(spec.OP_TYPE, inputs, list(outputs), name=name, domain=spec.DOMAIN)
    node.attribute.extend(h.make_attribute(k, v) for k, v in attributes.items() if v is not None)
    return node


def _element_type(name: str, dtype: torch.dtype, strict: bool) -> int:
    """ONNX element type of input ``name``; strict: a contract dtype for that input or ``ValueError``."""
    lookup = spec.cache_dtype if name in _CACHE_INPUTS else spec.index_dtype
    try:
        return lookup(dtype).onnx_type
    except ValueError as err:
        if strict:
            raise ValueError(f"{name}: {err}") from None
    try:  # outside the contract (a graph the runtime must refuse): onnx's own numpy mapping
        return h.np_dtype_to_tensor_dtype(np.dtype(str(dtype).removeprefix("torch.")))
    except (TypeError, ValueError):
        raise TypeError(f"{name}: torch dtype {dtype} has no ONNX element type") from None


def _input_shapes(shapes: Shapes, mode: object, is_seq_lens_cumsum: object) -> dict[str, Sequence[int | str] | None]:
    if shapes is None:
        return dict.fromkeys(spec.INPUT_NAMES)
    # A str or CacheMode; anything else (an invalid attribute, strict=False) gets the Norm dims.
    known_mode = mode in tuple(m.value for m in CacheMode)
    symbolic = _symbolic_shapes(CacheMode(mode) if known_mode else CacheMode.NORM, bool(is_seq_lens_cumsum))
    if isinstance(shapes, str):
        if shapes != "symbolic":
            raise ValueError(f"shapes must be 'symbolic', None or {{input name: dims}}, got {shapes!r}")
        return symbolic
    unknown = set(shapes) - set(spec.INPUT_NAMES)
    if unknown:
        raise ValueError(f"shapes names unknown inputs {sorted(unknown)} (inputs: {', '.join(spec.INPUT_NAMES)})")
    return {**symbolic, **shapes}


def make_gather_model(
    dtype: torch.dtype,
    *,
    value_dtype: torch.dtype | None = None,
    cache_mode: str | CacheMode | object = spec.DEFAULT_CACHE_MODE,
    is_seq_lens_cumsum: bool | object = spec.DEFAULT_IS_SEQ_LENS_CUMSUM,
    with_seq_offset: bool = True,
    index_dtypes: Sequence[torch.dtype] = _INT32_INDICES,
    shapes: Shapes = "symbolic",
    fallback: bool = True,
    opset_version: int = DEFAULT_OPSET,
    strict: bool = True,
) -> onnx.ModelProto:
    """A model with one GatherPaKvCache node; inputs named as in the contract, outputs ``key``, ``value``.

    Args:
        dtype: key_cache's element type; ``value_dtype`` value_cache's (default: ``dtype``).
            Each output has its cache's type.
        index_dtypes: of (block_tables, seq_lens[, seq_offset]), int32 or int64 each.
        with_seq_offset: False leaves the optional input out.
        shapes: the inputs' dims (see :data:`Shapes`); every dim symbolic by default.
        fallback: attach the stock-ONNX fallback function (needs ``opset_version`` >= 19).
        opset_version: of the default ONNX domain.
        strict: False writes dtypes and attributes as given (see :func:`gather_node`), for
            graphs the runtime (or the fallback) must refuse; the outputs are typed, unshaped.

    Outputs: each cache's element type; shapes from the schema's inference when inputs are
    shaped (``[T, H, D]`` Norm, ``[T, H*D]`` PA_NZ, T a per-node symbol).

    Raises:
        ValueError / TypeError: (strict) a dtype outside the contract or a bad attribute, naming it.
    """
    present = [n for n in spec.INPUT_NAMES if with_seq_offset or n not in spec.OPTIONAL_INPUTS]
    dtypes = dict(zip(spec.INPUT_NAMES, (dtype, value_dtype if value_dtype is not None else dtype, *index_dtypes)))
    if not set(present) <= set(dtypes):
        raise ValueError(f"index_dtypes {tuple(index_dtypes)} gives no dtype for {sorted(set(present) - set(dtypes))}")
    dims = _input_shapes(shapes, cache_mode, is_seq_lens_cumsum)
    inputs = [h.make_tensor_value_info(n, _element_type(n, dtypes[n], strict), dims[n]) for n in present]
    node = gather_node(
        *present, cache_mode=cache_mode, is_seq_lens_cumsum=is_seq_lens_cumsum, name="gather", strict=strict
    )
    output_types = [i.type.tensor_type.elem_type for i in inputs[: len(spec.OUTPUT_NAMES)]]  # key <- key_cache
    outputs = [h.make_tensor_value_info(n, t, None) for n, t in zip(spec.OUTPUT_NAMES, output_types)]
    graph = h.make_graph([node], "gather_pa_kv_cache", inputs, outputs)
    model = cap_ir_version(
        h.make_model(
            graph, opset_imports=[h.make_opsetid("", opset_version), h.make_opsetid(spec.DOMAIN, spec.OPSET_VERSION)]
        )
    )
    if strict:
        _infer_outputs(model)
    if fallback:
        from pakv_onnx.export.fallback import attach_fallback  # onnxscript: only when attached

        attach_fallback(model)
    return model


def _infer_outputs(model: onnx.ModelProto) -> None:
    """Check the node against the schema and take the outputs' inferred shapes (in place)."""
    register_schema()
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    by_name = {v.name: v for v in (*inferred.graph.value_info, *inferred.graph.output)}
    for output in model.graph.output:
        found = by_name.get(output.name)
        if found is not None and found.type.tensor_type.HasField("shape"):
            output.CopyFrom(found)


def make_gather_model_for(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_offset: torch.Tensor | None = None,
    *,
    shapes: Shapes | Literal["concrete"] = "symbolic",
    **options: object,
) -> onnx.ModelProto:
    """:func:`make_gather_model` for example inputs: their dtypes, ``seq_offset`` present when given.

    ``shapes="concrete"`` declares the examples' own shapes; ``options`` are
    :func:`make_gather_model`'s (``cache_mode``, ``is_seq_lens_cumsum``, ``fallback``, ...).
    """
    examples = dict(zip(spec.INPUT_NAMES, (key_cache, value_cache, block_tables, seq_lens, seq_offset)))
    if shapes == "concrete":
        shapes = {name: list(t.shape) for name, t in examples.items() if t is not None}
    index_dtypes = tuple(t.dtype if t is not None else torch.int32 for t in (block_tables, seq_lens, seq_offset))
    return make_gather_model(
        key_cache.dtype,
        value_dtype=value_cache.dtype,
        with_seq_offset=seq_offset is not None,
        index_dtypes=index_dtypes,
        shapes=shapes,
        **options,  # type: ignore[arg-type]
    )


# --------------------------------------------------------------------------- #
# ScatterPaKvCache
# --------------------------------------------------------------------------- #
def scatter_node(
    key: str,
    value: str,
    key_cache: str,
    value_cache: str,
    slot_mapping: str,
    *,
    outputs: Sequence[str] = spec.SCATTER.output_names,
    cache_mode: str | CacheMode = spec.DEFAULT_CACHE_MODE,
    name: str | None = None,
) -> onnx.NodeProto:
    """A ``pakv::ScatterPaKvCache`` node: the updated caches are ``outputs`` (key_cache_out, value_cache_out)."""
    if len(outputs) != len(spec.SCATTER.output_names):
        raise ValueError(f"outputs must name {len(spec.SCATTER.output_names)} values, got {list(outputs)}")
    node = h.make_node(
        spec.SCATTER.op_type, [key, value, key_cache, value_cache, slot_mapping], list(outputs), name=name,
        domain=spec.DOMAIN,
    )  # fmt: skip
    node.attribute.append(h.make_attribute(spec.ATTR_CACHE_MODE, spec.parse_cache_mode(cache_mode).value))
    return node


def make_scatter_model_for(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    cache_mode: str | CacheMode = spec.DEFAULT_CACHE_MODE,
    then_gather: bool = False,
    fallback: bool = True,
    opset_version: int = DEFAULT_OPSET,
) -> onnx.ModelProto:
    """A model writing ``key``/``value`` into the caches (inputs named as the op's, of the examples' dtypes).

    ``then_gather=False``: the one node; its outputs ``key_cache_out`` / ``value_cache_out`` are the
    graph's (in place only when the host binds each to its cache's buffer). ``then_gather=True``:
    the updated caches feed a GatherPaKvCache (extra inputs ``block_tables``, ``seq_lens``; graph
    outputs ``key_all``, ``value_all``), the decoder step's shape: with ORT >= 1.18 and a registration
    that opted into the alias route (``runtime_plugin.make_session`` does for this graph), the updated
    caches are the input caches' own buffers, written in place.
    """
    names = spec.SCATTER.input_names
    examples = dict(zip(names, (key, value, key_cache, value_cache, slot_mapping)))
    inputs = [h.make_tensor_value_info(n, spec.ONNX_ELEMENT_TYPE_OF[t.dtype], None) for n, t in examples.items()]
    key_type, value_type = inputs[2].type.tensor_type.elem_type, inputs[3].type.tensor_type.elem_type
    if then_gather:
        updated = ("_key_cache_updated", "_value_cache_updated")
        inputs += [h.make_tensor_value_info(n, TensorProto.INT64, None) for n in ("block_tables", "seq_lens")]
        nodes = [
            scatter_node(*names, outputs=updated, cache_mode=cache_mode, name="scatter"),
            gather_node(*updated, "block_tables", "seq_lens", outputs=("key_all", "value_all"), cache_mode=cache_mode, name="gather"),
        ]
        outputs = [h.make_tensor_value_info(n, t, None) for n, t in zip(("key_all", "value_all"), (key_type, value_type))]
    else:
        nodes = [scatter_node(*names, cache_mode=cache_mode, name="scatter")]
        outputs = [h.make_tensor_value_info(n, t, None) for n, t in zip(spec.SCATTER.output_names, (key_type, value_type))]
    model = h.make_model(
        h.make_graph(nodes, "scatter_pa_kv_cache", inputs, outputs),
        opset_imports=[h.make_opsetid("", opset_version), h.make_opsetid(spec.DOMAIN, spec.OPSET_VERSION)],
    )
    cap_ir_version(model)
    if fallback:
        from pakv_onnx.export.fallback import attach_fallback

        attach_fallback(model)
    return model


# --------------------------------------------------------------------------- #
# PagedAttention
# --------------------------------------------------------------------------- #
def attention_node(
    *inputs: str,
    output: str = spec.ATTENTION.output_names[0],
    scale: float = spec.ATTENTION.attribute_defaults[spec.ATTR_SCALE],
    name: str | None = None,
) -> onnx.NodeProto:
    """A ``pakv::PagedAttention`` node over the six named inputs (spec.ATTENTION's order); ``scale``
    0 (the default) means 1 / sqrt(head_dim) and is left out of the node."""
    if len(inputs) != len(spec.ATTENTION.input_names):
        raise ValueError(f"PagedAttention takes {len(spec.ATTENTION.input_names)} inputs, got {list(inputs)}")
    node = h.make_node(spec.ATTENTION.op_type, list(inputs), [output], name=name, domain=spec.DOMAIN)
    value = spec.parse_scale(scale)
    if value != 0.0:
        node.attribute.append(h.make_attribute(spec.ATTR_SCALE, value))
    return node


def make_attention_model_for(
    *examples: torch.Tensor, scale: float = 0.0, fallback: bool = True, opset_version: int = DEFAULT_OPSET
) -> onnx.ModelProto:
    """A one-node PagedAttention model (inputs named as the op's, of the examples' dtypes, dims
    symbolic; output ``output``), with the stock-ONNX fallback function unless ``fallback=False``.
    ``examples``: the op's six inputs in ``spec.ATTENTION.input_names`` order (``TypeError`` otherwise)."""
    query = spec.ATTENTION.inputs_of(examples)[0]
    names = spec.ATTENTION.input_names
    inputs = [
        h.make_tensor_value_info(n, spec.ONNX_ELEMENT_TYPE_OF[t.dtype], [f"{n}_{d}" for d in range(t.dim())])
        for n, t in zip(names, examples)
    ]
    out_dims = ["query_0", "query_1", "value_cache_3"]  # [N, Hq, Dv]: the schema's inference
    output = h.make_tensor_value_info(spec.ATTENTION.output_names[0], spec.ONNX_ELEMENT_TYPE_OF[query.dtype], out_dims)
    model = h.make_model(
        h.make_graph([attention_node(*names, scale=scale, name="attention")], "paged_attention", inputs, [output]),
        opset_imports=[h.make_opsetid("", opset_version), h.make_opsetid(spec.DOMAIN, spec.OPSET_VERSION)],
    )
    cap_ir_version(model)
    if fallback:
        from pakv_onnx.export.fallback import attach_fallback

        attach_fallback(model)
    return model
