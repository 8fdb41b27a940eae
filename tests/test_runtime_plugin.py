"""The ONNX Runtime plugin: one-node models run bit-exact against the golden, for every backend.

Every dtype x layout x seq_lens form x index dtypes x seq_offset presence, for the native C kernel
and the Python backends (reached through the ctypes callback), the seed sweep and its manual
shapes, and a process that only registers the library path (no ``import pakv_onnx``).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx_graphs import feeds_for_case, model_for_case

from pakv_onnx import kernels, runtime_plugin
from pakv_onnx.cases import random_case, seed_case, seed_cases
from pakv_onnx.spec import CACHE_DTYPES, OUTPUT_NAMES, CacheMode, bitwise_equal

BACKENDS = ("native", "golden", "torch")
# (block_tables, seq_lens, seq_offset): each input sees both index dtypes across the two combos.
INDEX_COMBOS = (
    (torch.int64, torch.int32, torch.int64),
    (torch.int32, torch.int64, torch.int32),
)


def assert_matches_golden(outputs: dict[str, torch.Tensor], case, label: str) -> None:
    key, value = case.golden()
    for name, expected in zip(OUTPUT_NAMES, (key, value)):
        got = outputs[name]
        assert got.dtype == expected.dtype, f"{label}: {name} dtype {got.dtype} != {expected.dtype}"
        assert bitwise_equal(got, expected), f"{label}: {name} differs from the golden ({case.summary()})"


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_dtype_layout_and_index_form_is_bit_exact(backend: str) -> None:
    sessions: dict[bytes, ort.InferenceSession] = {}
    checked = 0
    combos = itertools.product(CACHE_DTYPES, CacheMode, (True, False), INDEX_COMBOS, (True, False))
    for n, (dtype, mode, cumsum, index_dtypes, with_offset) in enumerate(combos):
        for repeat in range(1):
            case = random_case(
                1000 * n + repeat,
                dtype=dtype.torch_dtype,
                cache_mode=mode,
                is_seq_lens_cumsum=cumsum,
                index_dtypes=index_dtypes,
                with_seq_offset=with_offset,
            )
            model = model_for_case(case).SerializeToString()
            if model not in sessions:
                sessions[model] = runtime_plugin.make_session(model, backend=backend)
            outputs = runtime_plugin.run(sessions[model], feeds_for_case(case))
            assert_matches_golden(outputs, case, f"{backend} {case.case_id}")
            checked += 1
    assert checked == len(CACHE_DTYPES) * 2 * 2 * len(INDEX_COMBOS) * 2


def test_outputs_keep_bf16_and_fp8_dtypes_and_share_ort_memory() -> None:
    case = random_case(7, dtype=torch.float8_e5m2, cache_mode=CacheMode.PA_NZ)
    session = runtime_plugin.make_session(model_for_case(case))
    outputs = runtime_plugin.run(session, feeds_for_case(case))
    assert outputs["key"].dtype == torch.float8_e5m2
    # The result lives in ORT's output buffer (no copy) and stays valid after the binding is gone.
    del session
    assert_matches_golden(outputs, case, "fp8 after session release")


def test_a_wrong_backend_is_caught_through_ort(monkeypatch) -> None:
    """The bit-exact check can fail: the off-by-one test backend, run through the plugin."""
    monkeypatch.setitem(kernels.BACKEND_MODULES, "broken", "broken_backend")
    case = random_case(11, dtype=torch.bfloat16, cache_mode=CacheMode.NORM, with_seq_offset=False)
    while case.golden()[0].shape[0] < 3:
        case = random_case(int(case.case_id.split("-")[1]) + 1, dtype=torch.bfloat16)
    session = runtime_plugin.make_session(model_for_case(case), backend="broken")
    outputs = runtime_plugin.run(session, feeds_for_case(case))
    with pytest.raises(AssertionError, match="differs from the golden"):
        assert_matches_golden(outputs, case, "broken")


def test_two_sessions_in_one_process_use_different_backends(monkeypatch) -> None:
    monkeypatch.setitem(kernels.BACKEND_MODULES, "broken", "broken_backend")
    case = random_case(21, dtype=torch.float16, cache_mode=CacheMode.NORM, with_seq_offset=False)
    model = model_for_case(case)
    native = runtime_plugin.make_session(model, backend="native")
    broken = runtime_plugin.make_session(model, backend="broken")
    golden = runtime_plugin.make_session(model, backend="golden")
    for _ in range(2):  # interleaved: each session keeps its own backend
        assert_matches_golden(runtime_plugin.run(native, feeds_for_case(case)), case, "native")
        wrong = runtime_plugin.run(broken, feeds_for_case(case))
        assert not bitwise_equal(wrong["key"], case.golden()[0])
        assert_matches_golden(runtime_plugin.run(golden, feeds_for_case(case)), case, "golden")


def test_auto_prefers_native_without_an_npu() -> None:
    # pypto (if registered) is unavailable without an NPU, so auto stays in C.
    assert runtime_plugin.session_backend("auto") == "native"
    for seed in range(8):
        case = random_case(900 + seed)
        session = runtime_plugin.make_session(model_for_case(case), backend="auto")
        assert_matches_golden(runtime_plugin.run(session, feeds_for_case(case)), case, "auto")
    with pytest.raises(ValueError, match="unknown"):
        runtime_plugin.session_backend("no-such-backend")


def test_native_is_a_registry_backend_and_matches_the_golden() -> None:
    from pakv_onnx import gather_pa_kv_cache

    for seed in range(60):
        case = random_case(5000 + seed)
        key, value = gather_pa_kv_cache(*case.inputs(), **case.attributes(), backend="native")
        golden_key, golden_value = case.golden()
        assert bitwise_equal(key, golden_key) and bitwise_equal(value, golden_value), case.summary()
    assert kernels.resolve_backend("auto", _plan(random_case(1)), random_case(1).key_cache).name == "native"


def test_native_backend_writes_into_caller_outputs_without_copies() -> None:
    from pakv_onnx import gather_pa_kv_cache

    case = random_case(77, dtype=torch.bfloat16, cache_mode=CacheMode.NORM)
    golden_key, golden_value = case.golden()
    key_out, value_out = torch.empty_like(golden_key), torch.empty_like(golden_value)
    key, value = gather_pa_kv_cache(
        *case.inputs(), **case.attributes(), key_out=key_out, value_out=value_out, backend="native"
    )
    assert key.data_ptr() == key_out.data_ptr() and value.data_ptr() == value_out.data_ptr()
    assert bitwise_equal(key_out, golden_key) and bitwise_equal(value_out, golden_value)


def _plan(case):
    from pakv_onnx.validator import plan_gather

    return plan_gather(*case.inputs(), **case.attributes())


def test_native_reports_itself_unavailable_for_non_cpu_tensors() -> None:
    backend = kernels.get_backend("native")
    case = random_case(3)
    assert backend.unavailable_reason() is None
    meta = case.key_cache.to("meta")
    assert "CPU" in backend.unsupported_reason(_plan(case), meta)


@pytest.mark.slow
@pytest.mark.parametrize("case_id", [spec.case_id for spec in seed_cases()])
def test_seed_sweep_through_ort_is_bit_exact(case_id: str) -> None:
    """Each seed case is built once (812 MB caches) and run by every backend through ORT."""
    case = seed_case(case_id).build()
    expected = case.golden()
    model = model_for_case(case)
    for backend in ("native", "golden", "torch"):
        outputs = runtime_plugin.run(runtime_plugin.make_session(model, backend=backend), feeds_for_case(case))
        for name, want in zip(OUTPUT_NAMES, expected):
            assert bitwise_equal(outputs[name], want), f"{case_id} {backend} {name}"


STANDALONE = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto

    library, model_path, data_path = sys.argv[1:4]
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    session = ort.InferenceSession(model_path, options, providers=["CPUExecutionProvider"])
    data = np.load(data_path)
    feeds = {name: data[name] for name in ("block_tables", "seq_lens", "seq_offset")}
    for name in ("key_cache", "value_cache"):  # bf16 travels as its uint16 bits
        feeds[name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(data[name], TensorProto.BFLOAT16)
    binding = session.io_binding()
    for name, value in feeds.items():
        if isinstance(value, np.ndarray):
            value = ort.OrtValue.ortvalue_from_numpy(value)
        binding.bind_ortvalue_input(name, value)
    for name in ("key", "value"):
        binding.bind_output(name, "cpu")
    session.run_with_iobinding(binding)
    same = []
    for name, out in zip(("key", "value"), binding.get_outputs()):
        raw = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint16 * int(np.prod(out.shape()))).from_address(out.data_ptr()))
        same.append(out.data_type() == "tensor(bfloat16)" and bool((raw == data["expected_" + name].ravel()).all()))
    print(json.dumps({"same": same, "pakv_onnx_imported": any(m.startswith("pakv_onnx") for m in sys.modules)}))
    """
)


def test_library_works_standalone_without_pakv_onnx(tmp_path) -> None:
    case = random_case(31, dtype=torch.bfloat16, cache_mode=CacheMode.NORM, with_seq_offset=True)
    key, value = case.golden()
    model_path = tmp_path / "gather.onnx"
    model_path.write_bytes(model_for_case(case).SerializeToString())
    bits = {
        name: t.view(torch.int16).numpy().view(np.uint16)
        for name, t in (
            ("key_cache", case.key_cache),
            ("value_cache", case.value_cache),
            ("expected_key", key),
            ("expected_value", value),
        )
    }
    np.savez(
        tmp_path / "data.npz",
        block_tables=case.block_tables.numpy(),
        seq_lens=case.seq_lens.numpy(),
        seq_offset=case.seq_offset.numpy(),
        **bits,
    )
    script = tmp_path / "standalone.py"
    script.write_text(STANDALONE)
    result = subprocess.run(
        [sys.executable, str(script), runtime_plugin.library_path(), str(model_path), str(tmp_path / "data.npz")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"same": [True, True], "pakv_onnx_imported": False}
