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

import numpy as np
import pytest
import torch
from conftest import ORT_ERRORS
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
