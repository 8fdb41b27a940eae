"""Hardening of the C library (issue 10): each test failed against the library before the fix.

Races (block tables changed during a run, a raw registration racing a backend choice), one
domain per backend instead of one per registration, SessionOptions reuse, checked arithmetic on
extreme shapes ORT accepts, the pakv opset version, and exit with a Python-backend call in
flight. Scenarios that could crash run in a subprocess, so a crash fails the test instead of
killing pytest.
"""

from __future__ import annotations

import threading

import onnxruntime as ort
import pytest
import torch
from conftest import ORT_ERRORS, run_python
from onnx_graphs import feeds_for_case, model_for_case, plugin_model

from pakv_onnx import kernels, runtime_plugin
from pakv_onnx.cases import random_case
from pakv_onnx.spec import CacheMode, bitwise_equal


# --- 10.1 block tables changed while the kernel runs -------------------------------------------
RACE = """
import sys, threading, time
import numpy as np
import torch
from pakv_onnx import gather_pa_kv_cache, runtime_plugin
from onnx_graphs import plugin_model_for
from pakv_onnx.spec import bitwise_equal

mode, index_dtype, seconds = "{mode}", getattr(torch, "{index}"), 10.0
sys.setswitchinterval(1e-5)  # interleave the writer and the caller finely (the kernel runs without the GIL)
gen = torch.Generator().manual_seed(0)
nb, bs, q, per_seq = 64, 16, 8, 8
key_cache = torch.randint(-100, 100, (nb, bs, 4, 64), generator=gen, dtype=torch.int16).view(torch.bfloat16)
value_cache = torch.randint(-100, 100, (nb, bs, 4, 64), generator=gen, dtype=torch.int16).view(torch.bfloat16)
good = torch.randperm(nb, generator=gen)[: q * per_seq].reshape(q, per_seq).to(index_dtype)
tables = good.clone()
seq_lens = torch.arange(q + 1, dtype=torch.int64) * per_seq * bs
inputs = (key_cache, value_cache, tables, seq_lens)
expected = gather_pa_kv_cache(key_cache, value_cache, good, seq_lens, backend="golden")
huge = torch.full_like(good, 2**30)
raw, raw_good, raw_huge = tables.numpy(), good.numpy(), huge.numpy()
stop = False

def writer():  # flips every entry between its valid id and a wild one, as fast as numpy can
    while not stop:
        raw[...] = raw_huge
        raw[...] = raw_good

if mode == "ort":
    session = runtime_plugin.make_session(plugin_model_for(*inputs))
    feeds = dict(zip(("key_cache", "value_cache", "block_tables", "seq_lens"), inputs))  # bound in place
    def call():
        out = runtime_plugin.run(session, feeds)
        return out["key"], out["value"]
    shared = True
else:
    def call():
        return gather_pa_kv_cache(*inputs, backend="native")
    from pakv_onnx.validator import plan_gather
    # The C core races the writer only if the plan hands it the caller's table (not a copy).
    shared = plan_gather(*inputs).block_tables.data_ptr() == tables.data_ptr()

thread = threading.Thread(target=writer, daemon=True)
thread.start()
ok = refused = 0
start = time.perf_counter()
# Run `seconds`, longer (up to 6x) until the writer has raced a run once: on a loaded machine the
# writer may get no core during the short C windows for a while.
def keep_going():
    elapsed = time.perf_counter() - start
    return refused < 20 and (elapsed < seconds or (refused == 0 and elapsed < 6 * seconds))
while keep_going():
    try:
        key, value = call()
    except (RuntimeError, ValueError) as exc:
        assert "block_tables" in str(exc), str(exc)
        refused += 1
        continue
    assert bitwise_equal(key, expected[0]) and bitwise_equal(value, expected[1]), "accepted run with wrong rows"
    ok += 1
stop = True
thread.join()
print("ok", ok, "refused", refused, "shared", shared, flush=True)
assert refused > 0 or not shared, "the writer never raced the kernel (test did not exercise the race)"
"""


@pytest.mark.parametrize(
    ("mode", "index"), [("ort", "int32"), ("ort", "int64"), ("native", "int64")], ids=["ort-int32", "ort-int64", "py"]
)
def test_block_tables_changed_during_the_run_never_crash(mode: str, index: str) -> None:
    """A writer thread flips block ids between valid and 2**30 while the kernel runs: every run
    is refused naming block_tables or returns the right rows; never a crash (it used to SIGSEGV)."""
    result = run_python(RACE.format(mode=mode, index=index), timeout=300)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    assert "refused" in result.stdout


# --- 10.3 a raw registration racing a backend choice --------------------------------------------
class _RacingOptions:
    """SessionOptions whose registration is preceded by a raw registration on another thread
    (exactly the interleaving that used to hand our backend to the other registration)."""

    def __init__(self, options: ort.SessionOptions, raw: ort.SessionOptions) -> None:
        self._options, self._raw = options, raw

    def register_custom_ops_library(self, path: str) -> None:
        thread = threading.Thread(target=self._raw.register_custom_ops_library, args=(path,))
        thread.start()
        thread.join()
        self._options.register_custom_ops_library(path)

    def __getattr__(self, name):
        return getattr(self._options, name)


