"""PagedAttention (issue 23): every backend, the torch op, both exporters, the plugin and stock ORT
against an independent reference — torch's scaled_dot_product_attention on each sequence's dense
keys and values, kept beside the paged caches (never read through the block table) — and every
refusal worded once (the C validator) and raised the same on every path.

Tolerances, per dtype, on ``|got - want| <= atol + rtol * |want|`` with ``want`` the reference in
fp32 rounded once to the dtype: float32 1e-5 + 1e-5 (summation order only, measured <= 1e-6);
float16 and bfloat16 one unit in the last place of the output (both sides round an fp32 result:
they can differ by one rounding step, never more).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from conftest import ORT_ERRORS
from onnx_graphs import graph_feeds, plugin_refusal

import pakv_onnx
from pakv_onnx import runtime_plugin
from pakv_onnx.cases import AttentionCase, random_attention_case
from pakv_onnx.export import make_attention_model_for
from pakv_onnx.spec import ATTENTION, bitwise_equal

BACKENDS = ["native", "golden", "torch", "auto"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (atol, rtol): fp32 summation order; 16-bit: one unit in the last place (2^-10, 2^-7 relative).
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 2**-10), torch.bfloat16: (1e-2, 2**-7)}


def sdpa_reference(case: AttentionCase) -> torch.Tensor:
    """Each sequence's new tokens against its dense context with torch's SDPA (GQA, an explicit
    causal mask for queries at the context's end), fp32, rounded once to the query's dtype."""
    cu = case.cumulative_sequence_lengths.tolist()
    hq = case.query.shape[1]
    out = torch.zeros(case.query.shape[0], hq, case.value_cache.shape[3])
    for b, (keys, values) in enumerate(case.contexts):
        n, length = cu[b + 1] - cu[b], keys.shape[0]
        if n == 0:
            continue
        q = case.query[cu[b] : cu[b + 1]].float().transpose(0, 1)[None]  # [1, Hq, n, D]
        k, v = keys.float().transpose(0, 1)[None], values.float().transpose(0, 1)[None]
        visible = torch.arange(length)[None, :] <= (length - n + torch.arange(n))[:, None]
        scale = case.scale or None
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=True)
        out[cu[b] : cu[b + 1]] = attended[0].transpose(0, 1)
    return out.to(case.query.dtype)


def assert_close(got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, f"{label}: {got.dtype}{list(got.shape)}"
    atol, rtol = TOLERANCE[want.dtype]
    err = (got.float() - want.float()).abs()
    bound = atol + rtol * want.float().abs()
    worst = float((err - bound).max()) if err.numel() else -1.0
    assert worst <= 0, f"{label}: error {float(err.max()):.3g} past the {want.dtype} tolerance"


def feeds(case: AttentionCase) -> dict[str, torch.Tensor]:
    return dict(zip(ATTENTION.input_names, case.inputs()))


# --------------------------------------------------------------------------- #
# Values
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("seed", range(25))
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_matches_sdpa(seed: int, backend: str) -> None:
    case = random_attention_case(seed, scale=0.0 if seed % 3 else 0.29)
    got = pakv_onnx.paged_attention(*case.inputs(), scale=case.scale, backend=backend)
    assert_close(got, sdpa_reference(case), f"{backend} {case.summary()}")


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_dtypes_gqa_ratios_and_block_sizes(dtype: torch.dtype, group: int, block_size: int) -> None:
    """Prefill with and without a past, decode and an idle sequence in one call, -1 padded table."""
    case = random_attention_case(
        group + block_size, dtype=dtype, group=group, block_size=block_size, new_tokens=[23, 1, 0, 1, 5], past=[0, 40, 9, 3, 33]
    )
    want = sdpa_reference(case)
    for backend in ("native", "golden", "torch"):
        assert_close(pakv_onnx.paged_attention(*case.inputs(), backend=backend), want, f"{backend} {case.summary()}")


@pytest.mark.parametrize(
    "shape",
    [
        dict(group=1, new_tokens=[50], past=[100], head_dim=64),  # 16-token tiles, the last one partial
        dict(group=16, kv_heads=1, new_tokens=[3, 1], past=[7, 200], head_dim=8),  # one token per part, 16 heads
        dict(group=3, new_tokens=[1, 1], past=[0, 31], head_dim=5, value_head_dim=3),  # odd group and widths
        dict(group=2, new_tokens=[1], past=[1000], block_size=128, head_dim=128),  # a long context
        dict(group=2, new_tokens=[2, 1], past=[3, 0], head_dim=3, value_head_dim=2),  # default scale 1/sqrt(3)
        dict(group=1, new_tokens=[4], past=[5], head_dim=2),  # ... and 1/sqrt(2) (head_dim < 4)
    ],
    ids=["tiles", "wide-group", "odd", "long", "head-dim-3", "head-dim-2"],
)
def test_the_kernels_tiles_chunks_and_widths(shape: dict) -> None:
    case = random_attention_case(3, **shape)
    want = sdpa_reference(case)
    for backend in ("native", "golden"):
        assert_close(pakv_onnx.paged_attention(*case.inputs(), backend=backend), want, f"{backend} {case.summary()}")


def test_int64_indices_and_an_explicit_scale() -> None:
    case = random_attention_case(5, index_dtype=torch.int64, scale=0.11)
    for backend in ("native", "golden"):
        got = pakv_onnx.paged_attention(*case.inputs(), scale=0.11, backend=backend)
        assert_close(got, sdpa_reference(case), backend)


def test_pool_views_and_a_fused_qkv_slice_are_read_in_place() -> None:
    """Caches ``pool[:, 0]`` / ``pool[:, 1]`` of one ``[nb, 2, bs, Hk, D]`` pool and a query that is
    a slice of a fused projection ``[N, 3, Hq, D]``: read where they are (no copy)."""
    case = random_attention_case(8, group=2, kv_heads=2, head_dim=16, value_head_dim=16)
    pool = torch.stack((case.key_cache, case.value_cache), dim=1)
    qkv = torch.randn(case.query.shape[0], 3, *case.query.shape[1:])
    qkv[:, 1] = case.query
    views = (qkv[:, 1], pool[:, 0], pool[:, 1], *case.inputs()[3:])
    assert not views[0].is_contiguous() and not views[1].is_contiguous()
    want = sdpa_reference(case)
    for backend in ("native", "golden", "torch"):
        assert_close(pakv_onnx.paged_attention(*views, backend=backend), want, backend)


def test_into_a_callers_output_and_an_empty_batch() -> None:
    case = random_attention_case(9)
    out = torch.full((case.query.shape[0], case.query.shape[1], case.value_cache.shape[3]), float("nan"))
    assert pakv_onnx.paged_attention(*case.inputs(), out=out) is out
    assert_close(out, sdpa_reference(case), "out=")
    idle = random_attention_case(9, new_tokens=[0, 0], past=[4, 0])
    for backend in ("native", "golden", "torch"):
        assert pakv_onnx.paged_attention(*idle.inputs(), backend=backend).shape == (0, idle.query.shape[1], idle.value_cache.shape[3])


def test_a_nan_in_one_query_poisons_that_row_only() -> None:
    case = random_attention_case(4, new_tokens=[2, 1], past=[5, 9], group=2, kv_heads=1)
    case.query[0, 1, 0] = float("nan")
    for backend in ("native", "golden"):
        got = pakv_onnx.paged_attention(*case.inputs(), backend=backend)
        assert got[0, 1].isnan().all() and not got[0, 0].isnan().any() and not got[1:].isnan().any(), backend


def test_the_reference_itself_on_a_hand_checked_case() -> None:
    """One sequence, context 2, one new token: scores [q.k0, q.k1] = [0, 1] (scale 1), weights
    softmax([0, 1]); the output is their mix of the two values."""
    keys = torch.tensor([[[0.0, 0.0]], [[1.0, 0.0]]])  # [L=2, Hk=1, D=2]
    values = torch.tensor([[[2.0]], [[4.0]]])
    case = AttentionCase(
        "hand", torch.tensor([[[1.0, 0.0]]]), keys[None], values[None], torch.tensor([[0]]), torch.tensor([0, 1]),
        torch.tensor([1]), ((keys, values),), scale=1.0,
    )  # fmt: skip
    w = math.exp(1) / (1 + math.exp(1))
    assert abs(float(sdpa_reference(case)) - (2 * (1 - w) + 4 * w)) < 1e-6
    assert abs(float(pakv_onnx.paged_attention(*case.inputs(), scale=1.0)) - (2 * (1 - w) + 4 * w)) < 1e-6


# --------------------------------------------------------------------------- #
# ONNX Runtime: the plugin (C kernel and the Python bridge) and stock ORT's fallback function
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("runner", ["native", "golden", "stock"])
def test_in_onnx_runtime(dtype: torch.dtype, runner: str) -> None:
    case = random_attention_case(11, dtype=dtype, new_tokens=[17, 1, 0, 1], past=[0, 20, 3, 9], scale=0.2)
    model = make_attention_model_for(*case.inputs(), scale=case.scale)
    onnx.checker.check_model(model, full_check=True)
    if runner == "stock":
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    else:
        session = runtime_plugin.make_session(model, backend=runner)
    got = runtime_plugin.run(session, feeds(case))["output"]
    assert_close(got, sdpa_reference(case), f"{runner} {case.summary()}")


def test_intra_op_threads_change_no_byte() -> None:
    """A call big enough to go parallel (ORT's pool, parts of (sequence, kv head, query tile)) gives
    the bytes of one thread: every part computes in the same order wherever it runs."""
    case = random_attention_case(2, group=4, kv_heads=2, head_dim=64, block_size=16, new_tokens=[1] * 6 + [40], past=[300] * 7)
    model = make_attention_model_for(*case.inputs(), fallback=False, opset_version=17)
    outputs = []
    for threads in (1, 2):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        outputs.append(runtime_plugin.run(runtime_plugin.make_session(model, sess_options=options), feeds(case))["output"])
    assert bitwise_equal(outputs[0], outputs[1])
    assert_close(outputs[0], sdpa_reference(case), "2 threads")


def test_the_library_without_a_parallel_threshold_in_a_process_of_its_own() -> None:
    """PAKV_ONNX_ATTENTION_PARALLEL_MIN=0: even the smallest call splits over ORT's pool; still exact."""
    script = (
        "import torch, onnxruntime as ort, pakv_onnx\n"
        "from pakv_onnx import runtime_plugin\n"
        "from pakv_onnx.cases import random_attention_case\n"
        "from pakv_onnx.export import make_attention_model_for\n"
        "from pakv_onnx.spec import ATTENTION, bitwise_equal\n"
        "for seed in range(8):\n"
        "    case = random_attention_case(seed)\n"
        "    options = ort.SessionOptions(); options.intra_op_num_threads = 3\n"
        "    model = make_attention_model_for(*case.inputs(), fallback=False, opset_version=17)\n"
        "    got = runtime_plugin.run(runtime_plugin.make_session(model, sess_options=options), dict(zip(ATTENTION.input_names, case.inputs())))['output']\n"
        "    assert bitwise_equal(got, pakv_onnx.paged_attention(*case.inputs(), backend='native')), seed\n"
        "print('same')\n"
    )
    env = dict(os.environ, PAKV_ONNX_ATTENTION_PARALLEL_MIN="0")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0 and "same" in result.stdout, result.stderr[-3000:]


# --------------------------------------------------------------------------- #
# The torch op and the exporters
# --------------------------------------------------------------------------- #
def test_torch_op() -> None:
    from torch.library import opcheck

    case = random_attention_case(6)
    assert_close(torch.ops.pakv.paged_attention(*case.inputs()), sdpa_reference(case), "torch.ops")
    for kwargs in ({}, {"scale": 0.5}):
        results = opcheck(torch.ops.pakv.paged_attention, case.inputs(), kwargs)
        assert all(v == "SUCCESS" for v in results.values()), results


class _Attend(torch.nn.Module):
    def forward(self, query, key_cache, value_cache, block_table, cu, past):
        return torch.ops.pakv.paged_attention(query, key_cache, value_cache, block_table, cu, past, 0.25)


@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_export_runs_in_the_plugin_and_on_stock_ort(exporter: str) -> None:
    from pakv_onnx import export as pe

    case = random_attention_case(12, scale=0.25)
    attend = _Attend().eval()  # as a user exports: in eval mode (torch warns otherwise)
    model = pe.export(attend, case.inputs()) if exporter == "dynamo" else pe.export_legacy(attend, case.inputs())
    nodes = [n for n in model.graph.node if n.domain == "pakv"]
    assert [n.op_type for n in nodes] == ["PagedAttention"]
    assert [(a.name, a.f) for a in nodes[0].attribute] == [("scale", 0.25)]
    names = [i.name for i in model.graph.input]
    want = sdpa_reference(case)
    for session in (
        runtime_plugin.make_session(model),
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]),
    ):
        got = runtime_plugin.run(session, dict(zip(names, case.inputs())))[model.graph.output[0].name]
        assert_close(got, want, exporter)


