"""Every Python path of the op refuses the same inputs with the same error, word for word (issue 14).

The paths: spec's full checks (vectorised torch), its small-input checks over lists, its fast
accept, the public front on every backend (with and without caller outputs; with outputs the
native backend first tries its raw C path), ``torch.ops.pakv.gather_pa_kv_cache``, and the ORT
plugin's Python callback. :func:`assert_same_rejection_everywhere` runs one call through all of them
and compares each error's type and message with the full checks'; tests/test_spec_validation.py's
``expect`` calls it for every rejection there. The rest of this file checks that the fast paths
accept exactly what the full checks accept, with the same plan and the same bytes.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx_graphs import plugin_model_for

import pakv_onnx
from pakv_onnx import kernels, native_lib, runtime_plugin, spec
from pakv_onnx.cases import random_case
from pakv_onnx.export import torch_op  # noqa: F401  (registers torch.ops.pakv.gather_pa_kv_cache)
from pakv_onnx.spec import INPUT_NAMES, CacheMode, bitwise_equal, plan_gather

Outcome = tuple[type, str] | None  # (error type, message), or None when the call was accepted


@contextlib.contextmanager
def full_checks_only() -> Iterator[None]:
    """plan_gather without its fast accept and with the vectorised index checks (the reference)."""
    with mock.patch.object(spec, "_accept_fast", return_value=None), mock.patch.object(spec, "SMALL_INDEX_ENTRIES", -1):
        yield


@contextlib.contextmanager
def list_checks() -> Iterator[None]:
    """plan_gather without its fast accept: the small-input checks over .tolist()."""
    with mock.patch.object(spec, "_accept_fast", return_value=None):
        yield


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


def warm_native_resolution() -> None:
    """Resolve the native backend once for dense bf16 Norm/PA_NZ CPU caches, so the front's raw path is live."""
    for mode, shape in ((CacheMode.NORM, (6, 4, 2, 8)), (CacheMode.PA_NZ, (6, 1, 4, 16))):
        cache = torch.zeros(shape, dtype=torch.bfloat16)
        plan = plan_gather(cache, cache, torch.zeros(1, 1, dtype=torch.int64), torch.tensor([0, 1]), cache_mode=mode)
        for name in ("native", kernels.AUTO):
            kernels.resolve_backend(name, plan, cache, cache)


def front_outcomes(inputs: dict, attrs: dict) -> dict[str, Outcome]:
    """The call through spec's three paths and the front on every backend."""
    spec_inputs = {n: inputs[n] for n in INPUT_NAMES}
    outputs = {n: inputs[n] for n in ("key_out", "value_out") if n in inputs}
    results: dict[str, Outcome] = {}
    with list_checks():
        results["spec:lists"] = outcome(lambda: plan_gather(**spec_inputs, **attrs, **outputs))
    results["spec:fast"] = outcome(lambda: plan_gather(**spec_inputs, **attrs, **outputs))
    warm_native_resolution()
    for backend in ("golden", "torch", "native", "auto"):
        results[f"front:{backend}"] = outcome(
            lambda b=backend: pakv_onnx.gather_pa_kv_cache(**spec_inputs, **attrs, **outputs, backend=b)
        )
    return results


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
    """The call is refused by spec's full checks with ``error`` matching ``pattern``, and every
    other path refuses it with the very same type and message (with and without caller outputs)."""
    configurations = [inputs]
    if not any(n in inputs for n in ("key_out", "value_out")):
        configurations.append({**inputs, **baseline_outputs()})  # the native raw path needs both outputs
    for config in configurations:
        spec_inputs = {n: config[n] for n in INPUT_NAMES}
        outputs = {n: config[n] for n in ("key_out", "value_out") if n in config}
        with full_checks_only():
            reference = outcome(lambda: plan_gather(**spec_inputs, **attrs, **outputs))
        assert reference is not None, "the full checks accepted a call the test says is refused"
        if config is inputs:
            assert reference[0] is error and re.search(pattern, reference[1]), reference
        for path, got in front_outcomes(config, attrs).items():
            assert got == reference, f"{path}: {got} != {reference}"
        op = op_outcome(config, attrs)
        if not isinstance(op, str):
            assert op == reference, f"torch.ops: {op} != {reference}"
    ort = ort_message(inputs, attrs, "golden")
    if ort is not None:
        with full_checks_only():
            reference = outcome(lambda: plan_gather(**{n: inputs[n] for n in INPUT_NAMES}, **attrs))
        assert f"{reference[0].__name__}: {reference[1]}" in ort, f"ORT callback: {ort!r} lacks {reference}"


