"""Translations of ``torch.ops.pakv.gather_pa_kv_cache`` into one ``pakv::GatherPaKvCache`` node, of
``torch.ops.pakv.scatter_pa_kv_cache_functional`` into one ``pakv::ScatterPaKvCache`` node, and of
``torch.ops.pakv.paged_attention`` into one ``pakv::PagedAttention`` node.

* :func:`translation_table` — for ``torch.onnx.export(..., dynamo=True,
  custom_translation_table=...)`` (onnxscript). The schema must be registered first
  (:func:`pakv_onnx.export.schema.register_schema`), or onnxscript fails with "No schema registered".
* :func:`register_legacy_symbolic` — for the TorchScript exporter (``dynamo=False``).

An absent ``seq_offset`` stays absent (the node gets four inputs); the fallback function
module deals with that case (see :mod:`pakv_onnx.export.fallback`).
"""

from __future__ import annotations

import inspect
import threading

import onnx
import onnxscript
import torch

from pakv_onnx import spec
from pakv_onnx.export import ort_attention, torch_op
from pakv_onnx.export import schema as _schema
from pakv_onnx.export.builder import node_attributes

_schema.register_schema()
PAKV_OPSET = onnxscript.values.Opset(spec.DOMAIN, spec.OPSET_VERSION)
MS_OPSET = onnxscript.values.Opset(spec.MS_DOMAIN, spec.MS_OPSET_VERSION)


def gather_pa_kv_cache_onnx(
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    seq_offset=None,
    cache_mode: str = spec.DEFAULT_CACHE_MODE.value,
    is_seq_lens_cumsum: bool = spec.DEFAULT_IS_SEQ_LENS_CUMSUM,
):
    """onnxscript translation: one ``pakv::GatherPaKvCache`` node with both attributes."""
    inputs = [key_cache, value_cache, block_tables, seq_lens]
    if seq_offset is not None:
        inputs.append(seq_offset)
    op = getattr(PAKV_OPSET, spec.OP_TYPE)
    return op(*inputs, **node_attributes(cache_mode, is_seq_lens_cumsum), _outputs=len(spec.OUTPUT_NAMES))


def check_signature(function) -> None:
    """``function``'s parameters must be spec's signature: names, order, defaults.

    The onnxscript translation keeps a Python signature (the exporter dispatches on it); this ties
    it to spec. (The TorchScript symbolic takes ``*args`` and binds them with spec.bind_arguments.)
    """
    params = list(inspect.signature(function).parameters.values())
    names = tuple(p.name for p in params)
    if names != spec.PARAMETER_NAMES:
        raise AssertionError(f"{function.__name__} takes {names}, spec says {spec.PARAMETER_NAMES}")
    for param in params:
        absent = None if param.name in spec.OPTIONAL_INPUTS else inspect.Parameter.empty
        expected = spec.ATTRIBUTE_DEFAULTS.get(param.name, absent)
        if param.default != expected:
            raise AssertionError(f"{function.__name__}: default of {param.name} is {param.default!r}, spec says {expected!r}")


def scatter_pa_kv_cache_onnx(key, value, key_cache, value_cache, slot_mapping, cache_mode: str = spec.DEFAULT_CACHE_MODE.value):
    """onnxscript translation of ``torch.ops.pakv.scatter_pa_kv_cache_functional``: one
    ``pakv::ScatterPaKvCache`` node whose outputs are the updated caches."""
    op = getattr(PAKV_OPSET, spec.SCATTER.op_type)
    mode = spec.parse_cache_mode(cache_mode).value
    return op(key, value, key_cache, value_cache, slot_mapping, cache_mode=mode, _outputs=len(spec.SCATTER.output_names))


def paged_attention_onnx(
    query, key_cache, value_cache, block_table, cumulative_sequence_lengths, past_sequence_lengths, scale: float = 0.0
):
    """onnxscript translation of ``torch.ops.pakv.paged_attention``: one ``pakv::PagedAttention`` node."""
    op = getattr(PAKV_OPSET, spec.ATTENTION.op_type)
    inputs = (query, key_cache, value_cache, block_table, cumulative_sequence_lengths, past_sequence_lengths)
    return op(*inputs, scale=spec.parse_scale(scale))


