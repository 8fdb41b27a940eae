"""ONNX Runtime's ``com.microsoft::PagedAttention`` in torch and in ONNX graphs (no onnxscript here).

* ``torch.ops.pakv.ort_paged_attention`` — the op in place (the caches written, the output
  returned): :func:`pakv_onnx.ort_paged_attention` behind the dispatcher, for eager code.
* ``torch.ops.pakv.ort_paged_attention_functional`` — the same returning ``(output, key_cache_out,
  value_cache_out)`` (updated copies; LATENT: an empty value_cache_out): what an exported graph
  records, one ``com.microsoft::PagedAttention`` node whose cache outputs ORT aliases to its inputs
  (:mod:`pakv_onnx.export.translation` translates it, dynamo and TorchScript).
* :func:`make_ort_attention_schema` / :func:`register_ort_attention_schema` — the op's OpSchema in
  :mod:`onnx.defs` (ORT's bert_defs.cc declaration, with float32 T and int64 indices as this
  package's kernel takes them), which the dynamo exporter needs; inference: output ``[N, Hq * Dv]``
  of query's type, each cache output its cache's type and shape.
* :func:`ort_attention_node` / :func:`make_ort_attention_model_for` — hand-built one-node graphs.

Attributes follow ORT's names and defaults (``spec.ORT_ATTENTION``).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import onnx
import onnx.defs
import torch
from onnx import helper as h

from pakv_onnx import ops
from pakv_onnx.export.ir import cap_ir_version
from pakv_onnx.export.torch_op import meta_routed
from pakv_onnx.spec import DOMAIN, MS_DOMAIN, MS_OPSET_VERSION, ONNX_TYPE_OF, ORT_ATTENTION
from pakv_onnx.validator import plan_ort_attention

OP_NAME = "ort_paged_attention"
FUNCTIONAL_OP_NAME = "ort_paged_attention_functional"
_MUTATED = ("key_cache", "value_cache")
_STRINGS = ("k_quant_type", "v_quant_type", "k_cache_dtype", "v_cache_dtype", "kv_cache_layout")


# --------------------------------------------------------------------------------------------- #
# torch ops
# --------------------------------------------------------------------------------------------- #
def _declaration(name: str, default: object) -> str:
    if isinstance(default, str):
        return f'str {name}="{default}"'
    if isinstance(default, float):
        return f"float {name}={default!r}"
    return f"int {name}" if name in ("num_heads", "kv_num_heads") else f"int {name}={default}"


def torch_schema(functional: bool) -> str:
    """``(Tensor query, Tensor? key, ..., Tensor(a!) key_cache, Tensor(b!)? value_cache, ...,
    int num_heads, int kv_num_heads, float scale=0.0, ...) -> Tensor`` (functional: nothing mutated,
    ``-> (Tensor, Tensor, Tensor)``)."""
    aliases = iter("ab")
    tensors = []
    for name in ORT_ATTENTION.input_names:
        optional = "?" if name in ORT_ATTENTION.optional_inputs else ""
        mark = f"({next(aliases)}!)" if name in _MUTATED and not functional else ""
        tensors.append(f"Tensor{mark}{optional} {name}")
    # Positional tensors, then the attributes (num_heads and kv_num_heads first: they have no default).
    attributes = [_declaration(n, d) for n, d in ORT_ATTENTION.attribute_defaults.items()]
    returns = "(Tensor, Tensor, Tensor)" if functional else "Tensor"
    return f"({', '.join(tensors)}, *, {', '.join(attributes)}) -> {returns}"


def _split(args: tuple, kwargs: dict) -> tuple[list, dict]:
    bound = ORT_ATTENTION.bind(args, kwargs)
    return [bound[n] for n in ORT_ATTENTION.input_names], {n: bound[n] for n in ORT_ATTENTION.attribute_defaults}


def _kernel(*args, **kwargs) -> torch.Tensor:
    """com.microsoft::PagedAttention in place, as :func:`pakv_onnx.ort_paged_attention`."""
    inputs, attributes = _split(args, kwargs)
    return ops.ort_paged_attention(*inputs, **attributes)


def _output_fake(inputs: list, attributes: dict) -> torch.Tensor:
    query = inputs[0]
    heads, kv_heads = attributes["num_heads"], attributes["kv_num_heads"]
    packed = inputs[1] is None and attributes["kv_cache_layout"] != "LATENT"
    head_size = query.shape[1] // (heads + 2 * kv_heads if packed else heads)
    return query.new_empty((query.shape[0], heads * (attributes["v_head_size"] or head_size)))


def _fake(*args, **kwargs) -> torch.Tensor:
    return _output_fake(*_split(args, kwargs))


def _functional_kernel(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op on copies of the caches (what a traced graph records; eager code calls the in-place op)."""
    inputs, attributes = _split(args, kwargs)
    # The rules on the caller's pools first (an input stored inside one is refused by name, as on every
    # other path): the copies below would share no bytes with anything.
    plan_ort_attention(inputs, attributes)
    inputs[3] = inputs[3].clone()
    inputs[4] = inputs[4].clone() if inputs[4] is not None else None
    out = ops.ort_paged_attention(*inputs, **attributes)
    value_out = inputs[4] if inputs[4] is not None else inputs[3].new_empty(0)
    return out, inputs[3], value_out