# --------------------------------------------------------------------------- #
# The fast paths accept what the full checks accept, with the same plan and bytes
# --------------------------------------------------------------------------- #
def plans_equal(a: spec.GatherPlan, b: spec.GatherPlan) -> bool:
    scalars = (
        "cache_mode",
        "is_seq_lens_cumsum",
        "num_blocks",
        "block_size",
        "num_seqs",
        "num_tokens",
        "key_token_shape",
        "value_token_shape",
        "key_dtype",
        "value_dtype",
        "key_row_bytes",
        "value_row_bytes",
    )
    tensors = ("seq_lengths", "out_starts", "table_col_starts", "block_tables")
    return all(getattr(a, n) == getattr(b, n) for n in scalars) and all(
        torch.equal(getattr(a, n), getattr(b, n)) for n in tensors
    )


@pytest.mark.parametrize("seed", range(60))
def test_fast_and_list_plans_equal_the_full_plan(seed: int) -> None:
    case = random_case(seed, max_blocks=12)
    with full_checks_only():
        full = plan_gather(*case.inputs(), **case.attributes())
    with list_checks():
        listed = plan_gather(*case.inputs(), **case.attributes())
    fast = plan_gather(*case.inputs(), **case.attributes())
    assert plans_equal(full, listed) and plans_equal(full, fast)
    assert fast.token_slots()[0].tolist() == full.token_slots()[0].tolist()
    assert fast.token_slots()[1].tolist() == full.token_slots()[1].tolist()
    assert fast.runs().tolist() == full.runs().tolist()
    for rows_per_block in (full.block_size, full.block_size * 3 + 1):
        assert fast.token_rows(rows_per_block).tolist() == full.token_rows(rows_per_block).tolist()


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("backend", ["native", "auto", "torch", "golden"])
def test_every_path_gathers_the_golden_bytes(seed: int, backend: str) -> None:
    case = random_case(seed, max_blocks=12)
    want = case.golden()
    key_out, value_out = torch.empty_like(want[0]), torch.empty_like(want[1])
    warm_native_resolution()
    outs = {"key_out": key_out, "value_out": value_out}
    got = pakv_onnx.gather_pa_kv_cache(*case.inputs(), **case.attributes(), **outs, backend=backend)
    assert got[0] is key_out and bitwise_equal(key_out, want[0]) and bitwise_equal(value_out, want[1])
    fresh = pakv_onnx.gather_pa_kv_cache(*case.inputs(), **case.attributes(), backend=backend)
    assert bitwise_equal(fresh[0], want[0]) and bitwise_equal(fresh[1], want[1])