def ort_paged_attention_onnx(
    query, key, value, key_cache, value_cache, cumulative_sequence_length, past_seqlens, block_table, cos_cache,
    sin_cache, slot_mapping, head_sink, q_norm_weight, k_norm_weight, k_scale, v_scale, attention_metadata, *,
    num_heads: int, kv_num_heads: int, scale: float = 0.0, softcap: float = 0.0, local_window_size: int = -1,
    is_causal: int = 1, do_rotary: int = 0, rotary_interleaved: int = 0, qk_norm_epsilon: float = 1e-6,
    k_quant_type: str = "NONE", v_quant_type: str = "NONE", k_cache_dtype: str = "", v_cache_dtype: str = "",
    kv_cache_layout: str = "SEPARATE", v_head_size: int = 0, rotary_offset: int = 0,
):  # fmt: skip
    """onnxscript translation of ``torch.ops.pakv.ort_paged_attention_functional``: one
    ``com.microsoft::PagedAttention`` node (every attribute written; absent inputs left empty) whose
    outputs are the attention and the updated caches (LATENT has no value_cache_out: an empty constant
    stands for the torch op's third result)."""
    inputs = (
        query, key, value, key_cache, value_cache, cumulative_sequence_length, past_seqlens, block_table, cos_cache,
        sin_cache, slot_mapping, head_sink, q_norm_weight, k_norm_weight, k_scale, v_scale, attention_metadata,
    )  # fmt: skip
    attributes = {name: value for name, value in locals().items() if name in spec.ORT_ATTENTION.attribute_defaults}
    latent = kv_cache_layout == "LATENT"
    op = getattr(MS_OPSET, spec.ORT_ATTENTION.op_type)
    results = op(*inputs, **ort_attention.node_attributes(attributes), _outputs=2 if latent else 3)
    if not latent:
        return results
    empty = onnx.helper.make_tensor("empty", int(key_cache.dtype), [0], [])
    return (*results, onnxscript.opset18.Constant(value=empty))


def translation_table() -> dict:
    """``custom_translation_table`` entries for ``torch.onnx.export(..., dynamo=True)``."""
    return {
        torch_op.op_overload(): gather_pa_kv_cache_onnx,
        torch_op.scatter_functional_overload(): scatter_pa_kv_cache_onnx,
        torch_op.attention_overload(): paged_attention_onnx,
        ort_attention.functional_overload(): ort_paged_attention_onnx,
    }


# --------------------------------------------------------------------------- #
# Legacy TorchScript exporter (dynamo=False)
# --------------------------------------------------------------------------- #
_legacy_lock = threading.Lock()
_legacy_registered: set[int] = set()


def _legacy_symbolic(g, *args):
    """The TorchScript exporter's symbolic: it hands the op's arguments over positionally, in
    spec's order (attributes as constant Values), so they are bound by spec's names."""
    from torch.onnx import symbolic_helper

    bound = spec.bind_arguments(args, {})
    mode = symbolic_helper._maybe_get_const(bound[spec.ATTR_CACHE_MODE], "s")
    cumsum = symbolic_helper._maybe_get_const(bound[spec.ATTR_IS_SEQ_LENS_CUMSUM], "b")
    attrs = node_attributes(mode, bool(cumsum))
    # A None constant for an optional input (seq_offset) leaves it out: the node gets four inputs.
    inputs = [bound[name] for name in spec.INPUT_NAMES if not symbolic_helper._is_none(bound[name])]
    key, value = g.op(
        f"{spec.DOMAIN}::{spec.OP_TYPE}",
        *inputs,
        cache_mode_s=attrs[spec.ATTR_CACHE_MODE],
        is_seq_lens_cumsum_i=attrs[spec.ATTR_IS_SEQ_LENS_CUMSUM],
        outputs=len(spec.OUTPUT_NAMES),
    )
    key_cache, value_cache = bound[spec.INPUT_NAMES[0]], bound[spec.INPUT_NAMES[1]]
    # Output types: each output its own cache's dtype, rank from the layout; T unknown.
    for out, cache in ((key, key_cache), (value, value_cache)):
        cache_type = cache.type()
        rank = 3 if spec.CacheMode(mode) is spec.CacheMode.NORM else 2
        try:
            out.setType(cache_type.with_sizes([None] * rank))
        except (AttributeError, RuntimeError):
            pass
    return key, value


check_signature(gather_pa_kv_cache_onnx)


