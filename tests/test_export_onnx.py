"""ONNX export of the op: graph structure, schema and inference, and running the exported model
three ways (stock ONNX Runtime through the fallback function, ORT with the plugin, the torch
module in eager), all bit-exact against each other and the golden."""

from __future__ import annotations

import importlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnxscript import FLOAT16, INT32, script
from onnxscript import opset20 as op
from conftest import assert_matches_golden
from onnx_graphs import feeds_for_case
from test_export_torch import GatherModule, module_args, sized_case

import pakv_onnx.export as pe
from pakv_onnx import runtime_plugin
from pakv_onnx.cases import random_case
from pakv_onnx.export import PAKV_OPSET
from pakv_onnx.spec import (
    ATTR_CACHE_MODE,
    ATTR_IS_SEQ_LENS_CUMSUM,
    CACHE_DTYPES,
    DOMAIN,
    INPUT_NAMES,
    OP_TYPE,
    OUTPUT_NAMES,
    CacheMode,
    bitwise_equal,
)

FP8 = {torch.float8_e4m3fn, torch.float8_e5m2}
# No standard ONNX indexing op (Gather, GatherND, Slice, ...) takes float8 below opset 26
# (BitCast), so the stock fallback covers every contract dtype except the two float8 ones.
FALLBACK_DTYPES = [d.torch_dtype for d in CACHE_DTYPES if d.torch_dtype not in FP8]


def export_case(case, *, fallback: bool = True) -> onnx.ModelProto:
    """Export a GatherModule for ``case``'s options (the example), with the op's dynamic shapes."""
    module = GatherModule(case.cache_mode, case.is_seq_lens_cumsum).eval()
    args = module_args(case)
    shapes = pe.op_dynamic_shapes(
        is_seq_lens_cumsum=case.is_seq_lens_cumsum, with_seq_offset=case.seq_offset is not None
    )[: len(args)]
    return pe.export(module, args, dynamic_shapes=shapes, fallback=fallback)


def stock_session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def feeds_for(session, case) -> dict[str, torch.Tensor]:
    names = [i.name for i in session.get_inputs()]
    return dict(zip(names, module_args(case)))