def test_schema_infers_the_output() -> None:
    case = random_attention_case(1, dtype=torch.bfloat16, head_dim=8, value_head_dim=40)
    model = make_attention_model_for(*case.inputs(), fallback=False)
    model.graph.output[0].type.tensor_type.ClearField("shape")
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    out = inferred.graph.output[0].type.tensor_type
    assert out.elem_type == onnx.TensorProto.BFLOAT16
    assert [d.dim_param or d.dim_value for d in out.shape.dim] == ["query_0", "query_1", "value_cache_3"]


# --------------------------------------------------------------------------- #
# Refusals: the validator's words on every path
# --------------------------------------------------------------------------- #
def base_inputs() -> dict[str, torch.Tensor]:
    case = random_attention_case(0, group=2, kv_heads=2, block_size=4, head_dim=8, value_head_dim=8,
                                 new_tokens=[3, 1], past=[2, 6])  # fmt: skip
    return feeds(case)


def refusals() -> dict[str, tuple[dict, type, str]]:
    base = base_inputs()
    table, cu, past = base["block_table"], base["cumulative_sequence_lengths"], base["past_sequence_lengths"]
    bad_id = table.clone()
    bad_id[1, 1] = 99
    short = table[:, :1].clone()
    return {
        "query dtype": ({"query": base["query"].double()}, TypeError, r"^query dtype float64 is not one PagedAttention computes in \(float32, float16, bfloat16\)$"),
        "cache dtype": ({"key_cache": base["key_cache"].half()}, TypeError, r"^key_cache must have query's dtype float32, got float16$"),
        "query rank": ({"query": base["query"].reshape(4, -1)}, ValueError, r"^query must have rank 3 \(\[num_tokens, heads, head_dim\]\), got shape \[4, 32\]$"),
        "head_dim": ({"query": base["query"][..., :4]}, ValueError, r"^query must be row-major|^query head_dim 4 must be key_cache's head_dim 8"),
        "head_dim dense": ({"query": base["query"][..., :4].contiguous()}, ValueError, r"^query head_dim 4 must be key_cache's head_dim 8 \(query shape \[4, 4, 4\], key_cache shape \[.*\]\)$"),
        "gqa ratio": ({"query": base["query"][:, :3].contiguous()}, ValueError, r"^query's 3 heads must be a multiple of key_cache's 2 kv heads \(GQA\), query shape \[4, 3, 8\]$"),
        "value heads": ({"value_cache": base["value_cache"][:, :, :1].contiguous()}, ValueError, r"^value_cache must have key_cache's 2 kv heads, got shape"),
        "query layout": ({"query": base["query"].transpose(1, 2).contiguous().transpose(1, 2)}, ValueError, r"^query must be row-major contiguous within each token"),
        "table dtype": ({"block_table": table.float()}, TypeError, r"^block_table must be int32 or int64, got float32$"),
        "table rank": ({"block_table": table.reshape(-1)}, ValueError, r"^block_table must have rank 2 \(\[batch, max_blocks\]\)"),
        "cu entries": ({"cumulative_sequence_lengths": cu[:2]}, ValueError, r"^cumulative_sequence_lengths must have B\+1 entries for block_table with B = 2 rows, got shape \[2\]$"),
        "past entries": ({"past_sequence_lengths": past[:1]}, ValueError, r"^past_sequence_lengths must have B = 2 entries \(block_table's rows\), got shape \[1\]$"),
        "cu start": ({"cumulative_sequence_lengths": cu + 1}, ValueError, r"^cumulative_sequence_lengths must start at 0, got cumulative_sequence_lengths\[0\] = 1$"),
        "cu order": ({"cumulative_sequence_lengths": torch.tensor([0, 5, 4], dtype=cu.dtype)}, ValueError, r"^cumulative_sequence_lengths must be non-decreasing, got cumulative_sequence_lengths\[2\] = 4 < cumulative_sequence_lengths\[1\] = 5$"),
        "cu end": ({"cumulative_sequence_lengths": torch.tensor([0, 3, 3], dtype=cu.dtype)}, ValueError, r"^cumulative_sequence_lengths must end at query's 4 tokens, got cumulative_sequence_lengths\[2\] = 3$"),
        "past sign": ({"past_sequence_lengths": torch.tensor([2, -1], dtype=past.dtype)}, ValueError, r"^past_sequence_lengths must be non-negative, got past_sequence_lengths\[1\] = -1$"),
        "past overflow": ({"past_sequence_lengths": torch.tensor([2, 2**63 - 1])}, ValueError, r"^past_sequence_lengths\[1\] = 9223372036854775807 plus its 1 new tokens overflows int64$"),
        "row too short": ({"block_table": short}, ValueError, r"^block_table row 0 is too short: sequence 0's context of 5 tokens \(2 past \+ 3 new\) needs 2 blocks of 4, but block_table has 1 columns$"),
        "block id": ({"block_table": bad_id}, ValueError, r"^block_table\[1, 1\] = 99 is outside \[0, \d+\) \(num_blocks of key_cache\); sequence 1 reads it"),
        "scale": ({"scale": float("inf")}, ValueError, r"^scale must be a finite float \(0: 1 / sqrt\(head_dim\)\), got inf$"),
        "scale type": ({"scale": "0.5"}, TypeError, r"^scale must be a float, got str$"),
        "not a tensor": ({"past_sequence_lengths": [2, 6]}, TypeError, r"^past_sequence_lengths must be a torch.Tensor, got list$"),
        "output shape": ({"out": torch.zeros(4, 4, 7)}, ValueError, r"^output must have shape \[4, 4, 8\], got \[4, 4, 7\]$"),
        "output over query": ({"out": "query"}, ValueError, r"^output overlaps query in memory: an output must not share bytes with any input$"),
    }