def _legacy_scatter_symbolic(g, *args):
    """The TorchScript exporter's symbolic for the functional scatter: one ScatterPaKvCache node."""
    from torch.onnx import symbolic_helper

    bound = spec.SCATTER.bind(args, {})
    mode = spec.parse_cache_mode(symbolic_helper._maybe_get_const(bound[spec.ATTR_CACHE_MODE], "s")).value
    inputs = [bound[name] for name in spec.SCATTER.input_names]
    key_cache_out, value_cache_out = g.op(
        f"{spec.DOMAIN}::{spec.SCATTER.op_type}", *inputs, cache_mode_s=mode, outputs=len(spec.SCATTER.output_names)
    )
    for out, cache in ((key_cache_out, bound["key_cache"]), (value_cache_out, bound["value_cache"])):
        try:
            out.setType(cache.type())  # an updated cache is its cache's type and shape
        except (AttributeError, RuntimeError):
            pass
    return key_cache_out, value_cache_out


def _legacy_attention_symbolic(g, *args):
    """The TorchScript exporter's symbolic for the attention: one PagedAttention node, query's type."""
    from torch.onnx import symbolic_helper

    bound = spec.ATTENTION.bind(args, {})
    scale = spec.parse_scale(float(symbolic_helper._maybe_get_const(bound[spec.ATTR_SCALE], "f")))
    inputs = [bound[name] for name in spec.ATTENTION.input_names]
    out = g.op(f"{spec.DOMAIN}::{spec.ATTENTION.op_type}", *inputs, scale_f=scale)
    try:
        out.setType(bound["query"].type().with_sizes([None] * 3))
    except (AttributeError, RuntimeError):
        pass
    return out


def _legacy_ort_attention_symbolic(g, *args):
    """The TorchScript exporter's symbolic for ``pakv::ort_paged_attention_functional``: one
    com.microsoft::PagedAttention node (absent inputs as ONNX's missing-input marker; LATENT: an empty
    constant for the third result, as the dynamo translation)."""
    from torch.onnx import symbolic_helper
    from torch.onnx.symbolic_opset9 import unused

    bound = spec.ORT_ATTENTION.bind(args, {})
    given = [not symbolic_helper._is_none(bound[n]) for n in spec.ORT_ATTENTION.input_names]
    count = max(i + 1 for i, present in enumerate(given) if present)  # trailing absent inputs are left out
    names = spec.ORT_ATTENTION.input_names[:count]
    inputs = [bound[n] if present else unused(g) for n, present in zip(names, given)]
    kinds = {str: "s", float: "f", int: "i"}
    attributes = {}
    for name, default in spec.ORT_ATTENTION.attribute_defaults.items():
        value = symbolic_helper._maybe_get_const(bound[name], kinds[type(default)])
        attributes[f"{name}_{kinds[type(default)]}"] = value
    latent = attributes["kv_cache_layout_s"] == "LATENT"
    results = g.op(f"{spec.MS_DOMAIN}::{spec.ORT_ATTENTION.op_type}", *inputs, **attributes, outputs=2 if latent else 3)
    try:
        results[0].setType(bound["query"].type().with_sizes([None, None]))
        for out, cache in zip(results[1:], (bound["key_cache"], bound["value_cache"])):
            out.setType(cache.type())
    except (AttributeError, RuntimeError):
        pass
    if not latent:
        return results
    empty = g.op("Constant", value_t=torch.zeros(0, dtype=bound["key_cache"].type().dtype()))
    return (*results, empty)


def register_legacy_symbolic(opset_version: int) -> None:
    """Register the TorchScript-exporter symbolics for ``pakv::gather_pa_kv_cache``,
    ``pakv::scatter_pa_kv_cache_functional`` and ``pakv::paged_attention`` (idempotent)."""
    with _legacy_lock:
        if opset_version in _legacy_registered:
            return
        torch.onnx.register_custom_op_symbolic(torch_op.QUALIFIED_NAME, _legacy_symbolic, opset_version)
        scatter_name = f"{spec.DOMAIN}::{torch_op.SCATTER_FUNCTIONAL_OP_NAME}"
        torch.onnx.register_custom_op_symbolic(scatter_name, _legacy_scatter_symbolic, opset_version)
        attention_name = f"{spec.DOMAIN}::{torch_op.ATTENTION_OP_NAME}"
        torch.onnx.register_custom_op_symbolic(attention_name, _legacy_attention_symbolic, opset_version)
        ort_name = f"{spec.DOMAIN}::{ort_attention.FUNCTIONAL_OP_NAME}"
        torch.onnx.register_custom_op_symbolic(ort_name, _legacy_ort_attention_symbolic, opset_version)
        _legacy_registered.add(opset_version)
