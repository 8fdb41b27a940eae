"""Every contract rejection surfaces as an ORT error naming the input, for the native kernel and a
Python backend; refusals at session creation; sessions stay usable after errors; Python
exceptions inside a backend keep their message; older runtimes are refused clearly."""

from __future__ import annotations

import ctypes
import sys
import types

import pytest
import torch
from conftest import ORT_ERRORS
from fake_ort_api import fake_ort, register_custom_ops
from onnx_graphs import feeds_for_case, model_for_case, plugin_model, plugin_model_for

from pakv_onnx import kernels, runtime_plugin
from pakv_onnx.cases import random_case
from pakv_onnx.kernels import Backend
from pakv_onnx.spec import (
    ATTR_CACHE_MODE,
    ATTR_IS_SEQ_LENS_CUMSUM,
    INPUT_NAMES,
    INT64_MAX,
    CacheMode,
    bitwise_equal,
)
from pakv_onnx.validator import plan_gather


def base_case(mode=CacheMode.NORM, cumsum=True):
    """A valid case with seq_offset, several sequences and more than one block per sequence."""
    for seed in range(200, 400):
        case = random_case(
            seed,
            dtype=torch.bfloat16,
            cache_mode=mode,
            is_seq_lens_cumsum=cumsum,
            index_dtypes=(torch.int32, torch.int64, torch.int32),
            with_seq_offset=True,
        )
        plan = plan_gather(*case.inputs(), **case.attributes())
        if plan.num_seqs >= 2 and plan.block_size >= 2 and int(plan.seq_lengths[0]) > plan.block_size:
            return case
    raise AssertionError("no suitable case")


def _with(feeds, **changes):
    out = dict(feeds)
    out.update(changes)
    return out


