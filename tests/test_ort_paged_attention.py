"""com.microsoft::PagedAttention (issue 28): ONNX Runtime's own fused paged-attention op served by the
plugin's CPU kernel, against an independent float64 numpy reference (ort_attention_reference.py,
written from ORT's sources) for every feature and combination.

What is compared, and how closely:
* the caches after the call, bit for bit: float caches hold exactly the reference's T values (the
  prologue's rounding points are the contract's), int8 / float8e4m3fn caches exactly its codes;
* the output, with ``want`` the float64 reference rounded once to T: ``|got - want| <= atol + rtol x |want|``
  with float32 (2e-5, 2e-5): the kernel sums in fp32 with an online softmax, the reference in fp64,
  both over at most a few hundred positions of O(1) scores (measured below 3e-6); float16 / bfloat16
  one unit in the last place (2^-10 / 2^-7 relative, plus 1e-3 / 1e-2 absolute near zero): both
  round a result that differs by fp32 rounding only, so at most one rounding step apart.
"""

from __future__ import annotations

import itertools
import math
import re
from fractions import Fraction

import numpy as np
import onnxruntime as ort
import pytest
import torch
from conftest import ORT_ERRORS
from ort_attention_cases import ONNX_TYPES as ONNX_OF
from ort_attention_cases import OUTPUT_NAMES, OrtCall, cache_values, model_for, random_ort_call, rounded
from ort_attention_reference import reference

from pakv_onnx import runtime_plugin

TOLERANCE = {"float32": (2e-5, 2e-5), "float16": (1e-3, 2**-10), "bfloat16": (1e-2, 2**-7)}
DTYPES = ["float32", "float16", "bfloat16"]


def run_plugin(
    call: OrtCall, *, in_place: bool = True, outputs: tuple[str, ...] = OUTPUT_NAMES
) -> dict[str, torch.Tensor]:
    """One session run of the call's one-node model; with ``in_place`` the cache outputs are bound to
    the cache inputs' own buffers (as ORT GenAI binds them), else ORT allocates them."""
    session = runtime_plugin.make_session(model_for(call, outputs))
    out = {}
    if in_place:
        out = {"key_cache_out": call.inputs["key_cache"], "value_cache_out": call.inputs["value_cache"]}
    names = [o.name for o in session.get_outputs()]
    return runtime_plugin.run(
        session, call.inputs, names, {k: v for k, v in out.items() if k in names and v is not None}
    )