def test_the_raw_native_path_is_taken_for_dense_calls_with_outputs(monkeypatch) -> None:
    case = random_case(3, max_blocks=8)
    want = case.golden()
    key_out, value_out = torch.empty_like(want[0]), torch.empty_like(want[1])
    outs = {"key_out": key_out, "value_out": value_out}
    warm_native_resolution()
    pakv_onnx.gather_pa_kv_cache(*case.inputs(), **case.attributes(), **outs, backend="native")
    calls = []
    real = native_lib.gather_raw
    monkeypatch.setattr(native_lib, "gather_raw", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(pakv_onnx.ops, "plan_gather", mock.Mock(side_effect=AssertionError("plan_gather ran")))
    key_out.zero_()
    pakv_onnx.gather_pa_kv_cache(*case.inputs(), **case.attributes(), **outs, backend="native")
    assert len(calls) == 1 and bitwise_equal(key_out, want[0]) and bitwise_equal(value_out, want[1])


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
def test_the_fast_paths_accept_only_what_the_full_checks_accept(call) -> None:
    """Native raw C path, fast accept and list checks against the full checks: same verdict, same
    message, and when accepted the golden's bytes."""
    inputs, attrs, outputs = call
    with full_checks_only():
        reference = outcome(lambda: plan_gather(**inputs, **attrs, **outputs))
    warm_native_resolution()
    for backend in ("native", "auto", "torch"):
        outs = {n: torch.zeros_like(t) for n, t in outputs.items()}
        got = outcome(lambda: pakv_onnx.gather_pa_kv_cache(**inputs, **attrs, **outs, backend=backend))
        assert got == reference, backend
        if got is None:
            with full_checks_only():
                want = pakv_onnx.gather_pa_kv_cache(**inputs, **attrs, backend="golden")
            assert bitwise_equal(outs["key_out"], want[0]) and bitwise_equal(outs["value_out"], want[1])
        else:
            assert all(not t.any() for t in outs.values()), f"{backend} wrote before refusing"


# --------------------------------------------------------------------------- #
# Backend resolution cache
# --------------------------------------------------------------------------- #
def test_auto_resolution_is_cached_per_device_dtypes_and_mode(monkeypatch) -> None:
    kernels.clear_resolution_cache()
    case = random_case(5, max_blocks=8)
    plan = plan_gather(*case.inputs(), **case.attributes())
    key, value = case.key_cache.contiguous(), case.value_cache.contiguous()
    device, dtypes = key.device, (plan.key_dtype, plan.value_dtype)
    assert kernels.cached_backend(kernels.AUTO, device, *dtypes, plan.cache_mode) is None
    first = kernels.resolve_backend(kernels.AUTO, plan, key, value)
    assert kernels.cached_backend(kernels.AUTO, device, *dtypes, plan.cache_mode) is first
    # A cached pick does not ask the backends again ...
    monkeypatch.setattr(kernels, "_resolve_auto", mock.Mock(side_effect=AssertionError("resolved again")))
    assert kernels.resolve_backend(kernels.AUTO, plan, key, value) is first
    # ... until the registry changes, which is a miss.
    monkeypatch.setitem(kernels.BACKEND_MODULES, "broken", "broken_backend")
    with pytest.raises(AssertionError, match="resolved again"):
        kernels.resolve_backend(kernels.AUTO, plan, key, value)


def test_pool_views_are_resolved_every_call() -> None:
    kernels.clear_resolution_cache()
    pool = torch.zeros(6, 2, 4, 2, 8, dtype=torch.bfloat16)
    key, value = pool[:, 0], pool[:, 1]
    plan = plan_gather(key, value, torch.zeros(1, 2, dtype=torch.int64), torch.tensor([0, 5]))
    kernels.resolve_backend(kernels.AUTO, plan, key, value)
    assert kernels.cached_backend(kernels.AUTO, key.device, key.dtype, value.dtype, CacheMode.NORM) is None


def test_index_tensors_reach_the_host_in_one_copy_per_device() -> None:
    """_on_host leaves CPU tensors alone (no copy); a device's index tensors would go over in one cat."""
    tables, lens = torch.zeros(2, 3, dtype=torch.int32), torch.tensor([0, 1, 2])
    got = spec._on_host(tables, lens, None)
    assert got[0] is tables and got[1] is lens and got[2] is None


@pytest.mark.parametrize(
    "backend, error, pattern",
    [
        (["torch"], TypeError, r"^backend must be a string, got list$"),
        ("fastest", ValueError, r"^backend 'fastest' is unknown \(choices: auto, "),
    ],
)
def test_a_bad_backend_name_is_refused_by_name_on_every_path(backend, error, pattern) -> None:
    """With caches whose backend is already cached (the raw path's lookup runs first) or not."""
    case = random_case(11, dtype=torch.float16, cache_mode=CacheMode.NORM)
    golden = case.golden()
    pakv_onnx.gather_pa_kv_cache(*case.inputs(), **case.attributes(), backend="native")  # warm the cache
    for outputs in ({}, {"key_out": torch.empty_like(golden[0]), "value_out": torch.empty_like(golden[1])}):
        with pytest.raises(error, match=pattern):
            pakv_onnx.gather_pa_kv_cache(*case.inputs(), **case.attributes(), **outputs, backend=backend)