def run_session(session, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Every output of ``session`` in graph order, as torch tensors (any dtype, bytes untouched)."""
    outputs = runtime_plugin.run(session, feeds)
    return [outputs[o.name] for o in session.get_outputs()]


def run_stock(model, case) -> list[torch.Tensor]:
    session = stock_session(model)
    return run_session(session, feeds_for(session, case))


def run_plugin(model, case) -> list[torch.Tensor]:
    session = runtime_plugin.make_session(model, backend="native")
    return run_session(session, feeds_for(session, case))


def gather_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]


def attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def dims(value_info) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


# --------------------------------------------------------------------------- #
# Structure, schema, inference
# --------------------------------------------------------------------------- #
def test_exported_model_structure_and_checker():
    case = sized_case(30, dtype=torch.bfloat16, cache_mode=CacheMode.PA_NZ, is_seq_lens_cumsum=False, min_size=2)
    model = export_case(case)
    onnx.checker.check_model(model, full_check=True)
    (node,) = gather_nodes(model)
    assert attrs(node) == {ATTR_CACHE_MODE: b"PA_NZ", ATTR_IS_SEQ_LENS_CUMSUM: 0}
    assert len(node.input) == 5
    assert {(o.domain, o.version) for o in model.opset_import} >= {(DOMAIN, 1), ("", pe.DEFAULT_OPSET)}
    assert pe.has_fallback(model)
    inputs = {v.name: v for v in model.graph.input}
    elem = {name: v.type.tensor_type.elem_type for name, v in inputs.items()}
    assert list(elem.values()) == [onnx.TensorProto.BFLOAT16] * 2 + [onnx.TensorProto.INT32] * 3
    key_cache, value_cache, tables, seq_lens, seq_offset = (inputs[n] for n in node.input)
    assert dims(key_cache)[0] == dims(value_cache)[0] == "num_blocks"
    assert dims(tables) == ["num_seqs", "table_cols"] == [dims(seq_lens)[0], dims(tables)[1]]
    assert dims(seq_offset) == ["num_seqs"]
    key, value = model.graph.output
    assert key.type.tensor_type.elem_type == value.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16
    t_key, t_value = dims(key)[0], dims(value)[0]
    assert isinstance(t_key, str) and t_key and t_key == t_value  # one symbolic T for both outputs
    assert dims(key)[1:] == [2 * 16] and dims(value)[1:] == [3 * 16]  # [T, H*D] for PA_NZ


def test_two_calls_give_two_nodes_and_fallback_false_omits_the_function():
    class TwoCalls(torch.nn.Module):
        def forward(self, kc, vc, bt, sl, so):
            k1, v1 = torch.ops.pakv.gather_pa_kv_cache(kc, vc, bt, sl, so, "Norm", True)
            k2, v2 = torch.ops.pakv.gather_pa_kv_cache(vc, kc, bt, sl, None, "Norm", True)
            return k1, v1, k2, v2

    case = sized_case(31, dtype=torch.float16, min_size=2)
    value_cache = case.key_cache.clone()  # same shape so the caches can swap roles
    args = (case.key_cache, value_cache, *case.inputs()[2:])
    model = pe.export(TwoCalls().eval(), args, dynamic_shapes=pe.op_dynamic_shapes(), fallback=False)
    nodes = gather_nodes(model)
    assert len(nodes) == 2
    assert [len(n.input) for n in nodes] == [5, 4]  # an absent seq_offset stays absent without the fallback
    assert not pe.has_fallback(model) and not model.functions
    assert any(o.domain == DOMAIN for o in model.opset_import)
    onnx.checker.check_model(model, full_check=True)
    # Without the function and without the plugin, stock ORT cannot run the op.
    with pytest.raises(Exception, match=OP_TYPE):
        stock_session(model)


def test_shape_inference_fills_outputs_symbolic_and_constant_t():
    model = pe.make_gather_model(torch.float16, cache_mode=CacheMode.NORM, fallback=False)
    del model.graph.output[:]
    model.graph.output.extend([onnx.helper.make_value_info(name, onnx.TypeProto()) for name in OUTPUT_NAMES])
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    key, value = (next(v for v in inferred.graph.output if v.name == n) for n in OUTPUT_NAMES)
    assert key.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert dims(key) == [dims(key)[0], "Hk", "Dk"] and dims(value) == [dims(key)[0], "Hv", "Dv"]
    assert dims(key)[0].startswith("T_")

    # Two nodes get two different T symbols; a constant seq_lens gives a number.
    node = model.graph.node[0]
    second = pe.gather_node(*node.input[:3], "const_lens", outputs=["k2", "v2"], is_seq_lens_cumsum=False, name="second")
    third = pe.gather_node(*node.input, outputs=["k3", "v3"], name="third")
    model.graph.node.extend([second, third])
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([3, 0, 4], np.int64), "const_lens"))
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    found = {v.name: dims(v) for v in (*inferred.graph.value_info, *inferred.graph.output)}
    assert found["k2"][0] == 7 and found["v2"][0] == 7
    assert found["k3"][0] != found["key"][0] and isinstance(found["k3"][0], str)


def test_schema_registration_is_idempotent():
    from pakv_onnx.export import schema

    first = pe.register_schema()
    importlib.reload(schema)
    second = schema.register_schema()
    assert first.name == second.name == OP_TYPE and second.domain == DOMAIN
    assert [i.name for i in second.inputs] == list(INPUT_NAMES)
    assert onnx.defs.get_schema(OP_TYPE, 1, DOMAIN).has_type_and_shape_inference_function


# --------------------------------------------------------------------------- #
# Running: stock ORT (fallback) vs plugin vs eager
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", FALLBACK_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_three_ways_bit_identical(dtype):
    index = FALLBACK_DTYPES.index(dtype)
    mode = (CacheMode.NORM, CacheMode.PA_NZ)[index % 2]
    is_cumsum = (index // 2) % 2 == 0
    with_offset = index % 3 != 2
    index_dtypes = ((torch.int32, torch.int64, torch.int32), (torch.int64, torch.int32, torch.int64))[index % 2]
    cases = [
        sized_case(
            100 + 10 * index + k,
            dtype=dtype,
            cache_mode=mode,
            is_seq_lens_cumsum=is_cumsum,
            with_seq_offset=with_offset,
            index_dtypes=index_dtypes,
            min_size=2 if k == 0 else 1,
        )
        for k in range(3)
    ]
    model = export_case(cases[0])
    module = GatherModule(mode, is_cumsum)
    for case in cases:
        eager = module(*module_args(case))
        assert_matches_golden(eager, case)
        stock = run_stock(model, case)
        plugin = run_plugin(model, case)
        for name, e, s, p in zip(OUTPUT_NAMES, eager, stock, plugin):
            assert bitwise_equal(s, e), f"stock ORT {name} differs from eager for {case.summary()}"
            assert bitwise_equal(p, e), f"plugin {name} differs from eager for {case.summary()}"


@pytest.mark.parametrize("dtype", sorted(FP8, key=str), ids=lambda d: str(d).removeprefix("torch."))
def test_fp8_runs_with_the_plugin_which_takes_precedence_over_the_function(dtype):
    case = sized_case(140, dtype=dtype, cache_mode=CacheMode.PA_NZ, min_size=2)
    model = export_case(case)
    assert pe.has_fallback(model)
    with pytest.raises(Exception, match="float8"):  # the function cannot gather float8 ...
        stock_session(model)
    outputs = run_plugin(model, case)  # ... so the plugin's kernel, not the function, ran here
    assert_matches_golden(outputs, case)


def test_one_model_runs_at_several_q_t_and_num_blocks():
    example = sized_case(200, cache_mode=CacheMode.NORM, is_seq_lens_cumsum=True, min_size=2)
    model = export_case(example)
    sizes = set()
    for seed in range(201, 209):
        case = sized_case(seed, cache_mode=CacheMode.NORM, is_seq_lens_cumsum=True)
        sizes.add((case.block_tables.shape[0], int(case.seq_lens[-1]), case.key_cache.shape[0]))
        assert_matches_golden(run_stock(model, case), case)
    assert len({s[0] for s in sizes}) > 2 and len({s[1] for s in sizes}) > 2 and len({s[2] for s in sizes}) > 2


def test_random_contract_cases_on_hand_built_models():
    """random_case draws every option (incl. block size 1, empty sequences, junk table entries)."""
    for seed in range(300, 316):
        dtype = FALLBACK_DTYPES[seed % len(FALLBACK_DTYPES)]
        case = random_case(seed, dtype=dtype)
        model = pe.make_gather_model_for(*case.inputs(), **case.attributes())
        onnx.checker.check_model(model, full_check=True)
        session = stock_session(model)
        assert_matches_golden(run_session(session, feeds_for_case(case)), case)


def test_fallback_raises_on_out_of_range_block_ids():
    case = sized_case(400, dtype=torch.float32, min_size=2)
    model = export_case(case)
    q = int(torch.nonzero(case.seq_lens[1:] > case.seq_lens[:-1])[0, 0])  # a sequence with tokens
    for bad in (case.key_cache.shape[0], -1):
        tables = case.block_tables.clone()
        tables[q, int(case.seq_offset[q]) // 4] = bad
        session = stock_session(model)
        feeds = feeds_for(session, case)
        feeds[session.get_inputs()[2].name] = tables
        with pytest.raises(Exception, match=r"pakv check: block_tables entry used by a sequence is outside \[0, num_blocks\)"):
            run_session(session, feeds)


# --------------------------------------------------------------------------- #
# Legacy exporter
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("with_offset", [True, False])
def test_legacy_export_runs(with_offset):
    case = sized_case(
        500,
        dtype=torch.float16,
        cache_mode=CacheMode.PA_NZ,
        is_seq_lens_cumsum=False,
        with_seq_offset=with_offset,
        min_size=2,
    )
    module = GatherModule(case.cache_mode, case.is_seq_lens_cumsum)
    names = list(INPUT_NAMES[: 5 if with_offset else 4])
    # Dynamic axes per contract input (names from spec, in INPUT_NAMES order).
    axes = dict(zip(INPUT_NAMES, ({0: "num_blocks"}, {0: "num_blocks"}, {0: "num_seqs", 1: "table_cols"}, {0: "num_seqs"}, {0: "num_seqs"})))
    model = pe.export_legacy(
        module,
        module_args(case),
        input_names=names,
        output_names=list(OUTPUT_NAMES),
        dynamic_axes={n: axes[n] for n in names},
    )
    onnx.checker.check_model(model, full_check=True)
    (node,) = gather_nodes(model)
    assert attrs(node) == {ATTR_CACHE_MODE: b"PA_NZ", ATTR_IS_SEQ_LENS_CUMSUM: 0}
    for seed in (501, 502):
        other = sized_case(
            seed, dtype=torch.float16, cache_mode=CacheMode.PA_NZ, is_seq_lens_cumsum=False, with_seq_offset=with_offset
        )
        for outputs in (run_stock(model, other), run_plugin(model, other)):
            assert_matches_golden(outputs, other)


# --------------------------------------------------------------------------- #
# Defaults and hand-built graphs
# --------------------------------------------------------------------------- #
def test_default_export_is_dynamic_and_ties_the_contract_dims():
    case = sized_case(600, dtype=torch.int16, min_size=2)
    model = pe.export(GatherModule(case.cache_mode, case.is_seq_lens_cumsum).eval(), case.inputs())
    inputs = {v.name: dims(v) for v in model.graph.input}
    key_cache, value_cache, tables, seq_lens, seq_offset = inputs.values()
    assert all(isinstance(d, str) for d in (*key_cache, *tables))
    assert key_cache[0] == value_cache[0] and key_cache[1] == value_cache[1]  # num_blocks, block_size tied
    assert seq_offset == [tables[0]] and seq_lens[0] == f"{tables[0]} + 1"
    for seed in (601, 602, 603):
        other = sized_case(seed, dtype=torch.int16)
        assert_matches_golden(run_stock(model, other), other)


# onnxscript resolves names from the module's globals: the script and its types live at module level.
KEY_CACHE = FLOAT16["nb", "bs", "hk", "dk"]
VALUE_CACHE = FLOAT16["nb", "bs", "hv", "dv"]
TABLES = INT32["nseq", "cols"]
SEQ_LENS = INT32["nseq_plus_1"]
KEY = FLOAT16["T", "hk", "dk"]
VALUE = FLOAT16["T", "hv", "dv"]


@script(default_opset=op)
def onnxscript_gather(
    key_cache: KEY_CACHE, value_cache: VALUE_CACHE, block_tables: TABLES, seq_lens: SEQ_LENS
) -> tuple[KEY, VALUE]:
    key, value = PAKV_OPSET.GatherPaKvCache(
        key_cache, value_cache, block_tables, seq_lens, cache_mode="Norm", is_seq_lens_cumsum=1
    )
    return op.Identity(key), op.Identity(value)


def test_onnxscript_graph_with_the_op_runs_on_stock_ort():
    model = pe.attach_fallback(onnxscript_gather.to_model_proto())
    onnx.checker.check_model(model, full_check=True)
    case = sized_case(700, dtype=torch.float16, with_seq_offset=False)
    assert_matches_golden(run_stock(model, case), case)
    assert_matches_golden(run_plugin(model, case), case)


# --------------------------------------------------------------------------- #
# Mixed key/value dtypes through the exporter
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "key_dtype, value_dtype, mode",
    [
        (torch.float8_e4m3fn, torch.bfloat16, CacheMode.NORM),
        (torch.float8_e5m2, torch.float16, CacheMode.PA_NZ),
        (torch.int8, torch.bfloat16, CacheMode.PA_NZ),
        (torch.float32, torch.int16, CacheMode.NORM),
        (torch.bfloat16, torch.int8, CacheMode.NORM),
    ],
    ids=lambda v: str(v).removeprefix("torch.").removeprefix("CacheMode."),
)
def test_mixed_dtypes_export_round_trip(key_dtype, value_dtype, mode):
    from conftest import unaligned_offsets, with_value_dtype

    def mixed(seed: int, min_size: int = 1):
        case = with_value_dtype(sized_case(seed, dtype=key_dtype, cache_mode=mode, min_size=min_size), value_dtype, seed)
        return unaligned_offsets(case, seed)

    example = mixed(800, min_size=2)
    model = export_case(example)
    onnx.checker.check_model(model, full_check=True)
    key_out, value_out = model.graph.output
    elem = {d.torch_dtype: d.onnx_type for d in CACHE_DTYPES}
    assert (key_out.type.tensor_type.elem_type, value_out.type.tensor_type.elem_type) == (elem[key_dtype], elem[value_dtype])
    # Runs: eager op and stock ORT through the fallback (no standard gather takes float8, so
    # float8 keys only check the exported types here). The plugin's mixed-dtype kernels are the
    # runtime_plugin's side (their type constraints), tested there.
    module = GatherModule(mode, True)
    for case in (example, mixed(801), mixed(802)):
        assert_matches_golden(module(*module_args(case)), case, "eager")
        if key_dtype not in FP8:
            assert_matches_golden(run_stock(model, case), case, "stock fallback")
