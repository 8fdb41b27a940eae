"""The export's graph-level fusions (pakv_onnx.models.hf.fusion) on small graphs written the way the
exporter writes a transformers decoder: each fusion fires on its pattern and gives what the
decomposed graph gave in ONNX Runtime, leaves a near miss alone, and never touches a subgraph,
a pakv node or a model-local function. The exported models' counts are in test_hf_generate.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pakv_onnx import cli
from pakv_onnx.models.hf import build_model, genai
from pakv_onnx.models.hf.fusion import MS_DOMAIN, fuse_step, op_counts

D, HEADS, HALF = 8, 2, 4
INT64_MAX = np.iinfo(np.int64).max
RNG = np.random.default_rng(0)


def const(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def model_of(nodes, inputs, outputs, initializers, functions=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializers)
    opsets = [helper.make_opsetid("", 20), helper.make_opsetid("pakv", 1)]
    model = helper.make_model(graph, opset_imports=opsets, functions=list(functions))
    return onnx.shape_inference.infer_shapes(model)  # the exporter records every value's shape too


def value(name: str, dtype, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def rms_norm_nodes(x: str, out: str, exponent: float = 2.0) -> list[onnx.NodeProto]:
    """transformers' RMS norm as the exporter writes it: x * rsqrt(mean(x^2) + eps) * weight."""
    return [
        helper.make_node("Pow", [x, f"{out}_two"], [f"{out}_sq"]),
        helper.make_node("ReduceMean", [f"{out}_sq", "last_axis"], [f"{out}_ms"], keepdims=1),
        helper.make_node("Add", [f"{out}_ms", "eps"], [f"{out}_mse"]),
        helper.make_node("Sqrt", [f"{out}_mse"], [f"{out}_rms"]),
        helper.make_node("Reciprocal", [f"{out}_rms"], [f"{out}_inv"]),
        helper.make_node("Mul", [x, f"{out}_inv"], [f"{out}_n"]),
        helper.make_node("Mul", ["gamma", f"{out}_n"], [out]),
    ], [const(f"{out}_two", np.float32(exponent))]


def norm_constants() -> list[onnx.TensorProto]:
    """The RMS norm's initializers: the reduced axis, epsilon and a random weight of D."""
    return [const("last_axis", np.array([-1])), const("eps", np.float32(1e-6)), const("gamma", RNG.random(D, np.float32))]


def skip_norm_model(exponent: float = 2.0) -> onnx.ModelProto:
    """residual = a + b; out = rms_norm(residual); residual is an output too (the next layer's skip)."""
    norm, extra = rms_norm_nodes("residual", "out", exponent)
    inits, shape = norm_constants(), [1, "S", D]
    return model_of(
        [helper.make_node("Add", ["a", "b"], ["residual"]), *norm],
        [value("a", TensorProto.FLOAT, shape), value("b", TensorProto.FLOAT, shape)],
        [value("out", TensorProto.FLOAT, shape), value("residual", TensorProto.FLOAT, shape)],
        inits + extra,
    )


def rotary_nodes(x: str, out: str, half: int = HALF) -> list[onnx.NodeProto]:
    """x * cos + rotate_half(x) * sin over x [1, H, S, D] (the halves split at ``half``)."""
    return [
        helper.make_node("Mul", [x, "cos4"], [f"{out}_xc"]),
        helper.make_node("Slice", [x, "zero", f"split_{half}", "axis3", "one"], [f"{out}_x1"]),
        helper.make_node("Slice", [x, f"split_{half}", "end", "axis3", "one"], [f"{out}_x2"]),
        helper.make_node("Neg", [f"{out}_x2"], [f"{out}_nx2"]),
        helper.make_node("Concat", [f"{out}_nx2", f"{out}_x1"], [f"{out}_rot"], axis=-1),
        helper.make_node("Mul", [f"{out}_rot", "sin4"], [f"{out}_rs"]),
        helper.make_node("Add", [f"{out}_xc", f"{out}_rs"], [out]),
    ]


