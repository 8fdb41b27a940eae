"""The stock-ONNX fallback function (pakv_onnx.export.fallback) on stock ONNX Runtime, no plugin.

Valid input: bit-exact against the per-token reference over random non-aligned offsets, both
layouts, both seq_lens forms, mixed key/value dtypes. Invalid input: one test per rule of
the validator that standard ops can express; stock ORT must raise (never return rows), and
spec (so the plugin) rejects the same input.
"""

from __future__ import annotations

import itertools

import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import assert_pair_equal, reference_outputs, unaligned_offsets, with_value_dtype
from onnx_graphs import feeds_for_case

import pakv_onnx.export as pe
from pakv_onnx import runtime_plugin
from pakv_onnx.cases import GatherCase, random_case
from pakv_onnx.export import fallback
from pakv_onnx.spec import INPUT_NAMES, INT64_MAX, CacheMode
from pakv_onnx.validator import plan_gather

FORMS = list(itertools.product(list(CacheMode), (True, False)))
FORM_IDS = [f"{m.value}-{'cumsum' if c else 'lengths'}" for m, c in FORMS]
# No standard ONNX gather takes float8 below opset 26; the fallback covers every other dtype.
FALLBACK_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8, torch.int16, torch.int32]


def stock_session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def model_for(case: GatherCase, *, ranked: bool = True, **overrides) -> onnx.ModelProto:
    """A one-node model with the fallback for ``case``'s dtypes and attributes (``overrides``: any
    option of :func:`pakv_onnx.export.make_gather_model`).

    ``ranked=False`` declares no input shapes, so inputs of any rank reach the function.
    """
    options = {**case.attributes(), "shapes": "symbolic" if ranked else None, **overrides}
    return pe.make_gather_model_for(*case.inputs(), **options)


def run_stock(case: GatherCase, model: onnx.ModelProto | None = None) -> list[torch.Tensor]:
    session = stock_session(model if model is not None else model_for(case))
    feeds = feeds_for_case(case)
    outputs = runtime_plugin.run(session, feeds)
    return [outputs[o.name] for o in session.get_outputs()]


# --------------------------------------------------------------------------- #
# Valid input: bit-exact
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("mode, is_cumsum", FORMS, ids=FORM_IDS)
def test_unaligned_offsets_match_per_token_reference(mode: CacheMode, is_cumsum: bool) -> None:
    for seed in range(10):
        dtype = FALLBACK_DTYPES[seed % len(FALLBACK_DTYPES)]
        base = random_case(3000 + seed, dtype=dtype, cache_mode=mode, is_seq_lens_cumsum=is_cumsum)
        case = unaligned_offsets(base, seed)
        assert_pair_equal(run_stock(case), reference_outputs(case), f"stock fallback, {case.summary()}")


@pytest.mark.parametrize("key_dtype, value_dtype", [(torch.bfloat16, torch.int8), (torch.float32, torch.float16)])
@pytest.mark.parametrize("mode", list(CacheMode), ids=[m.value for m in CacheMode])
def test_mixed_dtypes_match_per_token_reference(key_dtype, value_dtype, mode: CacheMode) -> None:
    for seed in range(4):
        case = with_value_dtype(random_case(3100 + seed, dtype=key_dtype, cache_mode=mode), value_dtype, seed)
        got = run_stock(case)
        assert (got[0].dtype, got[1].dtype) == (key_dtype, value_dtype)
        assert_pair_equal(got, reference_outputs(case), f"stock fallback, {case.summary()}")


def test_unranked_model_runs_valid_input() -> None:
    """The rank checks do not reject valid input when the graph declares no shapes."""
    case = unaligned_offsets(random_case(3200, dtype=torch.float32), 1)
    assert_pair_equal(run_stock(case, model_for(case, ranked=False)), reference_outputs(case), "unranked")


def test_empty_sequence_at_the_end_of_its_row_fits() -> None:
    """An empty sequence may start at column == cols (spec agrees); one column further is refused."""
    case = base_case(seq_lens=[0, 5, 5, 8], seq_offset=[0, 12, 1], tables=[[0, 5, 9], [3, 4, 1], [3, 1, 1]])
    plan_gather(*case.inputs(), **case.attributes())
    assert_pair_equal(run_stock(case), reference_outputs(case), "empty sequence")
    expect_rejected(base_case(seq_lens=[0, 5, 5, 8], seq_offset=[0, 16, 1], tables=[[0, 5, 9], [3, 4, 1], [3, 1, 1]]), INPUTS_RULE)