def _functional_fake(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    inputs, attributes = _split(args, kwargs)
    value_out = torch.empty_like(inputs[4]) if inputs[4] is not None else inputs[3].new_empty(0)
    return _output_fake(inputs, attributes), torch.empty_like(inputs[3]), value_out


_LIBRARY = torch.library.Library(DOMAIN, "FRAGMENT")


def _define(name: str, schema: str, kernel, fake):
    """``torch.ops.pakv.<name>``; a meta tensor among real ones runs ``kernel``, whose validator names it
    (the fake alone would return uninitialised memory and write nothing)."""
    _LIBRARY.define(name + schema)
    _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{DOMAIN}::{name}", meta_routed(kernel, fake), lib=_LIBRARY)
    return getattr(getattr(torch.ops, DOMAIN), name)


ort_paged_attention = _define(OP_NAME, torch_schema(False), _kernel, _fake)
ort_paged_attention_functional = _define(FUNCTIONAL_OP_NAME, torch_schema(True), _functional_kernel, _functional_fake)


def functional_overload() -> torch._ops.OpOverload:
    """``torch.ops.pakv.ort_paged_attention_functional.default`` (the overload exporters key on)."""
    return getattr(getattr(torch.ops, DOMAIN), FUNCTIONAL_OP_NAME).default


# --------------------------------------------------------------------------------------------- #
# ONNX schema
# --------------------------------------------------------------------------------------------- #
_DOC = (
    "ONNX Runtime's paged attention (com.microsoft, bert_defs.cc): each new token's key and value (q/k RMSNorm, "
    "rotary at position past + j, int8 / float8 quantization) written into the block pools in place (slot_mapping "
    "or derived from past_seqlens and block_table), then attention over the caches (GQA, window, softcap, sinks, "
    "causal or not, LATENT absorbed MLA). This declaration is the CPU plugin's (pakv-onnx): T also float32, "
    "index inputs int32 or int64."
)
_INPUT_T = {
    **dict.fromkeys(("query", "key", "value", "cos_cache", "sin_cache", "head_sink", "q_norm_weight", "k_norm_weight"), "T"),
    **dict.fromkeys(("key_cache", "value_cache"), "T_CACHE"),
    **dict.fromkeys(("k_scale", "v_scale"), "T_KV_SCALE"),
    **dict.fromkeys(("cumulative_sequence_length", "past_seqlens", "block_table", "slot_mapping", "attention_metadata"), "S"),
}  # fmt: skip
_lock = threading.Lock()


def _attr(ctx, name: str, default):
    proto = ctx.get_attribute(name)
    return default if proto is None else onnx.helper.get_attribute_value(proto)


def _infer(ctx) -> None:
    query = ctx.get_input_type(0)
    if ctx.has_output(0) and query is not None and query.HasField("tensor_type"):
        out = onnx.TypeProto()
        out.tensor_type.elem_type = query.tensor_type.elem_type
        shape = query.tensor_type.shape if query.tensor_type.HasField("shape") else None
        if shape is not None and len(shape.dim) == 2:
            heads, kv_heads = _attr(ctx, "num_heads", 0), _attr(ctx, "kv_num_heads", 0)
            latent = _attr(ctx, "kv_cache_layout", b"SEPARATE") in (b"LATENT", "LATENT")
            packed = not latent and not ctx.has_input(1)
            out.tensor_type.shape.dim.add().CopyFrom(shape.dim[0])
            hidden = out.tensor_type.shape.dim.add()
            if shape.dim[1].HasField("dim_value") and heads > 0:
                head_size = shape.dim[1].dim_value // (heads + 2 * kv_heads if packed else heads)
                hidden.dim_value = heads * (_attr(ctx, "v_head_size", 0) or head_size)
        ctx.set_output_type(0, out)
    for index in (1, 2):  # each cache output is its cache's type and shape
        cache = ctx.get_input_type(2 + index)
        if ctx.has_output(index) and cache is not None and cache.HasField("tensor_type"):
            ctx.set_output_type(index, cache)


def _attributes() -> list[onnx.defs.OpSchema.Attribute]:
    attributes = []
    for name, default in ORT_ATTENTION.attribute_defaults.items():
        if name in ("num_heads", "kv_num_heads"):
            attributes.append(onnx.defs.OpSchema.Attribute(name, onnx.defs.OpSchema.AttrType.INT, name, required=True))
        else:
            attributes.append(onnx.defs.OpSchema.Attribute(name, h.make_attribute(name, default), name))
    return attributes


def make_ort_attention_schema() -> onnx.defs.OpSchema:
    """A fresh OpSchema of com.microsoft::PagedAttention (not registered)."""
    formal = onnx.defs.OpSchema.FormalParameter
    option = onnx.defs.OpSchema.FormalParameterOption
    inputs = [
        formal(n, _INPUT_T[n], param_option=option.Optional if n in ORT_ATTENTION.optional_inputs else option.Single)
        for n in ORT_ATTENTION.input_names
    ]
    outputs = [formal("output", "T"), *(formal(n, "T_CACHE", param_option=option.Optional) for n in _MUTATED_OUT)]
    floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
    constraints = [
        ("T", floats, "query, key, value, cos/sin, head_sink, norm weights and output type"),
        ("T_CACHE", [*floats, "tensor(int8)", "tensor(float8e4m3fn)", "tensor(uint8)"], "the caches' element type"),
        ("T_KV_SCALE", ["tensor(float)"], "the caches' scales"),
        ("S", ["tensor(int32)", "tensor(int64)"], "index inputs"),
    ]
    schema = onnx.defs.OpSchema(
        ORT_ATTENTION.op_type, MS_DOMAIN, MS_OPSET_VERSION, _DOC, inputs=inputs, outputs=outputs,
        type_constraints=constraints, attributes=_attributes(),
    )  # fmt: skip
    if hasattr(schema, "set_type_and_shape_inference_function"):
        schema.set_type_and_shape_inference_function(_infer)
    return schema


_MUTATED_OUT = ("key_cache_out", "value_cache_out")


def register_ort_attention_schema() -> None:
    """Register the schema with ``onnx.defs`` once per process (idempotent).

    onnx's reference evaluator (which onnxscript's optimizer imports) lists every registered schema
    once, when first imported, and refuses two ops of one name in two domains (pakv::PagedAttention
    and this one): it is imported first, so its list is made before this op is in the registry."""
    import onnx.reference.op_run

    with _lock:
        if not onnx.defs.has(ORT_ATTENTION.op_type, MS_OPSET_VERSION, MS_DOMAIN):
            onnx.defs.register_schema(make_ort_attention_schema())


# --------------------------------------------------------------------------------------------- #
# Hand-built graphs
# --------------------------------------------------------------------------------------------- #
def node_attributes(attributes: Mapping[str, object]) -> dict[str, object]:
    """ORT's attributes for a node: the given ones, strings as strings, others as they are."""
    unknown = set(attributes) - set(ORT_ATTENTION.attribute_defaults)
    if unknown:
        raise TypeError(f"PagedAttention has no attribute {min(unknown)!r}")
    return {n: (v.decode() if isinstance(v, bytes) else v) for n, v in attributes.items()}


def ort_attention_node(inputs: Mapping[str, str | None], outputs: tuple[str, ...], **attributes: object) -> onnx.NodeProto:
    """One com.microsoft::PagedAttention node: ``inputs`` maps ORT's input names to graph names (absent
    or None: left out), ``outputs`` its output names (1, 2 or 3)."""
    names = [inputs.get(n) or "" for n in ORT_ATTENTION.input_names]
    while names and not names[-1]:
        names.pop()
    return h.make_node(ORT_ATTENTION.op_type, names, list(outputs), domain=MS_DOMAIN, **node_attributes(attributes))


def make_ort_attention_model_for(
    inputs: Mapping[str, torch.Tensor | None], *, cache_outputs: bool = True, opset: int = 20, **attributes: object
) -> onnx.ModelProto:
    """A one-node model of com.microsoft::PagedAttention typed from example tensors (unranked inputs,
    so every shape reaches the kernel): graph inputs named as ORT names them, outputs ``output`` and,
    with ``cache_outputs``, ``key_cache_out`` (and ``value_cache_out`` unless LATENT)."""
    present = {n: t for n, t in inputs.items() if t is not None}
    latent = attributes.get("kv_cache_layout") == "LATENT"
    outputs = ("output", *(("key_cache_out",) if latent else _MUTATED_OUT)) if cache_outputs else ("output",)
    node = ort_attention_node({n: n for n in present}, outputs, **attributes)
    types = {"output": present["query"].dtype, "key_cache_out": present["key_cache"].dtype,
             "value_cache_out": present["key_cache"].dtype}  # fmt: skip
    graph = h.make_graph(
        [node], "ort_paged_attention",
        [h.make_tensor_value_info(n, ONNX_TYPE_OF[t.dtype], None) for n, t in present.items() if n in node.input],
        [h.make_tensor_value_info(o, ONNX_TYPE_OF[types[o]], None) for o in outputs],
    )  # fmt: skip
    opsets = [h.make_opsetid("", opset), h.make_opsetid(MS_DOMAIN, MS_OPSET_VERSION)]
    return cap_ir_version(h.make_model(graph, opset_imports=opsets))


__all__ = [
    "make_ort_attention_model_for",
    "make_ort_attention_schema",
    "ort_attention_node",
    "ort_paged_attention",
    "ort_paged_attention_functional",
    "register_ort_attention_schema",
]