def check(call: OrtCall, got: dict[str, torch.Tensor], *, caches: dict[str, torch.Tensor] | None = None) -> float:
    """The outputs against the reference of ``call`` (taken before it ran): caches bit-exact, output
    within the tolerance. Returns the largest output error (for the tolerance's record)."""
    want = reference(call.numpy_call())
    caches = caches or {"key_cache": got["key_cache_out"], "value_cache": got.get("value_cache_out")}
    np.testing.assert_array_equal(cache_values(caches["key_cache"]), want.key_cache, err_msg="key_cache written")
    if want.value_cache is not None:
        np.testing.assert_array_equal(
            cache_values(caches["value_cache"]), want.value_cache, err_msg="value_cache written"
        )
    output = got["output"].float().numpy()
    expected = rounded(want.output, call.dtype)
    atol, rtol = TOLERANCE[call.dtype]
    error = np.abs(output - expected)
    assert output.shape == expected.shape
    assert np.all(error <= atol + rtol * np.abs(expected)), (
        f"max error {error.max():.3g} at {np.unravel_index(error.argmax(), error.shape)}"
    )
    return float(error.max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
def test_float_caches_separate_and_packed(dtype: str, packed: bool) -> None:
    """Ragged batch: decode, prefill, an empty sequence and a chunk after a past, GQA 2:1; slots derived."""
    call = random_ort_call(1, dtype=dtype, packed=packed)
    check(call, run_plugin(call.clone()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [None, 8], ids=["full", "partial"])
def test_rotary_at_past_plus_j(dtype: str, rotary: str, rotary_dim: int | None) -> None:
    """Rotary inside the op at position past + j, both layouts, over the whole head or its first 8 channels."""
    call = random_ort_call(2, dtype=dtype, rotary=rotary, rotary_dim=rotary_dim)
    check(call, run_plugin(call.clone()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_offset_rotates_a_later_span(dtype: str) -> None:
    call = random_ort_call(3, dtype=dtype, head_size=24, rotary="half", rotary_dim=8, rotary_offset=16)
    check(call, run_plugin(call.clone()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary", [None, "half"])
def test_qk_norm_before_rotary(dtype: str, rotary: str | None) -> None:
    call = random_ort_call(4, dtype=dtype, norm=True, rotary=rotary, packed=True)
    check(call, run_plugin(call.clone()))


@pytest.mark.parametrize("slots", ["given", "skip"])
def test_slot_mapping_given_and_skipped(slots: str) -> None:
    """slot_mapping given: the derived slots written explicitly; -1 leaves that token's slot as it was
    (its query still attends, over whatever the cache holds there)."""
    call = random_ort_call(5, dtype="float16", slots=slots, rotary="half")
    before = call.inputs["key_cache"].clone()
    got = run_plugin(call.clone())
    check(call, got)
    if slots == "given":
        derived = random_ort_call(5, dtype="float16", rotary="half")
        assert torch.equal(
            run_plugin(derived)["key_cache_out"].view(torch.int16), got["key_cache_out"].view(torch.int16)
        )
    else:
        assert not torch.equal(before, got["key_cache_out"])


@pytest.mark.parametrize("groups", [(4, 4), (4, 2), (8, 1)], ids=["mha", "gqa2", "mqa"])
def test_gqa_groups(groups: tuple[int, int]) -> None:
    call = random_ort_call(6, dtype="bfloat16", num_heads=groups[0], kv_num_heads=groups[1], rotary="interleaved")
    check(call, run_plugin(call.clone()))


def test_int64_indices_and_metadata_hint() -> None:
    """int64 index tensors (beyond ORT's int32) and attention_metadata, a hint that changes nothing."""
    call = random_ort_call(8, dtype="float32", index_dtype=torch.int64, metadata=True, slots="given")
    check(call, run_plugin(call.clone()))


@pytest.mark.parametrize("mode", ["bound", "allocated", "none"])
def test_cache_outputs_in_place_or_copied(mode: str) -> None:
    """Cache outputs bound to the caches' buffers: written in place; left to ORT (graph outputs): the
    caches are copied there and the inputs stay as they were; no cache outputs: the input caches are
    written in place (ORT's contract: "updated in place within the op")."""
    call = random_ort_call(9, dtype="float16", rotary="half")
    work = call.clone()
    before = work.inputs["key_cache"].clone()
    if mode == "none":
        got = run_plugin(work, outputs=("output",))
        check(call, got, caches={"key_cache": work.inputs["key_cache"], "value_cache": work.inputs["value_cache"]})
        return
    got = run_plugin(work, in_place=mode == "bound")
    check(call, got)
    same = got["key_cache_out"].data_ptr() == work.inputs["key_cache"].data_ptr()
    assert same == (mode == "bound")
    if mode == "allocated":
        assert torch.equal(work.inputs["key_cache"].view(torch.int16), before.view(torch.int16))


def test_the_tolerance_is_met_with_room() -> None:
    """The float32 bound is not loose: the largest error over the feature mix stays under 3e-6."""
    worst = max(check(c, run_plugin(c.clone())) for c in
                (random_ort_call(s, dtype="float32", rotary="half", norm=True, sequences=((40, 9), (0, 33), (70, 1)),
                                 num_blocks=64) for s in range(3)))  # fmt: skip
    assert worst < 3e-6, worst


def test_refusals_name_the_input() -> None:
    """A few refusals through ORT: the validator's message, naming the input (the full list of rules is
    checked on the Python front, which reaches the same validator)."""
    call = random_ort_call(10, dtype="float32", slots="given")
    call.inputs["slot_mapping"][1] = call.inputs["slot_mapping"][0]
    with pytest.raises(ORT_ERRORS, match=r"slot_mapping\[1\] = \d+ repeats slot_mapping\[0\]"):
        run_plugin(call)
    call = random_ort_call(10, dtype="float32", rotary="half")
    call.inputs["cos_cache"] = call.inputs["cos_cache"][:2].contiguous()
    call.inputs["sin_cache"] = call.inputs["sin_cache"][:2].contiguous()
    with pytest.raises(
        ORT_ERRORS, match=r"cos_cache has 2 positions but sequence \d+'s new tokens sit at positions up to"
    ):
        run_plugin(call)


# ------------------------------------------------------------------------------------------------
# Attention features (the attention core's plan, reached through ORT's attributes)
# ------------------------------------------------------------------------------------------------
def test_not_causal_sees_the_whole_context() -> None:
    call = random_ort_call(7, dtype="float32", causal=0)
    check(call, run_plugin(call.clone()))


@pytest.mark.parametrize("window", [1, 2, 5, 100])
def test_local_window_of_w_positions_ending_at_the_token(window: int) -> None:
    """local_window_size W: a token at position p sees p - W + 1 .. p (W = 1: itself only; a W past
    the context: all of it), as ORT's kernels (W - 1 to FlashAttention's window_size_left)."""
    call = random_ort_call(12, dtype="float32", window=window, sequences=((9, 3), (0, 7), (4, 1)), num_blocks=16)
    check(call, run_plugin(call.clone()))


def test_window_leaves_unread_leading_blocks_free() -> None:
    """Blocks wholly before every window may be unmapped (-1), as a serving layer frees them."""
    call = random_ort_call(13, dtype="float16", window=2, sequences=((9, 1),), num_blocks=8)
    call.inputs["block_table"][0, :2] = -1  # positions 0..7: the token at 9 sees 8 and 9 only
    check(call, run_plugin(call.clone()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap_after_the_scale(dtype: str) -> None:
    call = random_ort_call(14, dtype=dtype, softcap=1.5, scale=0.9)
    check(call, run_plugin(call.clone()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_sink_in_the_denominator(dtype: str) -> None:
    call = random_ort_call(15, dtype=dtype, sink=True)
    check(call, run_plugin(call.clone()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", ["int8", "float8e4m3fn"])
@pytest.mark.parametrize("quant", ["PER_TENSOR", "PER_CHANNEL"])
def test_quantized_caches(dtype: str, cache_dtype: str, quant: str) -> None:
    """int8 / float8e4m3fn caches: the new rows written as the reference's codes, bit for bit; every
    position read back dequantized (e x scale)."""
    call = random_ort_call(16, dtype=dtype, cache_dtype=cache_dtype, quant=quant, rotary="half", norm=True)
    check(call, run_plugin(call.clone()))


@pytest.mark.parametrize("cache_dtype", ["int8", "float8e4m3fn"])
def test_quantization_rounding_and_saturation(cache_dtype: str) -> None:
    """Keys chosen on the rounding rule's edges (scale 1): ties (to even), the clamps, +-inf, NaN
    (int8: -128, as the CUDA kernel's fmaxf(q, -128) gives before it rounds; float8: 448, as
    fminf(q, 448) gives), and float8's subnormals."""
    edges = {
        "int8": [2.5, 3.5, -2.5, -3.5, 126.5, 127.5, -128.5, 1e30, -1e30, np.inf, -np.inf, np.nan, 0.4999, -0.5, 7.0],
        "float8e4m3fn": [1.0625, 1.1875, -1.0625, 2.0**-10, 3 * 2.0**-10, 5 * 2.0**-11, 448.0, 464.0, 500.0, -1e9,
                         np.inf, -np.inf, np.nan, 0.0, -0.0, 240.0],
    }[cache_dtype]  # fmt: skip
    call = random_ort_call(17, dtype="float32", cache_dtype=cache_dtype, quant="PER_TENSOR", num_heads=2,
                           kv_num_heads=1, head_size=16, sequences=((0, 1),), slots="given")  # fmt: skip
    row = torch.tensor(edges + [0.0] * (16 - len(edges)), dtype=torch.float32)
    call.inputs["key"][0] = row
    call.inputs["value"][0] = row
    call.inputs["k_scale"].fill_(1.0)
    call.inputs["v_scale"].fill_(1.0)
    call.inputs["query"].zero_()  # scores 0: the output is the values' mean, finite
    want = reference(call.numpy_call())
    got = run_plugin(call.clone())
    np.testing.assert_array_equal(cache_values(got["key_cache_out"]), want.key_cache)
    written = cache_values(got["key_cache_out"])[int(call.inputs["slot_mapping"][0]) // 4, 0, 0]
    expected = {
        "int8": [2, 4, -2, -4, 126, 127, -128, 127, -128, 127, -128, -128, 0, 0, 7, 0],
        "float8e4m3fn": [
            0x38,
            0x3A,
            0xB8,
            0x00,
            0x02,
            0x01,
            0x7E,
            0x7E,
            0x7E,
            0xFE,
            0x7E,
            0xFE,
            0x7E,
            0x00,
            0x80,
            0x77,
        ],
    }[cache_dtype]
    assert written.astype(np.int64).tolist() == [int(np.int8(v)) if cache_dtype == "int8" else v for v in expected]


def test_float8_encoding_agrees_with_torch() -> None:
    """The reference's float8e4m3fn rounding (a table, ties to the even code) is torch's, for every
    float32 in range that is a midpoint or near one."""
    from ort_attention_reference import float8_encode

    values = torch.linspace(-448, 448, 200001).float()
    values = torch.cat([values, torch.tensor([2.0**-10, 3 * 2.0**-10, 2.0**-9 * 1.5, 1.0625, 240.0, 232.0])])
    ours = float8_encode(values.numpy())
    theirs = values.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("cache_dtype", [None, "float8e4m3fn"])
def test_latent_absorbed_mla(cache_dtype: str | None) -> None:
    """LATENT: one cache of the latent rows, V its leading v_head_size channels, rotary over the k_pe
    suffix (rotary_offset), an explicit scale; float8 with one per-channel key scale for both."""
    call = random_ort_call(18, dtype="bfloat16", latent=True, num_heads=4, head_size=24, v_head_size=16, scale=0.25,
                           rotary="half", rotary_dim=8, rotary_offset=16, cache_dtype=cache_dtype,
                           quant="PER_CHANNEL" if cache_dtype else None)  # fmt: skip
    check(call, run_plugin(call.clone()))


def _combinations() -> list[dict]:
    """Every combination of window x softcap x sink x GQA x rotary x LATENT x cache type (sinks and
    norms are refused with LATENT), over a ragged batch (prefill, decode, chunk and empty rows)."""
    combos = []
    for window, softcap, sink, groups, rotary, latent, cache in itertools.product(
        (-1, 3), (0.0, 2.0), (False, True), ((4, 2), (4, 4)), (None, "half", "interleaved"), (False, True),
        (None, ("int8", "PER_TENSOR"), ("float8e4m3fn", "PER_CHANNEL")),
    ):  # fmt: skip
        if latent and sink:
            continue
        combo = {"window": window, "softcap": softcap, "sink": sink, "num_heads": groups[0], "kv_num_heads": groups[1],
                 "rotary": rotary, "latent": latent, "cache_dtype": cache and cache[0], "quant": cache and cache[1],
                 "head_size": 24 if latent else 16, "v_head_size": 16 if latent else 0,
                 "rotary_dim": 8 if rotary else None, "rotary_offset": 16 if latent and rotary else 0,
                 "scale": 0.3 if latent else 0.0}  # fmt: skip
        combos.append(combo)
    return combos


COMBINATIONS = _combinations()


@pytest.mark.parametrize("index", range(0, len(COMBINATIONS), 7))
def test_feature_combinations_sampled(index: int) -> None:
    """Every 7th combination (all of them under -m slow), dtypes in turn."""
    call = random_ort_call(100 + index, dtype=DTYPES[index % 3], **COMBINATIONS[index])
    check(call, run_plugin(call.clone()))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_feature_combinations_all(dtype: str) -> None:
    for index, combo in enumerate(COMBINATIONS):
        call = random_ort_call(1000 + index, dtype=dtype, **combo)
        check(call, run_plugin(call.clone()))


# ------------------------------------------------------------------------------------------------
# Registration: what ORT reads of the op (through the fake OrtApi of tests/fake_ort_api.py)
# ------------------------------------------------------------------------------------------------
_REGISTRATION = """
import json, sys
from fake_ort_api import FakeRuntime
from pakv_onnx import native_lib

runtime = FakeRuntime(api_version=int(sys.argv[1]))
library = native_lib.load()
library.pakv_bind_next_alias(int(sys.argv[2]))  # the alias route: opted in (1) or not (0)
ops = runtime.register(library)
rows = []
for address in ops:
    op = runtime.op(address)
    rows.append({
        "domain": runtime.op_domains[address], "name": op.GetName(address).decode(),
        "ep": op.GetExecutionProviderType(address).decode(), "version": op.version,
        "counts": [op.GetInputTypeCount(address), op.GetOutputTypeCount(address)],
        "inputs": [op.GetInputType(address, i) for i in range(op.GetInputTypeCount(address))],
        "required": [i for i in range(op.GetInputTypeCount(address)) if op.GetInputCharacteristic(address, i) == 0],
        "outputs": [op.GetOutputCharacteristic(address, i) for i in range(op.GetOutputTypeCount(address))],
    })
print(json.dumps(rows))
"""


@pytest.mark.parametrize(("api_version", "alias"), [(16, 0), (17, 0), (18, 0), (18, 1)])
def test_registered_for_the_cpu_ep_only_so_orts_cuda_kernel_keeps_the_node(api_version: int, alias: int) -> None:
    """The library adds a com.microsoft domain holding PagedAttention for the CPU EP only: twelve
    (T, T_CACHE) entries, ORT's 17 inputs and 3 outputs with their characteristics. With no CUDA / CANN
    entry, a session with the CUDA EP places the node on ORT's own CUDA kernel (which ORT registers in
    its own registry), and a CPU-only session on this kernel. From API 18, on a registration that opted
    into the alias route, the cache inputs are declared aliases of the cache outputs (the op's version
    says ORT reads the alias map); without it they are not (docs/reliability.md). Each case in a fresh
    process: the library builds its ops once per process."""
    import json

    from conftest import run_python

    result = run_python(_REGISTRATION, args=[str(api_version), str(alias)])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(result.stdout)
    ours = [r for r in rows if r["domain"] == "com.microsoft"]
    assert {r["domain"] for r in rows} == {"pakv", "com.microsoft"}
    assert len(ours) == 12
    for row in ours:
        assert (row["name"], row["ep"], row["counts"]) == ("PagedAttention", "CPUExecutionProvider", [17, 3])
        assert row["required"] == [0, 3, 5, 6, 7] and row["outputs"] == [0, 1, 1]
        assert row["inputs"][14] == row["inputs"][15] == 1  # scales: float
        assert row["inputs"][5] == row["inputs"][10] == 0  # indices: int32 or int64 (checked at run time)
        assert row["version"] == (18 if api_version >= 18 and alias else 17 if api_version >= 17 else 16)
    pairs = {(r["inputs"][0], r["inputs"][3]) for r in ours}
    assert pairs == {(t, c) for t in (1, 10, 16) for c in (t, 3, 17, 2)}  # T x {T, int8, float8e4m3fn, uint8}
    devices = [r for r in rows if r["ep"] != "CPUExecutionProvider"]
    assert devices and all(r["domain"] == "pakv" for r in devices)


# ------------------------------------------------------------------------------------------------
# Non-finite values, attributes at session creation, the alias route
# ------------------------------------------------------------------------------------------------
def test_masked_positions_are_never_read() -> None:
    """NaN in every cache position no token sees (before a window, after a causal token's own
    position in its block, in unused blocks) changes nothing; NaN in a visible key makes that row NaN."""
    call = random_ort_call(60, dtype="float32", window=2, sequences=((6, 1), (0, 4)), num_blocks=8)
    want = reference(call.numpy_call())
    poisoned = call.clone()
    table = poisoned.inputs["block_table"]
    seen = {(int(table[0, p // 4]), p % 4) for p in (5, 6)} | {(int(table[1, p // 4]), p % 4) for p in range(4)}
    for block in range(8):
        for row in range(4):
            if (block, row) not in seen:
                poisoned.inputs["key_cache"][block, row] = float("nan")
                poisoned.inputs["value_cache"][block, row] = float("nan")
    got = run_plugin(poisoned)
    expected = rounded(want.output, "float32")
    assert np.all(np.abs(got["output"].numpy() - expected) <= 2e-5 + 2e-5 * np.abs(expected))
    visible = call.clone()
    visible.inputs["key_cache"][int(table[0, 1]), 1] = float("nan")  # position 5 of sequence 0, in its window
    rows = run_plugin(visible)["output"].numpy()
    assert np.isnan(rows[0]).all() and np.isfinite(rows[1:]).all()


@pytest.mark.parametrize(
    ("attributes", "message"),
    [
        ({"num_heads": 4.0}, "PagedAttention attribute num_heads must be an INT attribute, got attribute type FLOAT"),
        (
            {"k_quant_type": 1},
            "PagedAttention attribute k_quant_type must be a STRING attribute, got attribute type INT",
        ),
        ({"scale": [1.0, 2.0]}, "PagedAttention attribute scale must be a FLOAT attribute, got attribute type FLOATS"),
        ({"kv_cache_layout": "PACKED"}, "kv_cache_layout must be 'SEPARATE' or 'LATENT', got 'PACKED'"),
        ({"kv_cache_layout": "LATENT" + "x" * 300}, "got '(a string of 306 bytes)'"),
        (
            {"k_cache_dtype": "int4"},
            "k_cache_dtype 'int4' (two values packed per byte in a uint8 cache) is not implemented",
        ),
    ],
)
def test_attributes_are_checked_at_session_creation(attributes: dict, message: str) -> None:
    call = random_ort_call(61, dtype="float32")
    call.attributes.update(attributes)
    with pytest.raises(ORT_ERRORS, match=re.escape(message)):
        runtime_plugin.make_session(model_for(call))


def test_a_missing_required_attribute_is_named() -> None:
    call = random_ort_call(62, dtype="float32")
    del call.attributes["kv_num_heads"]
    with pytest.raises(ORT_ERRORS, match=re.escape("kv_num_heads must be given (an INT attribute >= 1)")):
        runtime_plugin.make_session(model_for(call))


def test_chained_steps_read_each_others_rows_and_leave_the_fed_pool_alone() -> None:
    """Two nodes, the second reading the first's cache outputs (not graph outputs): the second step reads
    the first's rows. The second write's pools are made by a node, which the alias check names (the write
    route is opt-in: docs/reliability.md), so make_session keeps ONNX's semantics: the updated caches are
    ORT's copies and the pool fed as a graph input is left as it was."""
    import onnx

    first = random_ort_call(63, dtype="float32", sequences=((2, 1), (5, 1)), num_blocks=6)
    second = first.clone()
    second.inputs["past_seqlens"] = first.inputs["past_seqlens"] + 1  # the next token of each sequence
    second.inputs["query"] = torch.randn_like(first.inputs["query"])
    second.inputs["key"], second.inputs["value"] = (
        torch.randn_like(first.inputs["key"]),
        torch.randn_like(first.inputs["value"]),
    )
    model = model_for(first)
    graph = model.graph
    node = graph.node[0]
    node.output[:] = ["output_1", "key_cache_1", "value_cache_1"]
    step = onnx.helper.make_node(
        "PagedAttention", ["query_2", "key_2", "value_2", "key_cache_1", "value_cache_1", "cumulative_sequence_length",
                           "past_seqlens_2", "block_table"], ["output", "key_cache_2", "value_cache_2"],
        domain="com.microsoft", **first.attributes,
    )  # fmt: skip
    graph.node.append(step)
    for name, like in (
        ("query_2", "query"),
        ("key_2", "key"),
        ("value_2", "value"),
        ("past_seqlens_2", "past_seqlens"),
    ):
        graph.input.append(onnx.helper.make_tensor_value_info(name, ONNX_OF[first.inputs[like].dtype], None))
    del graph.output[:]
    graph.output.append(onnx.helper.make_tensor_value_info("output", onnx.TensorProto.FLOAT, None))
    session = runtime_plugin.make_session(model)
    pool = first.clone()
    feeds = {**pool.inputs, "query_2": second.inputs["query"], "key_2": second.inputs["key"],
             "value_2": second.inputs["value"], "past_seqlens_2": second.inputs["past_seqlens"]}  # fmt: skip
    got = runtime_plugin.run(session, {k: v for k, v in feeds.items() if v is not None})
    after_first = reference(first.numpy_call())
    second.inputs["key_cache"] = torch.from_numpy(after_first.key_cache.copy())
    second.inputs["value_cache"] = torch.from_numpy(after_first.value_cache.copy())
    want = reference(second.numpy_call())
    expected = rounded(want.output, "float32")
    assert np.all(np.abs(got["output"].numpy() - expected) <= 2e-5 + 2e-5 * np.abs(expected))
    hazards = runtime_plugin.alias_hazards(model)
    assert len(hazards) == 2 and all("is not a graph input (a node makes it)" in h for h in hazards), hazards
    np.testing.assert_array_equal(pool.inputs["key_cache"].numpy(), first.inputs["key_cache"].numpy())

# ------------------------------------------------------------------------------------------------
# Writes no reader can see, and read-only pools (issue 27's routes, on this op)
# ------------------------------------------------------------------------------------------------
_READ_ONLY_ORT = """
import os, sys, tempfile
import numpy as np
from conftest import ORT_ERRORS
from ort_attention_cases import model_for, random_ort_call
from pakv_onnx import runtime_plugin

call = random_ort_call(71, dtype="float32")
folder = tempfile.mkdtemp()
feeds = {}
for name, tensor in call.inputs.items():
    if tensor is None:
        continue
    array = tensor.numpy()
    if name in ("key_cache", "value_cache"):
        array.tofile(os.path.join(folder, name))
        array = np.memmap(os.path.join(folder, name), dtype=array.dtype, mode="r", shape=array.shape)
    feeds[name] = array
# No cache outputs: the op writes its cache inputs in place (ORT's contract for this op). A raw
# InferenceSession: make_session's own session refuses the memmap (writeable=False) before ORT runs.
import onnxruntime as ort
options = ort.SessionOptions()
runtime_plugin.register(options)
session = ort.InferenceSession(model_for(call, outputs=("output",)).SerializeToString(), options,
                               providers=["CPUExecutionProvider"])
try:
    session.run(None, feeds)
    print("RAN")
except ORT_ERRORS as exc:
    print("REFUSED", exc)
assert np.array_equal(feeds["key_cache"], call.inputs["key_cache"].numpy())
"""


def test_a_read_only_pool_in_ort_is_refused_not_a_signal() -> None:
    """np.memmap(mode="r") pools the node writes in place: an error naming key_cache, nothing written,
    no signal (the kernel asks the kernel whether the rows it writes can be written)."""
    from conftest import run_python

    result = run_python(_READ_ONLY_ORT)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-1500:]}"
    assert "REFUSED" in result.stdout, result.stdout
    assert "key_cache: the rows this write goes to are not writable memory" in result.stdout


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
@pytest.mark.parametrize("backend", ["native", "golden"])
def test_a_read_only_pool_through_the_python_api_is_refused(backend: str, tmp_path) -> None:
    import pakv_onnx

    call = random_ort_call(72, dtype="float32")
    for name in ("key_cache", "value_cache"):
        array = call.inputs[name].numpy()
        array.tofile(tmp_path / name)
        call.inputs[name] = torch.from_numpy(np.memmap(tmp_path / name, dtype=array.dtype, mode="r", shape=array.shape))
    before = call.inputs["key_cache"].clone()
    with pytest.raises(ValueError, match=r"^key_cache: the rows this write goes to are not writable memory"):
        pakv_onnx.ort_paged_attention(**call.inputs, **call.attributes, backend=backend)
    assert torch.equal(call.inputs["key_cache"], before)


def test_an_initializer_pool_on_the_alias_route_is_refused_by_name() -> None:
    """Options registered with the alias route: a cache input that is a constant of the model would change
    under every later run; refused at session creation naming the node and the input. Without the route,
    the same model runs and its constant stays as it was (ORT's copy is written)."""
    from onnx import numpy_helper

    call = random_ort_call(73, dtype="float32")
    model = model_for(call)
    model.graph.node[0].name = "attend"
    constant = call.inputs["key_cache"].numpy()
    model.graph.initializer.append(numpy_helper.from_array(constant, "key_cache"))
    del model.graph.input[[i.name for i in model.graph.input].index("key_cache")]
    feeds = {n: t.numpy() for n, t in call.inputs.items() if t is not None and n != "key_cache"}
    if tuple(int(x) for x in ort.__version__.split(".")[:2]) >= (1, 18):
        options = ort.SessionOptions()
        runtime_plugin.register(options, alias=True)
        with pytest.raises(ORT_ERRORS, match=r"PagedAttention node 'attend': key_cache 'key_cache' is an initializer"):
            ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    assert any("is an initializer" in h for h in runtime_plugin.alias_hazards(model))
    session = runtime_plugin.make_session(model)
    first = session.run(None, feeds)
    second = session.run(None, feeds)
    np.testing.assert_array_equal(first[1], second[1])  # each run starts from the model's constant


# ----------------------------------------------------------------------------------------------
# The rotated key bytes, from first principles (exact rationals): ORT's CUDA arithmetic, not once-rounded
# ----------------------------------------------------------------------------------------------
def _nearest(x: Fraction, bits: int, min_step: int) -> Fraction:
    """x rounded to nearest (ties to even) in a binary format of ``bits`` significand bits whose
    smallest step is 2^min_step (no overflow: the values here are small)."""
    if x == 0:
        return x
    step = max(math.floor(math.log2(abs(x))) - bits + 1, min_step)
    while abs(x) >= Fraction(2) ** (step + bits):  # log2's float rounding, corrected
        step += 1
    m = x / Fraction(2) ** step
    r = math.floor(m)
    if m - r > Fraction(1, 2) or (m - r == Fraction(1, 2) and r % 2):
        r += 1
    return r * Fraction(2) ** step


def _cuda_rotation(a: Fraction, b: Fraction, c: Fraction, s: Fraction, sign: int, dtype: str) -> Fraction:
    """``a c + sign b s`` as ORT's CUDA kernel computes it for T (its SASS for sm_90a): float16 one
    fused multiply-add over a rounded product, bfloat16 every operation in fp32 rounded to bf16."""
    if dtype == "float16":
        return _nearest(a * c + _nearest(sign * b * s, 11, -24), 11, -24)
    bf16 = lambda v: _nearest(v, 8, -133)  # noqa: E731
    return bf16(_nearest(bf16(a * c) + bf16(sign * b * s), 24, -149))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rotated_keys_are_the_cuda_kernels_bytes(dtype: str) -> None:
    """Every rotated key element the plugin writes equals the CUDA kernel's arithmetic computed with
    exact rationals (no numpy, torch or C), and the case tells that arithmetic from a rotation rounded
    once from the exact value (the plugin's before issue 36): some elements differ between the two."""
    call = random_ort_call(36, dtype=dtype, rotary="half", sequences=((5, 4), (0, 6)), slots="given")
    got = cache_values(run_plugin(call.clone())["key_cache_out"])
    inputs = {k: None if v is None else v.float().numpy() for k, v in call.inputs.items()}
    hk, d, bs = call.attributes["kv_num_heads"], inputs["key_cache"].shape[3], inputs["key_cache"].shape[1]
    half = inputs["cos_cache"].shape[1]
    positions = [p + j for p, n in ((5, 4), (0, 6)) for j in range(n)]
    once_rounded_differs = 0
    for t, position in enumerate(positions):
        slot = int(call.inputs["slot_mapping"][t])
        keys = inputs["key"][t].reshape(hk, d)
        for g in range(hk):
            for r in range(2 * half):
                i, partner, sign = r % half, (r + half) % (2 * half), -1 if r < half else 1
                a, b = Fraction(float(keys[g, r])), Fraction(float(keys[g, partner]))
                c, s = Fraction(float(inputs["cos_cache"][position, i])), Fraction(float(inputs["sin_cache"][position, i]))
                want = _cuda_rotation(a, b, c, s, sign, dtype)
                assert Fraction(float(got[slot // bs, slot % bs, g, r])) == want, (t, g, r)
                bits = (11, -24) if dtype == "float16" else (8, -133)
                once_rounded_differs += _nearest(a * c + sign * b * s, *bits) != want
    assert once_rounded_differs > 0
