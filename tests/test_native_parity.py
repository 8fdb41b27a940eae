"""Parity through the Python API (issue 13, the parts that pass through validator.plan_gather).

Every backend that reads caches through spec: pool views read in place, every dtype pair, any
non-negative offset (floor rule), through the front and the plugin's Python callback. The C-side
halves of the same rules run in tests/test_runtime_plugin_parity.py.
"""

from __future__ import annotations

import pytest
import torch
from per_token_reference import gather_per_token
from onnx_graphs import plugin_model_for
from test_runtime_plugin_parity import _pool_views, floor_case

from pakv_onnx import gather_pa_kv_cache, kernels, native_lib, runtime_plugin
from pakv_onnx.spec import CACHE_DTYPES, INPUT_NAMES, OUTPUT_NAMES, CacheMode, bitwise_equal
from pakv_onnx.validator import plan_gather


def assert_reference(key, value, inputs, attributes, label):
    want = gather_per_token(*inputs, **attributes)
    for name, got, expected in zip(OUTPUT_NAMES, (key, value), want):
        assert got.dtype == expected.dtype and bitwise_equal(got, expected), f"{label}: {name}"


@pytest.mark.parametrize("mode", list(CacheMode))
@pytest.mark.parametrize("backend", ["native", "auto"])
def test_pool_views_are_gathered_in_place_by_the_native_backend(monkeypatch, mode, backend) -> None:
    """``pool[:, 0]`` / ``pool[:, 1]`` through the public API: the C core gets the pool's own
    storage (no copy of the pool) and the result is bit-exact against the golden."""
    gen = torch.Generator().manual_seed(11)
    pool, key_view, value_view = _pool_views(mode, torch.bfloat16, gen)
    tables = torch.randint(0, pool.shape[0], (3, 6), generator=gen, dtype=torch.int32)
    seq_lens = torch.tensor([0, 7, 7, 16], dtype=torch.int32)
    args = (key_view, value_view, tables, seq_lens)
    seen = []
    real_gather = native_lib.run_gather

    def spy(plan_address, key_out, value_out):
        c_plan = native_lib.Plan.from_address(plan_address)
        seen.append((c_plan.key_cache, c_plan.value_cache))
        real_gather(plan_address, key_out, value_out)

    monkeypatch.setattr(native_lib, "run_gather", spy)
    key, value = gather_pa_kv_cache(*args, cache_mode=mode, backend=backend)
    assert seen == [(key_view.data_ptr(), value_view.data_ptr())]
    assert key_view.data_ptr() == pool.data_ptr()  # the pool's storage, not a copy
    golden = gather_pa_kv_cache(*args, cache_mode=mode, backend="golden")
    dense = gather_pa_kv_cache(key_view.contiguous(), value_view.contiguous(), tables, seq_lens, cache_mode=mode)
    assert bitwise_equal(key, golden[0]) and bitwise_equal(value, golden[1])
    assert bitwise_equal(key, dense[0]) and bitwise_equal(value, dense[1])
    plan = plan_gather(*args, cache_mode=mode)
    assert kernels.resolve_backend("auto", plan, key_view).name in ("native", "pypto")


def test_every_dtype_pair_through_the_native_python_backend() -> None:
    for n, (k, v) in enumerate((k, v) for k in CACHE_DTYPES for v in CACHE_DTYPES):
        mode = (CacheMode.NORM, CacheMode.PA_NZ)[n % 2]
        inputs, attributes = floor_case(500 + n, mode, bool(n % 2), k.torch_dtype, v.torch_dtype)
        key, value = gather_pa_kv_cache(*inputs, **attributes, backend="native")
        assert_reference(key, value, inputs, attributes, f"{k.name}/{v.name}")


@pytest.mark.parametrize("backend", ["golden", "torch"])
def test_mixed_dtypes_and_any_offset_through_the_python_callback(backend) -> None:
    """The ORT kernel's Python path (callback into spec + a Python backend): mixed dtypes and
    non-aligned offsets, each output in its cache's dtype."""
    sessions = {}
    pairs = [(torch.float8_e4m3fn, torch.bfloat16), (torch.bfloat16, torch.float16), (torch.int8, torch.float32)]
    for n, (kd, vd) in enumerate(pairs * 2):
        mode = (CacheMode.NORM, CacheMode.PA_NZ)[n % 2]
        inputs, attributes = floor_case(700 + n, mode, bool(n % 3), kd, vd)
        model = plugin_model_for(*inputs, **attributes).SerializeToString()
        if model not in sessions:
            sessions[model] = runtime_plugin.make_session(model, backend=backend)
        out = runtime_plugin.run(sessions[model], dict(zip(INPUT_NAMES, inputs)))
        assert_reference(out["key"], out["value"], inputs, attributes, f"{backend} {kd}/{vd}")


@pytest.mark.parametrize("mode", list(CacheMode))
def test_any_offset_through_the_native_python_backend(mode) -> None:
    for seed in range(30):
        inputs, attributes = floor_case(seed, mode, bool(seed % 2), torch.float16, torch.float16)
        key, value = gather_pa_kv_cache(*inputs, **attributes, backend="native")
        assert_reference(key, value, inputs, attributes, f"seed {seed}")