def test_a_raw_registration_in_between_cannot_take_the_chosen_backend(monkeypatch) -> None:
    monkeypatch.setitem(kernels.BACKEND_MODULES, "broken", "broken_backend")
    case = random_case(21, dtype=torch.float16, cache_mode=CacheMode.NORM, with_seq_offset=False)
    while case.golden()[0].shape[0] < 3:
        case = random_case(int(case.case_id.split("-")[1]) + 1, dtype=torch.float16, cache_mode=CacheMode.NORM)
    model = model_for_case(case).SerializeToString()
    options, raw = ort.SessionOptions(), ort.SessionOptions()
    runtime_plugin.register(_RacingOptions(options, raw), backend="broken")
    asked = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    other = ort.InferenceSession(model, raw, providers=["CPUExecutionProvider"])
    golden = case.golden()
    wrong = runtime_plugin.run(asked, feeds_for_case(case))
    assert not bitwise_equal(wrong["key"], golden[0]), "the session that asked for 'broken' ran another backend"
    right = runtime_plugin.run(other, feeds_for_case(case))
    assert bitwise_equal(right["key"], golden[0]) and bitwise_equal(right["value"], golden[1]), (
        "the raw registration (native) ran the backend chosen for another session"
    )


# --- 10.4 one domain per backend, not one per registration --------------------------------------
COUNT_DOMAINS = """
import ctypes
from fake_ort_api import fake_ort, register_custom_ops
from pakv_onnx import native_lib

lib = native_lib.load()
created = []
status_t = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p)
create_t = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p))
ok2_t = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
has_t = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int))
add_t = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p)
domain_memory = (ctypes.c_char * 64)()

@create_t
def create_domain(name, out):
    created.append(name)
    out[0] = ctypes.addressof(domain_memory)
    return None

funcs = {
    0: status_t(lambda code, msg: 0xBAD),
    26: create_domain,
    27: ok2_t(lambda domain, op: None),
    28: ok2_t(lambda options, domain: None),
    130: add_t(lambda options, key, value: None),
    237: has_t(lambda options, key, out: (out.__setitem__(0, 0), None)[1]),
}
fake = fake_ort(funcs, api_version=17)
options = (ctypes.c_char * 64)()
for _ in range(200):
    assert register_custom_ops(lib, ctypes.addressof(options), fake) is None
print("domains created", len(created), sorted(n.decode() for n in created))
"""


def test_registrations_reuse_one_domain_per_backend() -> None:
    """200 registrations (through a fake OrtApi that counts CreateCustomOpDomain) create the
    backend's two domains once (pakv's ops, com.microsoft's PagedAttention), not 200 times (each
    used to leak ~210 bytes)."""
    result = run_python(COUNT_DOMAINS)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "domains created 2 ['com.microsoft', 'pakv']\n" in result.stdout, result.stdout


# --- 10.5 one SessionOptions, several sessions ----------------------------------------------------
def test_one_session_options_makes_several_sessions() -> None:
    case = random_case(8, dtype=torch.bfloat16)
    model = model_for_case(case)
    golden = case.golden()
    options = ort.SessionOptions()
    first = runtime_plugin.make_session(model, sess_options=options)
    second = runtime_plugin.make_session(model, sess_options=options)
    for session in (first, second):
        out = runtime_plugin.run(session, feeds_for_case(case))
        assert bitwise_equal(out["key"], golden[0]) and bitwise_equal(out["value"], golden[1])
    assert runtime_plugin.registered_backend(options) == "native"
    with pytest.raises(ValueError, match="already registered for backend 'native'.*new onnxruntime.SessionOptions"):
        runtime_plugin.make_session(model, backend="golden", sess_options=options)


def test_a_raw_second_registration_on_the_same_options_is_refused_saying_why() -> None:
    options = ort.SessionOptions()
    options.register_custom_ops_library(runtime_plugin.library_path())
    with pytest.raises(ORT_ERRORS, match="already registered on these SessionOptions.*register it once"):
        options.register_custom_ops_library(runtime_plugin.library_path())


# --- 10.7 checked arithmetic on extreme shapes ORT accepts ---------------------------------------
_BUFFER = torch.zeros(64, dtype=torch.int64)  # backs every zero-element input below


INT64_INDICES = (torch.int64, torch.int64)


def _run_shapes(model, shapes: dict[str, tuple[int, list[int]]]) -> list[tuple[int, ...]]:
    """Run ``model`` on zero-element inputs of the given (ONNX type, shape); the output shapes."""
    session = runtime_plugin.make_session(model)
    binding = session.io_binding()
    for name, (onnx_type, shape) in shapes.items():
        binding.bind_input(name, "cpu", 0, onnx_type, shape, _BUFFER.data_ptr())
    for output in session.get_outputs():
        binding.bind_output(output.name, "cpu")
    session.run_with_iobinding(binding)
    return [tuple(v.shape()) for v in binding.get_outputs()]


