"""Every path of the op raises what the one validator said (issues 14 and 19).

The validator (pakv_contract_*.c, reached from Python through ``validator.plan_gather``) words every
refusal; the paths are the public front on every backend (with and without caller outputs),
``torch.ops.pakv.gather_pa_kv_cache``, the ORT plugin's Python callback and the ORT plugin's C
kernel. :func:`assert_same_rejection_everywhere` runs one call through all of them and compares each
error's type and message with the validator's; tests/test_spec_validation.py's ``expect`` calls it
for every rejection there. The rest of this file checks that every path that accepts a call
writes the golden's bytes, and writes nothing when it refuses.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx_graphs import plugin_model_for

import pakv_onnx
from pakv_onnx import runtime_plugin
from pakv_onnx.cases import random_case
from pakv_onnx.export import torch_op  # noqa: F401  (registers torch.ops.pakv.gather_pa_kv_cache)
from pakv_onnx.spec import INPUT_NAMES, CacheMode, bitwise_equal
from pakv_onnx.validator import plan_gather

Outcome = tuple[type, str] | None  # (error type, message), or None when the call was accepted


def outcome(call: Callable[[], object]) -> Outcome:
    try:
        call()
    except (TypeError, ValueError) as err:
        return type(err), str(err)
    return None


def baseline_outputs() -> dict[str, torch.Tensor]:
    """Caller outputs of the valid baseline of tests/test_spec_validation.norm_inputs (T = 8)."""
    return {
        "key_out": torch.zeros(8, 2, 8, dtype=torch.bfloat16),
        "value_out": torch.zeros(8, 1, 4, dtype=torch.bfloat16),
    }


def front_outcomes(inputs: dict, attrs: dict) -> dict[str, Outcome]:
    """The call through the front on every backend."""
    spec_inputs = {n: inputs[n] for n in INPUT_NAMES}
    outputs = {n: inputs[n] for n in ("key_out", "value_out") if n in inputs}
    return {
        f"front:{backend}": outcome(
            lambda b=backend: pakv_onnx.gather_pa_kv_cache(**spec_inputs, **attrs, **outputs, backend=b)
        )
        for backend in ("golden", "torch", "native", "auto")
    }


def op_outcome(inputs: dict, attrs: dict) -> Outcome | str:
    """The call through torch.ops.pakv.gather_pa_kv_cache, or a reason it cannot be expressed there."""
    if any(n in inputs for n in ("key_out", "value_out")):
        return "the torch op takes no outputs"
    if not all(isinstance(inputs[n], torch.Tensor) or inputs[n] is None for n in INPUT_NAMES):
        return "the torch op's schema refuses non-tensors itself"
    if not isinstance(attrs["cache_mode"], str) or not isinstance(attrs["is_seq_lens_cumsum"], bool):
        return "the torch op's schema refuses such attribute types itself"
    mode = attrs["cache_mode"].value if isinstance(attrs["cache_mode"], CacheMode) else attrs["cache_mode"]
    args = [inputs[n] for n in INPUT_NAMES]
    flag = attrs["is_seq_lens_cumsum"]
    return outcome(lambda: torch.ops.pakv.gather_pa_kv_cache(*args, cache_mode=mode, is_seq_lens_cumsum=flag))


def ort_message(inputs: dict, attrs: dict, backend: str) -> str | None:
    """The ORT error of the plugin's Python callback, or None when the call cannot be expressed in ORT."""
    if any(n in inputs for n in ("key_out", "value_out")):
        return None
    tensors = [inputs[n] for n in INPUT_NAMES]
    if not all(t is None or (isinstance(t, torch.Tensor) and t.is_contiguous()) for t in tensors):
        return None
    mode = attrs["cache_mode"].value if isinstance(attrs["cache_mode"], CacheMode) else attrs["cache_mode"]
    if mode not in ("Norm", "PA_NZ") or attrs["is_seq_lens_cumsum"] not in (0, 1):
        return None  # the kernel refuses such attributes when the session is made
    try:
        model = plugin_model_for(*tensors, cache_mode=mode, is_seq_lens_cumsum=attrs["is_seq_lens_cumsum"])
    except (TypeError, ValueError):
        return None  # a dtype without an ONNX type
    try:
        session = runtime_plugin.make_session(model, backend=backend)
    except Exception:  # noqa: BLE001 - ORT's graph check refuses types outside the op's schema itself
        return None
    feeds = dict(zip(INPUT_NAMES, tensors))
    try:
        runtime_plugin.run(session, feeds)
    except Exception as err:  # noqa: BLE001 - ORT raises its own exception types
        return str(err)
    return ""


def assert_same_rejection_everywhere(inputs: dict, attrs: dict, error: type, pattern: str) -> None:
    """The validator refuses the call with ``error`` matching ``pattern``, and every path refuses it
    with the very same type and message (with and without caller outputs; in ORT through the
    Python callback and through the C kernel)."""
    configurations = [inputs]
    if not any(n in inputs for n in ("key_out", "value_out")):
        configurations.append({**inputs, **baseline_outputs()})
    for config in configurations:
        spec_inputs = {n: config[n] for n in INPUT_NAMES}
        outputs = {n: config[n] for n in ("key_out", "value_out") if n in config}
        reference = outcome(lambda: plan_gather(**spec_inputs, **attrs, **outputs))
        assert reference is not None, "the validator accepted a call the test says is refused"
        if config is inputs:
            assert reference[0] is error and re.search(pattern, reference[1]), reference
        for path, got in front_outcomes(config, attrs).items():
            assert got == reference, f"{path}: {got} != {reference}"
        op = op_outcome(config, attrs)
        if not isinstance(op, str):
            assert op == reference, f"torch.ops: {op} != {reference}"
    reference = outcome(lambda: plan_gather(**{n: inputs[n] for n in INPUT_NAMES}, **attrs))
    for backend in ("golden", "native"):
        ort = ort_message(inputs, attrs, backend)
        if ort is not None:
            assert f"{reference[0].__name__}: {reference[1]}" in ort, f"ORT {backend}: {ort!r} lacks {reference}"