def angle_nodes(heads_axis: str) -> list[onnx.NodeProto]:
    """cos4 / sin4 of ``positions`` [S] times ``inv_freq``, unsqueezed at the heads (initializer
    ``heads_axis``): the rotary embedding's angles as transformers export them."""
    return [
        helper.make_node("Unsqueeze", ["positions", "axes02"], ["pos3"]),
        helper.make_node("Cast", ["pos3"], ["posf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["posf", "inv_freq"], ["freqs"]),
        helper.make_node("Concat", ["freqs", "freqs"], ["emb"], axis=-1),
        helper.make_node("Cos", ["emb"], ["cos"]),
        helper.make_node("Sin", ["emb"], ["sin"]),
        helper.make_node("Unsqueeze", ["cos", heads_axis], ["cos4"]),
        helper.make_node("Unsqueeze", ["sin", heads_axis], ["sin4"]),
    ]


def rotary_model(half: int = HALF) -> onnx.ModelProto:
    """q and k rotated by one cos/sin of ``positions`` [S] (transformers' rotary embedding, exported)."""
    angles = angle_nodes("axis1")
    inits = [
        const("axes02", np.array([0, 2])), const("axis1", np.array([1])), const("axis3", np.array([3])),
        const("zero", np.array([0])), const(f"split_{half}", np.array([half])), const("end", np.array([INT64_MAX])),
        const("one", np.array([1])), const("inv_freq", (1.0 / 10000 ** (np.arange(HALF) / HALF)).astype(np.float32)),
    ]  # fmt: skip
    shape = [1, HEADS, "S", D]
    return model_of(
        angles + rotary_nodes("q", "q_rot", half) + rotary_nodes("k", "k_rot", half),
        [value("q", TensorProto.FLOAT, shape), value("k", TensorProto.FLOAT, shape),
         value("positions", TensorProto.INT64, ["S"])],
        [value("q_rot", TensorProto.FLOAT, shape), value("k_rot", TensorProto.FLOAT, shape)],
        inits,
    )  # fmt: skip


def norm_model(exponent: float = 2.0) -> onnx.ModelProto:
    """out = rms_norm(x) with no residual Add before it (the first layer's norm)."""
    norm, extra = rms_norm_nodes("x", "out", exponent)
    inits, shape = norm_constants(), [1, "S", D]
    return model_of(
        norm, [value("x", TensorProto.FLOAT, shape)], [value("out", TensorProto.FLOAT, shape)], inits + extra
    )


def token_major_rotary_model(batch: int = 1, out_shape=(-1, HEADS, D)) -> onnx.ModelProto:
    """q and k ``[batch, S, H*D]`` viewed ``[batch, S, H, D]``, rotated with cos/sin unsqueezed at the
    heads, viewed ``out_shape`` (pakv_onnx.models.hf.gqa's attention, exported)."""
    angles = angle_nodes("axis2")
    nodes = list(angles)
    for name in ("q", "k"):
        nodes.append(helper.make_node("Reshape", [name, "heads_shape"], [f"{name}4"]))
        nodes += rotary_nodes(f"{name}4", f"{name}_rot4")
        nodes.append(helper.make_node("Reshape", [f"{name}_rot4", "out_shape"], [f"{name}_rot"]))
    inits = [
        const("axes02", np.array([0, 2])), const("axis2", np.array([2])), const("axis3", np.array([3])),
        const("zero", np.array([0])), const(f"split_{HALF}", np.array([HALF])), const("end", np.array([INT64_MAX])),
        const("one", np.array([1])), const("inv_freq", (1.0 / 10000 ** (np.arange(HALF) / HALF)).astype(np.float32)),
        const("heads_shape", np.array([batch, -1, HEADS, D])), const("out_shape", np.array(out_shape)),
    ]  # fmt: skip
    model = model_of(
        nodes,
        [value("q", TensorProto.FLOAT, [batch, "S", HEADS * D]), value("k", TensorProto.FLOAT, [batch, "S", HEADS * D]),
         value("positions", TensorProto.INT64, ["S"])],
        [value("q_rot", TensorProto.FLOAT, None), value("k_rot", TensorProto.FLOAT, None)],
        inits,
    )  # fmt: skip
    for info in model.graph.value_info:  # the exporter knows the views keep S; ONNX's inference of -1 does not
        if info.name in ("q4", "k4"):
            info.type.tensor_type.shape.dim[1].dim_param = "S"
    return model


def structure(nodes) -> list[tuple]:
    """What nodes compute: domain, op, input and output names, attributes (not node names, which
    the rewriter gives to unnamed nodes)."""
    return [(n.domain, n.op_type, list(n.input), list(n.output), [a.SerializeToString() for a in n.attribute])
            for n in nodes]  # fmt: skip


def run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def assert_same_outputs(before: onnx.ModelProto, after: onnx.ModelProto, feeds: dict, atol: float = 1e-6) -> None:
    for want, got in zip(run(before, feeds), run(after, feeds)):
        np.testing.assert_allclose(got, want, rtol=0, atol=atol)


def test_skip_rms_norm_becomes_one_contrib_op_with_the_same_outputs() -> None:
    model = skip_norm_model()
    fused, report = fuse_step(model)
    assert report.applied["skip_rms_norm"] == 1
    assert op_counts(fused) == {f"{MS_DOMAIN}::SkipSimplifiedLayerNormalization": 1}
    onnx.checker.check_model(fused, full_check=True)
    feeds = {"a": RNG.standard_normal((1, 5, D), np.float32), "b": RNG.standard_normal((1, 5, D), np.float32)}
    assert_same_outputs(model, fused, feeds)  # the norm and the residual sum


def test_rotary_becomes_contrib_ops_sharing_one_cos_sin_per_step() -> None:
    model = rotary_model()
    fused, report = fuse_step(model)
    assert report.applied["rotary"] == 2
    counts = op_counts(fused)
    assert counts[f"{MS_DOMAIN}::RotaryEmbedding"] == 2 and counts["Cos"] == counts["Sin"] == 1
    assert counts["Neg"] == counts["Slice"] == 0
    onnx.checker.check_model(fused, full_check=True)
    # Ragged positions far past any cache length: the op reads row i of this step's angles.
    positions = np.array([7, 8, 300, 301, 302, 100_000], np.int64)
    feeds = {name: RNG.standard_normal((1, HEADS, 6, D), np.float32) for name in ("q", "k")}
    assert_same_outputs(model, fused, {**feeds, "positions": positions}, atol=1e-5)


def test_a_bare_rms_norm_becomes_the_division_ort_fuses_at_load(tmp_path: Path) -> None:
    model = norm_model()
    fused, report = fuse_step(model)
    assert report.applied["rms_norm_div"] == 1
    assert op_counts(fused) == {"Pow": 1, "ReduceMean": 1, "Add": 1, "Sqrt": 1, "Div": 1, "Mul": 1}
    onnx.checker.check_model(fused, full_check=True)
    assert_same_outputs(model, fused, {"x": RNG.standard_normal((1, 5, D), np.float32)})
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "loaded.onnx")
    ort.InferenceSession(fused.SerializeToString(), options, providers=["CPUExecutionProvider"])
    assert [n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node] == [
        "SimplifiedLayerNormalization"
    ]


@pytest.mark.parametrize(
    ("make", "rule"),
    [
        (lambda: skip_norm_model(exponent=3.0), "skip_rms_norm"),  # a norm that is not RMS
        (lambda: rotary_model(half=HALF - 1), "rotary"),  # a rotation split off the middle
        (lambda: norm_model(exponent=3.0), "rms_norm_div"),  # a bare norm that is not RMS
    ],
    ids=["not-rms-skip-norm", "off-middle-rotation", "not-rms-bare-norm"],
)
def test_a_near_miss_of_a_pattern_is_left_alone(make, rule: str) -> None:
    model = make()
    fused, report = fuse_step(model)
    assert report.applied[rule] == 0
    assert op_counts(fused) == op_counts(model)


def test_token_major_rotary_becomes_one_contrib_op_on_the_projection() -> None:
    model = token_major_rotary_model()
    fused, report = fuse_step(model)
    assert report.applied["token_major_rotary"] == 2 and report.applied["rotary"] == 0
    counts = op_counts(fused)
    assert counts[f"{MS_DOMAIN}::RotaryEmbedding"] == 2 and counts["Cos"] == counts["Sin"] == 1
    assert counts["Neg"] == counts["Slice"] == 0 and counts["Reshape"] == 3  # q's, k's and the angles' rows
    onnx.checker.check_model(fused, full_check=True)
    positions = np.array([7, 8, 300, 301, 302, 100_000], np.int64)  # ragged, far past any cache length
    feeds = {name: RNG.standard_normal((1, 6, HEADS * D), np.float32) for name in ("q", "k")}
    assert_same_outputs(model, fused, {**feeds, "positions": positions}, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs", [{"batch": 2}, {"out_shape": (0, -1, D)}], ids=["two-sequences", "output-shape-copies-a-dim"]
)
def test_token_major_rotary_near_misses_are_left_alone(kwargs) -> None:
    model = token_major_rotary_model(**kwargs)
    fused, report = fuse_step(model)
    assert report.applied["token_major_rotary"] == 0
    assert op_counts(fused) == op_counts(model)


def test_matmuls_of_one_input_become_one_matmul_and_a_split() -> None:
    weights = {name: RNG.standard_normal((D, n), np.float32) for name, n in (("wq", 8), ("wk", 4), ("wv", 4))}
    products = [helper.make_node("MatMul", ["x", w], [f"y_{w}"]) for w in weights]
    products.append(helper.make_node("MatMul", ["x", "w_fed"], ["y_fed"]))  # a weight fed at run time: not packed
    names = [*weights, "fed"]
    model = model_of(
        products + [helper.make_node("Relu", [f"y_{w}"], [f"out_{w}"]) for w in names],
        [value("x", TensorProto.FLOAT, [1, "S", D]), value("w_fed", TensorProto.FLOAT, [D, 2])],
        [value(f"out_{w}", TensorProto.FLOAT, None) for w in names],
        [const(name, w) for name, w in weights.items()],
    )
    fused, report = fuse_step(model)
    assert report.applied["packed_matmul"] == 1
    assert op_counts(fused) == {"MatMul": 2, "Split": 1, "Relu": 4}
    assert len(fused.graph.initializer) == 2  # the packed weight and its widths; the three went
    feeds = {"x": RNG.standard_normal((1, 3, D), np.float32), "w_fed": RNG.standard_normal((D, 2), np.float32)}
    assert_same_outputs(model, fused, feeds)


def test_subgraphs_pakv_nodes_and_functions_are_not_touched() -> None:
    """A Loop body holding the very pattern a rule fuses, a pakv node and a model-local function
    (the fallback bodies) come out computing what they did; the main graph's copy is fused."""
    body_norm, body_extra = rms_norm_nodes("body_residual", "body_out")
    body = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["body_residual"]), *body_norm,
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body",
        [value("i", TensorProto.INT64, []), value("cond_in", TensorProto.BOOL, [])],
        [value("cond_out", TensorProto.BOOL, []), value("body_out", TensorProto.FLOAT, [1, "S", D])],
        body_extra,
    )  # fmt: skip
    pakv_in = ["kc", "vc", "table", "lens"]
    gather = helper.make_node("GatherPaKvCache", pakv_in, ["k", "v"], domain="pakv", cache_mode="Norm",
                              is_seq_lens_cumsum=1)  # fmt: skip
    function = helper.make_function(
        "pakv", "GatherPaKvCache", pakv_in, ["k", "v"],
        [helper.make_node("Identity", ["kc"], ["k"]), helper.make_node("Identity", ["vc"], ["v"])],
        [helper.make_opsetid("", 20)], ["cache_mode", "is_seq_lens_cumsum"],
    )  # fmt: skip
    base = skip_norm_model()
    graph = base.graph
    graph.node.extend([helper.make_node("Loop", ["", "cond"], ["scan"], body=body), gather])
    graph.initializer.append(numpy_helper.from_array(np.array(True), "cond"))
    graph.input.extend(value(name, TensorProto.FLOAT, None) for name in pakv_in)
    graph.output.extend(value(name, TensorProto.FLOAT, None) for name in ("scan", "k", "v"))
    model = helper.make_model(graph, opset_imports=base.opset_import, functions=[function])
    fused, report = fuse_step(model)
    assert report.applied["skip_rms_norm"] == 1  # the main graph's
    by_type = {n.op_type: n for n in fused.graph.node}
    assert structure(by_type["Loop"].attribute[0].g.node) == structure(body.node)
    assert structure([by_type["GatherPaKvCache"]]) == structure([gather])
    assert [(f.domain, f.name, structure(f.node)) for f in fused.functions] == [
        (function.domain, function.name, structure(function.node))
    ]


def test_no_fuse_reaches_the_step_export(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """``pakv-onnx export [--no-fuse]`` -> export_genai(fuse=) -> export_step(fuse=); nothing is
    exported (the fake export_step stops there)."""
    seen = []

    class Stop(Exception):
        pass

    def fake_export_step(step, feeds, path, *, fuse):
        seen.append(fuse)
        raise Stop

    monkeypatch.setattr(genai, "export_step", fake_export_step)
    monkeypatch.setattr(genai, "load_hf_model", lambda hf_dir: build_model("llama"))
    build_model("llama").config.save_pretrained(tmp_path)  # the export reads the config before the weights
    (tmp_path / "model.safetensors").write_bytes(b"")  # never read: load_hf_model is the fake above
    for extra in ([], ["--no-fuse"]):
        with pytest.raises(Stop):
            cli.main(["export", str(tmp_path), str(tmp_path / "out"), *extra])
    assert seen == [True, False]
