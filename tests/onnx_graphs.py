"""One-node test models for the runtime plugin, all from the one builder
(:func:`pakv_onnx.export.make_gather_model`), with the options the plugin's tests share.

* :func:`plugin_model` / :func:`plugin_model_for` — from dtypes / from example tensors.
* :func:`model_for_case` / :func:`feeds_for_case` — a :class:`~pakv_onnx.cases.GatherCase`'s
  model and its inputs keyed by the model's input names.
* :func:`parallel_copies` — independent copies of a model's node in one graph (ORT_PARALLEL).
* :func:`pakv_nodes` — a graph's ``pakv`` nodes in order, subgraphs' (a Loop body's) in their node's place.
* :func:`plugin_refusal` — what the plugin says of one call of a one-node model (a refusal's message).
* :func:`assert_one_ort_attention_per_layer` — an exported ``ort``-form decoder step's attention wiring.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import onnx
import torch
from conftest import ORT_ERRORS

from pakv_onnx import runtime_plugin
from pakv_onnx.cases import GatherCase
from pakv_onnx.export import make_gather_model, make_gather_model_for
from pakv_onnx.spec import INPUT_NAMES

# Unranked inputs: an input of any rank reaches the node, so the plugin's own checks answer
# (not ORT's shape check). No fallback function: nothing but the plugin can run the node.
PLUGIN_OPTIONS: dict[str, object] = {"shapes": None, "fallback": False}


def plugin_model(dtype: torch.dtype, **options: object) -> onnx.ModelProto:
    """:func:`make_gather_model` (``dtype`` = key_cache's) with :data:`PLUGIN_OPTIONS` under ``options``."""
    return make_gather_model(dtype, **{**PLUGIN_OPTIONS, **options})  # type: ignore[arg-type]


def plugin_model_for(*inputs: torch.Tensor | None, **options: object) -> onnx.ModelProto:
    """:func:`make_gather_model_for` (example inputs' dtypes) with :data:`PLUGIN_OPTIONS` under ``options``."""
    return make_gather_model_for(*inputs, **{**PLUGIN_OPTIONS, **options})  # type: ignore[arg-type]


def model_for_case(case: GatherCase, num_nodes: int = 1) -> onnx.ModelProto:
    """``case``'s dtypes and attributes; with ``num_nodes`` > 1, see :func:`parallel_copies`."""
    model = plugin_model_for(*case.inputs(), **case.attributes())
    return parallel_copies(model, num_nodes) if num_nodes > 1 else model


def feeds_for_case(case: GatherCase, suffix: str = "") -> dict[str, torch.Tensor]:
    """The case's inputs keyed by the model's input names (absent optional inputs left out)."""
    return {name + suffix: t for name, t in zip(INPUT_NAMES, case.inputs()) if t is not None}


def parallel_copies(model: onnx.ModelProto, count: int) -> onnx.ModelProto:
    """``count`` independent copies of ``model``'s graph in one model (branches for ORT_PARALLEL).

    Copy ``i`` reads ``<input>_<i>`` and writes ``<output>_<i>``; an empty (absent) input stays empty.
    """
    merged = onnx.ModelProto()
    merged.CopyFrom(model)
    graph = merged.graph
    for field in (graph.node, graph.input, graph.output, graph.value_info):
        del field[:]
    for i in range(count):

        def renamed(name: str, i: int = i) -> str:
            return f"{name}_{i}" if name else name

        for node in model.graph.node:
            copy = graph.node.add()
            copy.CopyFrom(node)
            copy.name = renamed(node.name)
            copy.input[:] = [renamed(n) for n in node.input]
            copy.output[:] = [renamed(n) for n in node.output]
        for source, target in ((model.graph.input, graph.input), (model.graph.output, graph.output)):
            for value in source:
                copy = target.add()
                copy.CopyFrom(value)
                copy.name = renamed(value.name)
    return merged


def pakv_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """``graph``'s nodes of the ``pakv`` domain in node order, each subgraph's (a ``Loop`` body's)
    in the place of the node that holds it (DeepSeek-V3's gathers run inside its attention Loop)."""
    found = []
    for node in graph.node:
        if node.domain == "pakv":
            found.append(node)
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                found += pakv_nodes(attribute.g)
    return found


def graph_feeds(inputs: dict, names: Sequence[str]) -> list[torch.Tensor] | None:
    """``inputs[name]`` for each of ``names``, or None when a graph input cannot carry one (not a
    tensor, or not contiguous): the calls a one-node session can express."""
    tensors = [inputs[n] for n in names]
    return tensors if all(isinstance(t, torch.Tensor) and t.is_contiguous() for t in tensors) else None


def plugin_refusal(
    make_model_for: Callable[..., onnx.ModelProto],
    names: Sequence[str],
    tensors: Sequence[torch.Tensor],
    backend: str,
    **attributes: object,
) -> str | None:
    """Run the one-node model ``make_model_for(*tensors, **attributes)`` makes (no fallback, opset 17)
    once on ``tensors`` (fed as ``names``) in a plugin session of ``backend``: the ORT error's message,
    ``""`` if the call ran, or ``None`` if ORT refused the model or the session itself (a dtype outside
    the op's type constraints, which is not the plugin's answer)."""
    try:
        model = make_model_for(*tensors, fallback=False, opset_version=17, **attributes)
        session = runtime_plugin.make_session(model, backend=backend)
    except Exception:  # noqa: BLE001 - refused at session creation, before the plugin sees a call
        return None
    try:
        runtime_plugin.run(session, dict(zip(names, tensors)))
    except ORT_ERRORS as err:
        return str(err)
    return ""


def assert_one_ort_attention_per_layer(model: onnx.ModelProto, layers: int, *, latent: bool) -> None:
    """Each layer's attention is one com.microsoft::PagedAttention over the step's own inputs and its pools,
    its cache outputs the present outputs; no pakv node, and nothing else reads the block table or the
    past lengths (no position or slot prologue): the cumulative lengths feed only the ops and the Slice
    of each sequence's last row."""
    ops = [n for n in model.graph.node if n.op_type == "PagedAttention"]
    assert len(ops) == layers and all(n.domain == "com.microsoft" for n in ops) and not pakv_nodes(model.graph)
    for layer, node in enumerate(ops):
        value = "" if latent else f"past_key_values.{layer}.value"
        step_inputs = ["cumulative_sequence_lengths", "past_sequence_lengths", "block_table"]
        assert list(node.input[3:8]) == [f"past_key_values.{layer}.key", value, *step_inputs]
        assert list(node.input[8:10]) == [ops[0].input[8], ops[0].input[9]]  # one cos/sin table for every layer
        assert list(node.output[1:]) == [f"present.{layer}.key", *([] if latent else [f"present.{layer}.value"])]
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attributes["do_rotary"] == 1 and "slot_mapping" not in node.input
    readers = {name: [n.op_type for n in model.graph.node if name in n.input]
               for name in ("cumulative_sequence_lengths", "past_sequence_lengths", "block_table")}  # fmt: skip
    assert readers["past_sequence_lengths"] == readers["block_table"] == ["PagedAttention"] * layers
    assert sorted(readers["cumulative_sequence_lengths"]) == ["PagedAttention"] * layers + ["Slice"]