# --------------------------------------------------------------------------- #
# Every path that accepts a call writes the golden's bytes; one that refuses writes nothing
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("backend", ["native", "auto", "torch", "golden"])
def test_every_path_gathers_the_golden_bytes(seed: int, backend: str) -> None:
    case = random_case(seed, max_blocks=12)
    want = case.golden()
    key_out, value_out = torch.empty_like(want[0]), torch.empty_like(want[1])
    outs = {"key_out": key_out, "value_out": value_out}
    got = pakv_onnx.gather_pa_kv_cache(*case.inputs(), **case.attributes(), **outs, backend=backend)
    assert got[0] is key_out and bitwise_equal(key_out, want[0]) and bitwise_equal(value_out, want[1])
    fresh = pakv_onnx.gather_pa_kv_cache(*case.inputs(), **case.attributes(), backend=backend)
    assert bitwise_equal(fresh[0], want[0]) and bitwise_equal(fresh[1], want[1])


INT64_EDGES = [0, 1, -1, 2, 3, 4, 5, 7, 8, 63, 64, -(2**31), 2**31 - 1, 2**40, 2**63 - 1, -(2**63)]


@st.composite
def maybe_bad_call(draw):
    """A random valid call with at most one index tensor or output replaced by edge values."""
    case = random_case(draw(st.integers(0, 10_000)), max_blocks=8)
    inputs = dict(zip(INPUT_NAMES, case.inputs()))
    want = case.golden()
    outputs = {"key_out": torch.empty_like(want[0]), "value_out": torch.empty_like(want[1])}
    target = draw(st.sampled_from(["none", "block_tables", "seq_lens", "seq_offset", "key_out", "value_out"]))
    if target in ("key_out", "value_out"):
        rows = draw(st.integers(0, want[0].shape[0] + 2))
        ref = outputs[target]
        outputs[target] = torch.empty((rows, *ref.shape[1:]), dtype=draw(st.sampled_from([ref.dtype, torch.int8])))
    elif target != "none":
        shape = draw(st.lists(st.integers(0, 4), min_size=1, max_size=2))
        numel = 1
        for dim in shape:
            numel *= dim
        values = draw(st.lists(st.sampled_from(INT64_EDGES), min_size=numel, max_size=numel))
        tensor = torch.tensor(values, dtype=torch.int64).reshape(shape)
        inputs[target] = tensor.to(draw(st.sampled_from([torch.int32, torch.int64])))
    return inputs, case.attributes(), outputs


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(maybe_bad_call())
def test_every_backend_takes_the_validators_verdict(call) -> None:
    """Edge values in an index tensor or an output: every backend raises what the validator said,
    writes nothing when it refuses, and writes the golden's bytes when it accepts."""
    inputs, attrs, outputs = call
    reference = outcome(lambda: plan_gather(**inputs, **attrs, **outputs))
    for backend in ("native", "auto", "torch"):
        outs = {n: torch.zeros_like(t) for n, t in outputs.items()}
        got = outcome(lambda: pakv_onnx.gather_pa_kv_cache(**inputs, **attrs, **outs, backend=backend))
        assert got == reference, backend
        if got is None:
            want = pakv_onnx.gather_pa_kv_cache(**inputs, **attrs, backend="golden")
            assert bitwise_equal(outs["key_out"], want[0]) and bitwise_equal(outs["value_out"], want[1])
        else:
            assert all(not t.any() for t in outs.values()), f"{backend} wrote before refusing"


@pytest.mark.parametrize(
    "backend, error, pattern",
    [
        (["torch"], TypeError, r"^backend must be a string, got list$"),
        ("fastest", ValueError, r"^backend 'fastest' is unknown \(choices: auto, "),
    ],
)
def test_a_bad_backend_name_is_refused_by_name_on_every_path(backend, error, pattern) -> None:
    """With and without caller outputs."""
    case = random_case(11, dtype=torch.float16, cache_mode=CacheMode.NORM)
    golden = case.golden()
    for outputs in ({}, {"key_out": torch.empty_like(golden[0]), "value_out": torch.empty_like(golden[1])}):
        with pytest.raises(error, match=pattern):
            pakv_onnx.gather_pa_kv_cache(*case.inputs(), **case.attributes(), **outputs, backend=backend)


@pytest.mark.parametrize("seed", range(40))
def test_listed_and_vectorised_token_slots_agree(seed: int, monkeypatch) -> None:
    """GatherPlan.token_slots lists small plans in Python and builds large ones with torch ops: the same values."""
    from pakv_onnx import plans

    case = random_case(seed, max_blocks=12)
    plan = plan_gather(*case.inputs(), **case.attributes())
    listed = plan.token_slots()
    monkeypatch.setattr(plans, "SMALL_TOKEN_SLOTS", -1)
    vectorised = plan.token_slots()
    assert [t.tolist() for t in listed] == [t.tolist() for t in vectorised]
    for rows_per_block in (plan.block_size, plan.block_size * 3 + 1):
        monkeypatch.setattr(plans, "SMALL_TOKEN_SLOTS", 4096)
        small = plan.token_rows(rows_per_block).tolist()
        monkeypatch.setattr(plans, "SMALL_TOKEN_SLOTS", -1)
        assert small == plan.token_rows(rows_per_block).tolist()
