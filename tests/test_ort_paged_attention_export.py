"""com.microsoft::PagedAttention as a torch op and in exported graphs: ``torch.ops.pakv.ort_paged_attention``
(in place) and ``..._functional`` (updated copies), exported by the dynamo and the TorchScript exporters
to one ``com.microsoft::PagedAttention`` node that the plugin runs like the reference (caches bit-exact,
the output within test_ort_paged_attention.TOLERANCE); the hand-built model and the OpSchema's inference."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from ort_attention_cases import OrtCall, cache_values, random_ort_call, rounded
from ort_attention_reference import reference
from test_ort_paged_attention import TOLERANCE

from pakv_onnx import export, runtime_plugin
from pakv_onnx.export import make_ort_attention_model_for
from pakv_onnx.spec import MS_DOMAIN, ORT_ATTENTION, bitwise_equal

CASES = {
    "rotary-sink": {"dtype": "float32", "rotary": "half", "sink": True},
    "bf16-int8-norm-window": {"dtype": "bfloat16", "cache_dtype": "int8", "quant": "PER_CHANNEL", "norm": True,
                              "window": 3, "rotary": "interleaved", "slots": "skip"},
    "fp16-latent-float8": {"dtype": "float16", "latent": True, "head_size": 24, "v_head_size": 16, "scale": 0.3,
                           "rotary": "half", "rotary_dim": 8, "rotary_offset": 16, "cache_dtype": "float8e4m3fn",
                           "quant": "PER_TENSOR"},
    "packed-softcap-noncausal": {"dtype": "float32", "packed": True, "softcap": 2.0, "causal": 0},
}  # fmt: skip


def arguments(call: OrtCall) -> list[torch.Tensor | None]:
    return [call.inputs[name] for name in ORT_ATTENTION.input_names]


def assert_matches_reference(call: OrtCall, output: torch.Tensor, key_cache: torch.Tensor, value_cache) -> None:
    want = reference(call.numpy_call())
    np.testing.assert_array_equal(cache_values(key_cache), want.key_cache)
    if want.value_cache is not None:
        np.testing.assert_array_equal(cache_values(value_cache), want.value_cache)
    expected = rounded(want.output, call.dtype)
    atol, rtol = TOLERANCE[call.dtype]
    assert np.all(np.abs(output.float().numpy() - expected) <= atol + rtol * np.abs(expected))


@pytest.mark.parametrize("case", CASES)
def test_torch_ops_in_place_and_functional(case: str) -> None:
    call = random_ort_call(50, **CASES[case])
    work = call.clone()
    out = torch.ops.pakv.ort_paged_attention(*arguments(work), **call.attributes)
    assert_matches_reference(call, out, work.inputs["key_cache"], work.inputs["value_cache"])
    copy = call.clone()
    functional = torch.ops.pakv.ort_paged_attention_functional(*arguments(copy), **call.attributes)
    assert bitwise_equal(functional[0], out)
    assert bitwise_equal(functional[1], work.inputs["key_cache"])
    assert bitwise_equal(copy.inputs["key_cache"], call.inputs["key_cache"]), "the functional op wrote its input"


class _Step(torch.nn.Module):
    """A model calling the functional op on its present inputs (the attributes are the call's)."""

    def __init__(self, names: list[str], attributes: dict) -> None:
        super().__init__()
        self.names, self.attributes = names, attributes
        self.latent = attributes.get("kv_cache_layout") == "LATENT"

    def forward(self, *tensors: torch.Tensor):
        given = dict(zip(self.names, tensors))
        results = torch.ops.pakv.ort_paged_attention_functional(
            *(given.get(n) for n in ORT_ATTENTION.input_names), **self.attributes
        )
        return results[:2] if self.latent else results  # LATENT's third result is an empty placeholder


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
@pytest.mark.parametrize("case", CASES)
def test_export_to_one_node_that_the_plugin_runs(exporter: str, case: str) -> None:
    call = random_ort_call(51, **CASES[case])
    names = [n for n in ORT_ATTENTION.input_names if call.inputs[n] is not None]
    outputs = ["output", "key_cache_out", "value_cache_out"][: 2 if call.attributes.get("kv_cache_layout") else 3]
    step, args = _Step(names, call.attributes).eval(), tuple(call.inputs[n] for n in names)
    if exporter == "dynamo":
        model = export.export(step, args, fallback=False, dynamic_shapes=None, input_names=names, output_names=outputs)
    else:
        model = export.export_legacy(step, args, fallback=False, input_names=names, output_names=outputs)
    nodes = [n for n in model.graph.node if n.domain == MS_DOMAIN]
    assert len(nodes) == 1 and nodes[0].op_type == "PagedAttention", [n.op_type for n in model.graph.node]
    written = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert written["num_heads"] == call.attributes["num_heads"]
    assert any(o.domain == MS_DOMAIN and o.version == 1 for o in model.opset_import)
    got = runtime_plugin.run(runtime_plugin.make_session(model), {n: call.inputs[n] for n in names})
    assert_matches_reference(call, got["output"], got["key_cache_out"], got.get("value_cache_out"))


def test_hand_built_model_and_schema_inference() -> None:
    call = random_ort_call(52, dtype="bfloat16", rotary="half")
    model = make_ort_attention_model_for(call.inputs, **call.attributes)
    work = call.clone()
    session = runtime_plugin.make_session(model)
    got = runtime_plugin.run(session, work.inputs, out={"key_cache_out": work.inputs["key_cache"],
                                                         "value_cache_out": work.inputs["value_cache"]})  # fmt: skip
    assert_matches_reference(call, got["output"], work.inputs["key_cache"], work.inputs["value_cache"])
    export.register_schema()
    inputs = []
    for value in model.graph.input:  # query with a concrete shape, the others as declared
        shape = [9, 64] if value.name == "query" else None
        inputs.append(onnx.helper.make_tensor_value_info(value.name, value.type.tensor_type.elem_type, shape))
    graph = onnx.helper.make_graph(list(model.graph.node), "g", inputs, [])
    typed = onnx.helper.make_model(graph, opset_imports=model.opset_import)
    inferred = onnx.shape_inference.infer_shapes(typed)
    shapes = {v.name: v.type.tensor_type for v in inferred.graph.value_info}
    assert shapes["output"].elem_type == onnx.TensorProto.BFLOAT16
    assert [d.dim_value for d in shapes["output"].shape.dim] == [9, 64]
    assert shapes["key_cache_out"].elem_type == onnx.TensorProto.BFLOAT16