def _ort_refusal(inputs: dict, scale: object, backend: str) -> str | None:
    """The ORT error of a one-node PagedAttention session, or None when ORT cannot express the call."""
    tensors = graph_feeds(inputs, ATTENTION.input_names)
    if tensors is None or not isinstance(scale, float):
        return None
    return plugin_refusal(make_attention_model_for, ATTENTION.input_names, tensors, backend, scale=scale)


@pytest.mark.parametrize("name", list(refusals()))
def test_every_refusal_is_the_validators_on_every_path(name: str) -> None:
    overrides, error, pattern = refusals()[name]
    inputs = base_inputs()
    scale = overrides.get("scale", 0.0)
    out = overrides.get("out")
    if isinstance(out, str):
        out = inputs[out]
    for key, value in overrides.items():
        if key not in ("scale", "out"):
            inputs[key] = value
    args = [inputs[n] for n in ATTENTION.input_names]
    with pytest.raises(error, match=pattern) as refused:
        pakv_onnx.plan_attention(*args, scale=scale, out=out)
    message = str(refused.value)
    for backend in BACKENDS:
        with pytest.raises(error) as got:
            pakv_onnx.paged_attention(*args, scale=scale, out=out, backend=backend)
        assert str(got.value) == message, backend
    if out is None and all(isinstance(t, torch.Tensor) for t in args) and isinstance(scale, float):
        with pytest.raises(error) as got:
            torch.ops.pakv.paged_attention(*args, scale)
        assert str(got.value) == message, "torch.ops"
    if out is None:
        for backend in ("native", "golden"):
            ort_message = _ort_refusal(inputs, scale, backend)
            if ort_message is not None:
                assert f"{error.__name__}: {message}" in ort_message, f"ORT {backend}: {ort_message}"