# --------------------------------------------------------------------------- #
# Invalid input: one test per rule
# --------------------------------------------------------------------------- #
def base_case(
    *,
    seq_lens=(0, 5, 8),
    seq_offset=(0, 0),
    tables=((0, 5, 9), (3, -1, -1)),
    key_shape=(6, 4, 2, 8),
    value_shape=(6, 4, 1, 4),
    cache_mode=CacheMode.NORM,
    is_cumsum=True,
    dtype=torch.float32,
) -> GatherCase:
    """spec's test baseline (bs=4, nb=6, Q=2, lengths [5, 3]) with pieces replaced."""
    gen = torch.Generator().manual_seed(0)
    return GatherCase(
        case_id="rule",
        description="rule",
        key_cache=torch.randn(key_shape, generator=gen).to(dtype),
        value_cache=torch.randn(value_shape, generator=gen).to(dtype),
        block_tables=torch.tensor(tables, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        seq_offset=None if seq_offset is None else torch.tensor(seq_offset, dtype=torch.int32),
        cache_mode=cache_mode,
        is_seq_lens_cumsum=is_cumsum,
    )


def expect_rejected(case: GatherCase, stock_pattern: str, *, model: onnx.ModelProto | None = None) -> None:
    """spec (and so the plugin) rejects ``case``, and stock ORT on the fallback raises too."""
    with pytest.raises((ValueError, TypeError)):
        plan_gather(*case.inputs(), **case.attributes())
    with pytest.raises(Exception, match=stock_pattern):
        run_stock(case, model)


CHECK = "pakv check: "
INPUTS_RULE = r"pakv check: the inputs break the contract"


def test_valid_baseline_runs() -> None:
    case = base_case()
    assert_pair_equal(run_stock(case), reference_outputs(case), "baseline")


def test_cumsum_not_starting_at_zero() -> None:
    expect_rejected(base_case(seq_lens=(1, 5, 8)), INPUTS_RULE)


def test_cumsum_decreasing() -> None:
    expect_rejected(base_case(seq_lens=(0, 5, 4)), INPUTS_RULE)


def test_cumsum_decrease_hidden_by_wraparound() -> None:
    expect_rejected(base_case(seq_lens=(0, INT64_MAX, -INT64_MAX)), INPUTS_RULE)


@pytest.mark.parametrize("is_cumsum, seq_lens", [(True, (0, 5)), (True, (0, 5, 8, 9)), (False, (5, 3, 1)), (False, (5,))])
def test_seq_lens_entry_count_for_the_mode(is_cumsum: bool, seq_lens: tuple) -> None:
    expect_rejected(base_case(seq_lens=seq_lens, is_cumsum=is_cumsum), r"Split")


def test_negative_length() -> None:
    expect_rejected(base_case(seq_lens=(5, -3), is_cumsum=False), INPUTS_RULE)


def test_total_length_overflows_int64() -> None:
    case = base_case(seq_lens=(INT64_MAX, 1), is_cumsum=False)
    expect_rejected(case, INPUTS_RULE)


def test_negative_seq_offset() -> None:
    expect_rejected(base_case(seq_offset=(0, -4)), INPUTS_RULE)


@pytest.mark.parametrize("seq_offset", [(0, 0, 0), (0,)])
def test_seq_offset_entry_count(seq_offset: tuple) -> None:
    expect_rejected(base_case(seq_offset=seq_offset), r"Split")


@pytest.mark.parametrize(
    "tables, seq_offset",
    [(((0,), (3,)), (0, 0)), (((0, 5, 9), (3, 1, 1)), (8, 0)), (((0, 5, 9), (3, 1, 1)), (0, 13))],
    ids=["no-offset", "after-offset", "floored-offset"],
)
def test_block_table_row_too_short(tables, seq_offset) -> None:
    """A too-short row would otherwise read the next row's ids (valid indices, wrong rows)."""
    expect_rejected(base_case(tables=tables, seq_offset=seq_offset), INPUTS_RULE)


@pytest.mark.parametrize("bad_id", [6, 1000, -1, -6, -(2**40), -(2**62)])
@pytest.mark.parametrize("mode", list(CacheMode), ids=[m.value for m in CacheMode])
def test_used_block_id_out_of_range(bad_id: int, mode: CacheMode) -> None:
    shapes = {"key_shape": (6, 4, 2, 8), "value_shape": (6, 4, 1, 4)}
    if mode is CacheMode.PA_NZ:
        shapes = {"key_shape": (6, 2, 4, 8), "value_shape": (6, 1, 4, 8)}
    tables = ((0, bad_id, 9), (3, -1, -1))
    case = base_case(tables=tables, cache_mode=mode, **shapes)
    expect_rejected(case, r"pakv check: block_tables entry used by a sequence is outside \[0, num_blocks\)")


@pytest.mark.parametrize(
    "value_shape", [(7, 4, 1, 4), (6, 8, 1, 4), (6, 2, 1, 4)], ids=["num_blocks", "block_size-larger", "block_size-smaller"]
)
def test_value_cache_geometry_differs(value_shape) -> None:
    expect_rejected(base_case(value_shape=value_shape), INPUTS_RULE)


def test_zero_block_size() -> None:
    case = base_case(key_shape=(6, 0, 2, 8), value_shape=(6, 0, 1, 4), seq_lens=(0, 0, 0))
    expect_rejected(case, INPUTS_RULE)


@pytest.mark.parametrize(
    ("attribute", "pattern"),
    [
        ({"cache_mode": "NZ"}, r"cache_mode must be 'Norm' or 'PA_NZ'|stoll"),
        ({"is_seq_lens_cumsum": 2}, r"is_seq_lens_cumsum must be 0 or 1|stoll|Split"),
    ],
    ids=["unknown-cache-mode", "cumsum-flag-outside-0-1"],
)
def test_attribute_values_outside_the_contract(attribute: dict, pattern: str) -> None:
    case = base_case()
    model = model_for(case, strict=False, **attribute)
    with pytest.raises(Exception, match=pattern):
        run_stock(case, model)


@pytest.mark.parametrize(
    "name, value, pattern",
    [
        ("key_cache", torch.zeros(6, 4, 16), r"key_cache must have rank 4"),
        ("value_cache", torch.zeros(6, 4, 1, 4, 1), r"value_cache must have rank 4"),
        ("block_tables", torch.zeros(6, dtype=torch.int64), r"block_tables must have rank 2"),
        # A rank-2 seq_lens / seq_offset fails the first Concat that mixes it with rank-1 values.
        ("seq_lens", torch.tensor([[0], [5], [8]]), r"Ranks of input data are different"),
        ("seq_offset", torch.zeros(2, 1, dtype=torch.int32), r"Ranks of input data are different"),
        ("seq_offset", torch.tensor(0, dtype=torch.int32), r"Split|rank"),
    ],
)
def test_wrong_rank_with_undeclared_shapes(name: str, value: torch.Tensor, pattern: str) -> None:
    import dataclasses

    case = base_case()
    model = model_for(case, ranked=False)
    bad = dataclasses.replace(case, **{name: value})
    expect_rejected(bad, pattern, model=model)


def _node_names(nodes) -> set[str]:
    names = set()
    for node in nodes:
        names.add(node.name)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                names |= _node_names(attr.g.node)
    return names


def test_every_check_node_is_named_after_its_rule() -> None:
    names = _node_names(fallback.make_function(pe.DEFAULT_OPSET).node)
    missing = [rule for rule in fallback.CHECKS.values() if CHECK + rule not in names]
    assert not missing, f"checks without their node: {missing}"
    assert fallback.UNCHECKED_RULES  # the rules it cannot express are written down


def test_the_fallback_reads_like_the_contract() -> None:
    """Signature from spec: domain, name, inputs, outputs and attribute defaults."""
    function = fallback.make_function(pe.DEFAULT_OPSET)
    assert (function.domain, function.name) == ("pakv", "GatherPaKvCache")
    assert list(function.input) == list(INPUT_NAMES) and list(function.output) == ["key", "value"]
    assert {a.name for a in function.attribute_proto} == {"cache_mode", "is_seq_lens_cumsum"}


@pytest.mark.parametrize("opset", [19, 21, 23])
def test_every_default_opset_from_19(opset: int) -> None:
    case = unaligned_offsets(random_case(3300 + opset, dtype=torch.float16), opset)
    model = model_for(case, opset_version=opset)
    onnx.checker.check_model(model, full_check=True)
    assert_pair_equal(run_stock(case, model), reference_outputs(case), f"opset {opset}")


@pytest.mark.parametrize("mode, is_cumsum", FORMS, ids=FORM_IDS)
def test_unoptimized_session_runs_the_ifs_and_checks(mode: CacheMode, is_cumsum: bool) -> None:
    """With ORT's graph optimizations off the Ifs on the attributes run as subgraphs: same rows, same errors."""
    base = random_case(3400, dtype=torch.int16, cache_mode=mode, is_seq_lens_cumsum=is_cumsum, with_seq_offset=True)
    case = unaligned_offsets(base, 3)
    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model_for(case).SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = feeds_for_case(case)
    outputs = runtime_plugin.run(session, feeds)
    assert_pair_equal([outputs["key"], outputs["value"]], reference_outputs(case), "unoptimized")
    bad = dict(feeds, seq_offset=-feeds["seq_offset"] - 1)
    with pytest.raises(Exception, match=INPUTS_RULE):
        runtime_plugin.run(session, bad)


# Nodes left after ORT inlines the function and folds the attribute branches (onnxruntime 1.32).
# ORT spends a roughly fixed time per node, so this count is the fallback's cost at small T
# (benchmarks/bench_fallback.py times it); a change that adds nodes must say why here.
NODE_BUDGET = {("Norm", True): 39, ("Norm", False): 42, ("PA_NZ", True): 56, ("PA_NZ", False): 59}


@pytest.mark.parametrize("mode, is_cumsum", FORMS, ids=FORM_IDS)
def test_node_count_after_ort_folding_within_budget(mode: CacheMode, is_cumsum: bool, tmp_path) -> None:
    model = pe.make_gather_model(torch.float16, cache_mode=mode, is_seq_lens_cumsum=is_cumsum)
    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    nodes = onnx.load(options.optimized_model_filepath).graph.node
    assert not any(n.op_type == "If" for n in nodes), "an If on an attribute was not folded"
    budget = NODE_BUDGET[(mode.value, is_cumsum)]
    ops = [n.op_type for n in nodes]
    assert len(nodes) <= budget, f"{len(nodes)} nodes after ORT's folding, budget {budget}: {ops}"
