"""The one-node model builder (pakv_onnx.export.builder): every graph from spec's one declaration,
its options (mixed dtypes, absent seq_offset, symbolic / concrete / no shapes, opset, strict=False
for graphs the runtime must refuse), its errors, and that it needs no onnxscript."""

from __future__ import annotations

import onnx
import pytest
import torch
from conftest import run_python
from onnx_graphs import feeds_for_case
from onnx import TensorProto

import pakv_onnx.export as pe
from pakv_onnx import runtime_plugin
from pakv_onnx.cases import random_case
from pakv_onnx.spec import (
    ATTR_CACHE_MODE,
    ATTR_IS_SEQ_LENS_CUMSUM,
    ATTRIBUTE_DEFAULTS,
    DOMAIN,
    INPUT_NAMES,
    OP_TYPE,
    OPTIONAL_INPUTS,
    OUTPUT_NAMES,
    CacheMode,
    bitwise_equal,
)


def dims(value_info: onnx.ValueInfoProto) -> list | None:
    """Declared dims (names or numbers); None when the value has no shape (unranked)."""
    tensor = value_info.type.tensor_type
    if not tensor.HasField("shape"):
        return None
    return [d.dim_param or d.dim_value for d in tensor.shape.dim]


def attributes(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def test_the_node_follows_the_declaration_in_spec() -> None:
    model = pe.make_gather_model(torch.bfloat16, fallback=False)
    onnx.checker.check_model(model, full_check=True)
    (node,) = model.graph.node
    assert (node.domain, node.op_type) == (DOMAIN, OP_TYPE)
    assert list(node.input) == [i.name for i in model.graph.input] == list(INPUT_NAMES)
    assert list(node.output) == [o.name for o in model.graph.output] == list(OUTPUT_NAMES)
    defaults = {k: v.encode() if isinstance(v, str) else int(v) for k, v in ATTRIBUTE_DEFAULTS.items()}
    assert attributes(node) == defaults
    without = pe.make_gather_model(torch.bfloat16, with_seq_offset=False, fallback=False)
    assert list(without.graph.node[0].input) == [n for n in INPUT_NAMES if n not in OPTIONAL_INPUTS]


def test_mixed_dtypes_give_each_output_its_cache_type_and_pa_nz_its_own_e() -> None:
    model = pe.make_gather_model(
        torch.float8_e4m3fn,
        value_dtype=torch.bfloat16,
        cache_mode=CacheMode.PA_NZ,
        index_dtypes=(torch.int64, torch.int32, torch.int64),
        fallback=False,
    )
    onnx.checker.check_model(model, full_check=True)
    types = {v.name: v.type.tensor_type.elem_type for v in (*model.graph.input, *model.graph.output)}
    assert types == {
        "key_cache": TensorProto.FLOAT8E4M3FN,
        "value_cache": TensorProto.BFLOAT16,
        "block_tables": TensorProto.INT64,
        "seq_lens": TensorProto.INT32,
        "seq_offset": TensorProto.INT64,
        "key": TensorProto.FLOAT8E4M3FN,
        "value": TensorProto.BFLOAT16,
    }
    key_cache, value_cache = model.graph.input[:2]
    assert dims(key_cache)[3] != dims(value_cache)[3]  # E = 32 bytes / itemsize: 32 vs 16 here
    key, value = model.graph.output
    assert dims(key)[0] == dims(value)[0] and str(dims(key)[0]).startswith("T_")


def test_shapes_symbolic_concrete_or_none() -> None:
    case = random_case(7, dtype=torch.float16, cache_mode=CacheMode.NORM, with_seq_offset=True)
    symbolic = pe.make_gather_model_for(*case.inputs(), **case.attributes(), fallback=False)
    assert all(isinstance(d, str) for v in symbolic.graph.input for d in dims(v))

    concrete = pe.make_gather_model_for(*case.inputs(), **case.attributes(), shapes="concrete", fallback=False)
    assert [dims(v) for v in concrete.graph.input] == [list(t.shape) for t in case.inputs()]
    heads, head_dim = case.key_cache.shape[2:]
    assert dims(concrete.graph.output[0])[1:] == [heads, head_dim]  # inferred from the concrete cache

    unranked = pe.make_gather_model_for(*case.inputs(), **case.attributes(), shapes=None, fallback=False)
    assert all(dims(v) is None for v in (*unranked.graph.input, *unranked.graph.output))

    for model in (symbolic, concrete, unranked):
        out = runtime_plugin.run(runtime_plugin.make_session(model), feeds_for_case(case))
        assert bitwise_equal(out["key"], case.golden()[0]) and bitwise_equal(out["value"], case.golden()[1])


def test_opset_choice_and_the_fallback_option() -> None:
    model = pe.make_gather_model(torch.float32, opset_version=17, fallback=False)
    assert {(o.domain, o.version) for o in model.opset_import} == {("", 17), (DOMAIN, 1)}
    assert not pe.has_fallback(model)
    assert pe.has_fallback(pe.make_gather_model(torch.float32))
    assert {(o.domain, o.version) for o in pe.make_gather_model(torch.float32).opset_import} >= {("", pe.DEFAULT_OPSET)}


def _model(**options):
    """A thunk building an int8 model with ``options`` (for the error table below)."""
    return lambda: pe.make_gather_model(torch.int8, **options)


@pytest.mark.parametrize(
    ("call", "error", "pattern"),
    [
        (lambda: pe.make_gather_model(torch.float64), ValueError, r"key_cache: no cache dtype of the contract is called torch.float64"),
        (_model(value_dtype=torch.bool), ValueError, r"value_cache: no cache dtype of the contract is called torch.bool"),
        (_model(index_dtypes=(torch.int16,) * 3), ValueError, r"block_tables: torch.int16 is no index dtype of the contract"),
        (_model(index_dtypes=(torch.int32,) * 2), ValueError, r"gives no dtype for \['seq_offset'\]"),
        (_model(cache_mode="NZ"), ValueError, r"cache_mode must be 'Norm' or 'PA_NZ', got 'NZ'"),
        (_model(cache_mode=3), TypeError, r"cache_mode must be a string, got int"),  # as the op says it
        (_model(is_seq_lens_cumsum=2), ValueError, r"is_seq_lens_cumsum must be 0/1 or a bool, got 2"),
        (_model(shapes={"keys": [1]}), ValueError, r"unknown inputs \['keys'\]"),
        (_model(shapes="static"), ValueError, r"shapes must be 'symbolic', None"),
        (lambda: pe.gather_node("k", "", "b", "s"), ValueError, r"required input\(s\) \['value_cache'\]"),
        (lambda: pe.gather_node("k", "v", "b", "s", outputs=["key"]), ValueError, r"outputs must name 2 values"),
        (
            lambda: pe.make_gather_model(torch.complex32, strict=False, fallback=False),
            TypeError,
            r"key_cache: torch dtype torch.complex32 has no ONNX element type",
        ),
    ],
)
def test_bad_options_are_typed_errors_naming_the_input(call, error, pattern) -> None:
    with pytest.raises(error, match=pattern):
        call()


def test_strict_false_writes_what_it_is_given() -> None:
    """Graphs the runtime must refuse: dtypes outside the contract, attributes of any type, none at all."""
    model = pe.make_gather_model(
        torch.float64, value_dtype=torch.bool, cache_mode=1, is_seq_lens_cumsum=[1.0], strict=False, fallback=False
    )
    types = {v.name: v.type.tensor_type.elem_type for v in (*model.graph.input, *model.graph.output)}
    assert types["key_cache"] == types["key"] == TensorProto.DOUBLE
    assert types["value_cache"] == types["value"] == TensorProto.BOOL
    (node,) = model.graph.node
    by_name = {a.name: a for a in node.attribute}
    assert by_name[ATTR_CACHE_MODE].type == onnx.AttributeProto.INT
    assert by_name[ATTR_IS_SEQ_LENS_CUMSUM].type == onnx.AttributeProto.FLOATS
    bare = pe.make_gather_model(torch.int8, cache_mode=None, is_seq_lens_cumsum=None, strict=False, fallback=False)
    assert not bare.graph.node[0].attribute
    node = pe.gather_node("k", "", "b", "s", strict=False)
    assert list(node.input) == ["k", "", "b", "s"]  # an empty required input is kept (and refused later)


def test_hand_built_graphs_need_no_onnxscript() -> None:
    """The builder and the torch op import and run with onnxscript absent (the old-onnxruntime CI
    venv has none); the exporter names then fail on use, with onnxscript's ImportError."""
    result = run_python(
        """
        import sys
        sys.modules["onnxscript"] = None  # importing onnxscript now fails
        import torch
        import pakv_onnx.export as pe
        from pakv_onnx import runtime_plugin
        from pakv_onnx.cases import random_case
        from pakv_onnx.spec import INPUT_NAMES, bitwise_equal

        case = random_case(3, dtype=torch.bfloat16)
        model = pe.make_gather_model_for(*case.inputs(), **case.attributes(), fallback=False)
        out = runtime_plugin.run(runtime_plugin.make_session(model), dict(zip(INPUT_NAMES, case.inputs())))
        assert bitwise_equal(out["key"], case.golden()[0]) and bitwise_equal(out["value"], case.golden()[1])
        assert torch.ops.pakv.gather_pa_kv_cache is not None
        try:
            pe.export
        except ImportError as err:
            print("export needs onnxscript:", "onnxscript" in str(err))
        """,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "export needs onnxscript: True" in result.stdout