def test_the_plugin_refuses_a_scale_of_another_attribute_type() -> None:
    case = random_attention_case(0)
    model = make_attention_model_for(*case.inputs(), fallback=False, opset_version=17)
    model.graph.node[0].attribute.append(onnx.helper.make_attribute("scale", 1))  # an INT
    with pytest.raises(ORT_ERRORS, match="PagedAttention attribute scale must be a FLOAT attribute, got attribute type INT"):
        runtime_plugin.make_session(model)


@pytest.mark.parametrize(
    "override, rule",
    [
        ({"cumulative_sequence_lengths": torch.tensor([0, 3, 3], dtype=torch.int32)}, "end at query's N"),
        ({"past_sequence_lengths": torch.tensor([2, -1], dtype=torch.int32)}, "each >= 0"),
        ({"block_table": torch.tensor([[0, 1], [2, 99]], dtype=torch.int32)}, "block_tables entry used by a sequence"),
    ],
    ids=["cu end", "past sign", "block id"],
)
def test_the_fallback_refuses_what_the_contract_refuses(override: dict, rule: str) -> None:
    inputs = {**base_inputs(), **override}
    session = ort.InferenceSession(
        make_attention_model_for(*(inputs[n] for n in ATTENTION.input_names)).SerializeToString(),
        providers=["CPUExecutionProvider"],
    )
    with pytest.raises(ORT_ERRORS, match=rule):
        runtime_plugin.run(session, inputs)


@pytest.mark.parametrize("entry", ["plan_attention", "make_attention_model_for"])
def test_positional_entry_points_bind_exactly_the_six_inputs(entry):
    """plan_attention and make_attention_model_for take the op's inputs positionally through the one
    binder (spec.ATTENTION.inputs_of): one too few is a TypeError naming the inputs in order."""
    call = pakv_onnx.plan_attention if entry == "plan_attention" else make_attention_model_for
    inputs = random_attention_case(0).inputs()
    with pytest.raises(TypeError, match="takes 6 inputs \\(query, key_cache, value_cache, block_table"):
        call(*inputs[:5])