def mutations(case):
    """(label, input the error must name, feeds) for each contract violation reachable through ORT."""
    f = feeds_for_case(case)
    bt, sl, so = f["block_tables"], f["seq_lens"], f["seq_offset"]
    nb = case.key_cache.shape[0]
    bs = case.key_cache.shape[1]
    yield "block id >= num_blocks", "block_tables", _with(f, block_tables=_set(bt, (0, int(so[0]) // bs), nb))
    yield "negative block id", "block_tables", _with(f, block_tables=_set(bt, (0, int(so[0]) // bs), -1))
    yield "huge block id", "block_tables", _with(f, block_tables=_set(bt, (0, int(so[0]) // bs), 2**31 - 1))
    yield "block table too short", "block_tables", _with(f, block_tables=bt[:, : int(so[0]) // bs + 1].contiguous())
    yield "block_tables rank 1", "block_tables", _with(f, block_tables=bt.reshape(-1).contiguous())
    yield "block_tables float", "block_tables", _with(f, block_tables=bt.to(torch.float32))
    yield "seq_lens not from 0", "seq_lens", _with(f, seq_lens=sl + 1)
    yield "seq_lens decreasing", "seq_lens", _with(f, seq_lens=_set(sl, (1,), -5) if sl.numel() > 2 else sl - 1)
    yield "seq_lens too many", "seq_lens", _with(f, seq_lens=torch.cat([sl, sl[-1:]]))
    yield "seq_lens huge total", "block_tables", _with(f, seq_lens=_set(sl, (sl.numel() - 1,), INT64_MAX))
    yield "seq_lens rank 2", "seq_lens", _with(f, seq_lens=sl.reshape(1, -1).contiguous())
    yield "seq_offset negative", "seq_offset", _with(f, seq_offset=_set(so, (0,), -bs))
    yield "seq_offset wrong count", "seq_offset", _with(f, seq_offset=torch.cat([so, so[:1]]))
    yield "seq_offset past the table", "block_tables", _with(f, seq_offset=_set(so, (0,), bs * 10**6))
    yield "key_cache rank 3", "key_cache", _with(f, key_cache=case.key_cache[0].contiguous())
    yield "value_cache num_blocks", "value_cache", _with(f, value_cache=case.value_cache[:-1].contiguous())


def _set(t, index, value):
    t = t.clone()
    t[index] = value
    return t


def run_expecting_error(session, feeds):
    with pytest.raises(ORT_ERRORS) as info:
        runtime_plugin.run(session, feeds)
    return str(info.value)


@pytest.mark.parametrize("backend", ["native", "golden"])
@pytest.mark.parametrize("mode", list(CacheMode))
def test_every_rejection_names_the_input_and_the_session_survives(backend, mode) -> None:
    case = base_case(mode=mode)
    f = feeds_for_case(case)
    sessions = {}
    tried = 0
    for label, name, feeds in mutations(case):
        # The contract (spec) rejects it too, naming the same input.
        inputs = [feeds.get(n) for n in INPUT_NAMES]
        with pytest.raises((TypeError, ValueError)) as spec_error:
            plan_gather(*inputs, **case.attributes())
        assert name in str(spec_error.value), (label, str(spec_error.value))
        # strict=False: the model declares whatever dtype the bad feed has (e.g. float block_tables).
        model = plugin_model_for(*inputs, **case.attributes(), strict=False).SerializeToString()
        if model not in sessions:
            sessions[model] = runtime_plugin.make_session(model, backend=backend)
        message = run_expecting_error(sessions[model], feeds)
        assert name in message, (label, message)
        if backend != "native":  # Python backends raise the contract's own message
            assert str(spec_error.value) in message, (label, message)
        tried += 1
    assert tried == len(list(mutations(case)))
    # The session that saw most of the errors still works.
    golden = case.golden()
    session = sessions[model_for_case(case).SerializeToString()]
    out = runtime_plugin.run(session, f)
    assert bitwise_equal(out["key"], golden[0]) and bitwise_equal(out["value"], golden[1])


def test_session_keeps_working_after_errors_interleaved() -> None:
    case = base_case()
    f = feeds_for_case(case)
    used_col = int(f["seq_offset"][0]) // case.key_cache.shape[1]
    bad = _with(f, block_tables=_set(f["block_tables"], (0, used_col), 10**6))
    golden = case.golden()
    for backend in ("native", "golden"):
        session = runtime_plugin.make_session(model_for_case(case), backend=backend)
        for _ in range(5):
            run_expecting_error(session, bad)
            out = runtime_plugin.run(session, f)
            assert bitwise_equal(out["key"], golden[0]) and bitwise_equal(out["value"], golden[1])


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.bool, torch.uint64])
def test_cache_dtype_outside_the_contract_is_refused_at_session_creation(dtype) -> None:
    model = plugin_model(dtype, with_seq_offset=False, strict=False)
    for backend in ("native", "golden"):
        with pytest.raises(ORT_ERRORS, match="key_cache"):
            runtime_plugin.make_session(model, backend=backend)


@pytest.mark.parametrize(
    ("name", "value", "pattern"),
    [
        (ATTR_CACHE_MODE, 1, r"cache_mode must be a STRING attribute \('Norm' or 'PA_NZ'\), got attribute type INT"),
        (ATTR_CACHE_MODE, 0.0, r"cache_mode must be a STRING attribute \('Norm' or 'PA_NZ'\), got attribute type FLOAT"),
        (ATTR_CACHE_MODE, ["PA_NZ"], r"cache_mode must be a STRING attribute .* got attribute type STRINGS"),
        (ATTR_CACHE_MODE, [1, 2], r"cache_mode must be a STRING attribute .* got attribute type INTS"),
        (ATTR_CACHE_MODE, b"Norm\0junk", r"cache_mode must be 'Norm' or 'PA_NZ', got 'Norm' followed by a NUL byte"),
        (ATTR_IS_SEQ_LENS_CUMSUM, "1", r"is_seq_lens_cumsum must be an INT attribute \(0 or 1\), got .* STRING"),
        (ATTR_IS_SEQ_LENS_CUMSUM, 1.0, r"is_seq_lens_cumsum must be an INT attribute .* got attribute type FLOAT"),
        (ATTR_IS_SEQ_LENS_CUMSUM, [1], r"is_seq_lens_cumsum must be an INT attribute \(0 or 1\), got attribute type INTS"),
        (ATTR_IS_SEQ_LENS_CUMSUM, [1.0], r"is_seq_lens_cumsum must be an INT attribute .* got attribute type FLOATS"),
        (ATTR_IS_SEQ_LENS_CUMSUM, -1, r"is_seq_lens_cumsum must be 0/1 \(an INT attribute\), got -1"),
    ],
)
def test_attributes_of_the_wrong_type_or_value_are_refused_at_session_creation(name, value, pattern) -> None:
    """Issue 10.2: present with the wrong type or value is an error naming attribute, type and allowed values
    (it used to run as the default: a PA_NZ cache gathered as Norm)."""
    for backend in ("native", "golden"):
        model = plugin_model(torch.bfloat16, with_seq_offset=False, strict=False, **{name: value})
        with pytest.raises(ORT_ERRORS, match=pattern):
            runtime_plugin.make_session(model, backend=backend)


def test_missing_attributes_take_the_contract_defaults() -> None:
    case = random_case(44, dtype=torch.float16, cache_mode=CacheMode.NORM, is_seq_lens_cumsum=True)
    model = plugin_model_for(*case.inputs(), strict=False, cache_mode=None, is_seq_lens_cumsum=None)
    assert not model.graph.node[0].attribute
    session = runtime_plugin.make_session(model)
    out = runtime_plugin.run(session, feeds_for_case(case))
    assert bitwise_equal(out["key"], case.golden()[0]) and bitwise_equal(out["value"], case.golden()[1])


def _install_test_backend(monkeypatch, name, gather):
    module = types.ModuleType(f"pakv_test_backend_{name}")
    module.BACKEND = Backend(name=name, description="test", gather=gather)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(kernels.BACKEND_MODULES, name, module.__name__)


def test_python_exception_in_a_backend_becomes_an_ort_error_with_its_message(monkeypatch) -> None:
    calls = {"n": 0}

    def flaky(plan, tensors):
        calls["n"] += 1
        if calls["n"] % 2 == 1:
            raise RuntimeError(f"flaky backend failed on call {calls['n']}")
        kernels.get_backend("golden").gather(plan, tensors)

    _install_test_backend(monkeypatch, "flaky", flaky)
    case = base_case()
    session = runtime_plugin.make_session(model_for_case(case), backend="flaky")
    golden = case.golden()
    for call in range(1, 7):
        if call % 2:
            message = run_expecting_error(session, feeds_for_case(case))
            assert f"RuntimeError: flaky backend failed on call {call}" in message
        else:
            out = runtime_plugin.run(session, feeds_for_case(case))
            assert bitwise_equal(out["key"], golden[0]) and bitwise_equal(out["value"], golden[1])


def test_unavailable_backend_is_an_ort_error_naming_it(monkeypatch) -> None:
    module = types.ModuleType("pakv_test_backend_absent")
    module.BACKEND = Backend(
        name="absent",
        description="test",
        gather=lambda *a: None,
        unavailable_reason=lambda: "its package is not installed",
    )
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(kernels.BACKEND_MODULES, "absent", module.__name__)
    case = base_case()
    session = runtime_plugin.make_session(model_for_case(case), backend="absent")
    message = run_expecting_error(session, feeds_for_case(case))
    assert "backend 'absent' cannot run this call: its package is not installed" in message


# --- the API version handshake, with a fake OrtApiBase (no ORT involved) ----------------------
def test_runtimes_older_than_api_16_are_refused_with_a_clear_message() -> None:
    from pakv_onnx import native_lib

    lib = native_lib.load()
    messages = []
    create_status_t = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p)

    @create_status_t
    def create_status(code, msg):
        messages.append((code, msg.decode()))
        return 0xBAD

    fake = fake_ort({0: create_status}, api_version=13, version=b"1.13.1")  # a runtime with API 13 (ORT 1.13)
    status = register_custom_ops(lib, None, fake)
    assert status == 0xBAD
    assert fake.requested[0] == 16
    assert messages and "ONNX Runtime >= 1.16" in messages[0][1] and "1.13.1" in messages[0][1]