def test_pa_nz_bytes_per_token_overflow_is_an_error_not_an_empty_output() -> None:
    """A zero-block PA_NZ cache [0, 2**62, 1, 16] (bf16) has 2**66 elements per token: the output
    shape used to wrap to [0, 0]; now an error naming the cache."""
    model = plugin_model(torch.bfloat16, index_dtypes=INT64_INDICES, with_seq_offset=False, cache_mode="PA_NZ")
    shapes = {
        "key_cache": (16, [0, 2**62, 1, 16]),
        "value_cache": (16, [0, 1, 1, 16]),
        "block_tables": (7, [1, 0]),
        "seq_lens": (7, [2]),
    }
    with pytest.raises(ORT_ERRORS, match=r"key_cache: bytes per token .* overflow int64"):
        _run_shapes(model, shapes)
    shapes["key_cache"] = (16, [0, 2**20, 1, 16])  # large but representable: a valid empty gather
    assert _run_shapes(model, shapes) == [(0, 2**24), (0, 16)]


def test_norm_bytes_per_token_overflow_is_an_error() -> None:
    model = plugin_model(torch.bfloat16, index_dtypes=INT64_INDICES, with_seq_offset=False)
    shapes = {
        "key_cache": (16, [0, 1, 2**32, 2**32]),
        "value_cache": (16, [0, 1, 1, 1]),
        "block_tables": (7, [1, 0]),
        "seq_lens": (7, [2]),
    }
    with pytest.raises(ORT_ERRORS, match=r"key_cache: bytes per token .* overflow int64"):
        _run_shapes(model, shapes)


# --- also: the pakv opset version -------------------------------------------------------------------
@pytest.mark.parametrize("version", [2, 1000])
def test_a_pakv_opset_other_than_1_is_refused(version: int) -> None:
    from onnx import helper

    case = random_case(4, dtype=torch.bfloat16)
    model = model_for_case(case)
    for opset in model.opset_import:
        if opset.domain == "pakv":
            opset.version = version
    assert helper  # onnx is imported for the model edit
    with pytest.raises(ValueError, match=f"opset 'pakv' version {version}; .* implements only version 1"):
        runtime_plugin.make_session(model)
    with pytest.raises(ValueError, match=f"version {version}"):
        runtime_plugin.make_session(model.SerializeToString())
    model_ok = model_for_case(case)
    out = runtime_plugin.run(runtime_plugin.make_session(model_ok), feeds_for_case(case))
    assert bitwise_equal(out["key"], case.golden()[0])


# --- 10.9 exit with a Python-backend call in flight ---------------------------------------------
SLOW_EXIT = """
import threading, time, sys, types
import torch
from pakv_onnx import kernels, runtime_plugin
from pakv_onnx.kernels import Backend
from pakv_onnx.cases import random_case
from onnx_graphs import feeds_for_case, model_for_case

def slow(plan, tensors):
    time.sleep({sleep})  # still inside Python when the main thread exits
    kernels.get_backend("golden").gather(plan, tensors)
    print("slow call finished", flush=True)

module = types.ModuleType("slow_backend")
module.BACKEND = Backend(name="slow", description="test", gather=slow)
sys.modules["slow_backend"] = module
kernels.BACKEND_MODULES["slow"] = "slow_backend"
case = random_case(5, dtype=torch.bfloat16)
session = runtime_plugin.make_session(model_for_case(case), backend="slow")
feeds = feeds_for_case(case)
thread = threading.Thread(target=lambda: runtime_plugin.run(session, feeds), daemon=True)
thread.start()
time.sleep(0.5)
print("main done", flush=True)
"""


SLOW_OUTPUTS = """
real_view = runtime_plugin.view

def slow_view(*args, **kwargs):  # the run's own work after session.run returned, the GIL dropped meanwhile
    time.sleep(1.0)
    print("outputs viewed", flush=True)
    return real_view(*args, **kwargs)

runtime_plugin.view = slow_view
"""


def test_exit_waits_for_a_run_still_turning_its_outputs_into_tensors() -> None:
    """The backend call has returned and session.run with it, but the thread is still in
    runtime_plugin.run (its outputs' torch views; a C++ call there that drops the GIL is where a daemon
    thread is ended by pthread_exit and aborts the process). The exit waits for the run to finish: before,
    it looked at the thread's innermost frame only and went on (the view never finished)."""
    script = SLOW_EXIT.format(sleep=0.1).replace("case = random_case", SLOW_OUTPUTS + "case = random_case")
    result = run_python(script, timeout=120)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-2000:]}"
    assert "main done" in result.stdout and "outputs viewed" in result.stdout, result.stdout


def test_exit_with_a_python_backend_call_in_flight_is_clean() -> None:
    """A daemon thread is inside a Python backend for 7 s when the interpreter exits: the exit
    waits for the call and ends with status 0 (it used to abort, SIGABRT, after a 5 s wait)."""
    result = run_python(SLOW_EXIT.format(sleep=7.0), timeout=120)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-2000:]}"
    assert "main done" in result.stdout and "slow call finished" in result.stdout
    assert "waiting for 1 Python-backend call(s) in flight" in result.stderr
