"""The seed's network sweep and manual shapes: generation rule, golden and backends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from per_token_reference import gather_per_token

import pakv_onnx
from pakv_onnx.cases import even_split, seed_case, seed_cases
from pakv_onnx.spec import bitwise_equal

SHARED_SWEEP = Path(__file__).resolve().parents[2] / "shared" / "cases" / "seed_sweep.json"


def test_twelve_cases_in_sweep_order() -> None:
    ids = [s.case_id for s in seed_cases()]
    assert ids == [f"level{i}" for i in range(10)] + ["heads1_k128_v64", "heads64_k128_v128"]


def test_packaged_sweep_is_complete_and_matches_shared_copy() -> None:
    """The package ships a copy of shared/cases/seed_sweep.json: complete, and equal to the shared
    file wherever that is laid beside the checkout (development machines and CI)."""
    from importlib import resources

    packaged = json.loads(resources.files("pakv_onnx").joinpath("data/seed_sweep.json").read_text())
    fields = {"id", "seed", "key_cache_shape", "value_cache_shape", "block_table_cols", "q_count", "total_tokens"}
    assert len(packaged["cases"]) == 10 and len(packaged["manual"]) == 2
    assert all(fields <= set(case) for case in packaged["cases"] + packaged["manual"])
    if SHARED_SWEEP.exists():
        assert packaged == json.loads(SHARED_SWEEP.read_text())


def test_even_split_gives_extra_tokens_to_the_first() -> None:
    assert even_split(27, 4) == [7, 7, 7, 6]
    assert even_split(44, 3) == [15, 15, 14]
    assert even_split(6, 4) == [2, 2, 1, 1]


def test_generation_rule_level1() -> None:
    case = seed_case("level1").build()
    assert case.block_tables.dtype == torch.int32 and case.block_tables.shape == (4, 8)
    assert case.seq_lens.tolist() == [0, 7, 14, 21, 27] and case.seq_lens.dtype == torch.int32
    assert case.seq_offset.tolist() == [0, 0, 0, 0]
    assert case.block_tables.tolist() == [[0] + [0] * 7, [1] + [0] * 7, [2] + [0] * 7, [3] + [0] * 7]
    generator = torch.Generator().manual_seed(101)
    # torch's CPU normal sampler draws in groups of 16, so the first 16 values of any
    # larger draw equal a draw of exactly 16 from the same seed.
    first = torch.randn(16, generator=generator).to(torch.bfloat16)
    assert bitwise_equal(case.key_cache.flatten()[:16], first)
    assert case.key_cache.dtype == torch.bfloat16 and tuple(case.value_cache.shape) == (5513, 128, 1, 64)


def test_generation_rule_is_deterministic() -> None:
    a, b = seed_case("heads1_k128_v64").build(), seed_case("heads1_k128_v64").build()
    assert bitwise_equal(a.key_cache, b.key_cache) and bitwise_equal(a.value_cache, b.value_cache)


@pytest.mark.parametrize("case_id", [s.case_id for s in seed_cases()])
def test_seed_case_golden_and_backends(case_id: str) -> None:
    case = seed_case(case_id).build()
    golden_key, golden_value = case.golden()
    want_key, want_value = gather_per_token(*case.inputs(), cache_mode="Norm", is_seq_lens_cumsum=True)
    assert bitwise_equal(golden_key, want_key) and bitwise_equal(golden_value, want_value)
    spec = seed_case(case_id)
    assert golden_key.shape == (spec.total_tokens, *spec.key_cache_shape[2:])
    # pypto-cpu runs PyPTO's interpreter, which copies its inputs about 24x: these 812 MB caches
    # would take ~20 GB and minutes each. It runs every seed case at 64 blocks in verify-kernel
    # (tests/test_pypto_kernel.py) and through ORT in tests/test_pypto_cpu.py.
    for backend in pakv_onnx.backend_names():
        if backend in ("golden", "pypto-cpu"):
            continue
        try:
            key, value = pakv_onnx.gather_pa_kv_cache(*case.inputs(), **case.attributes(), backend=backend)
        except pakv_onnx.BackendUnavailableError:
            continue  # e.g. pypto without an NPU: covered by its own tests
        assert bitwise_equal(key, golden_key), f"{backend}: key differs on {case_id}"
        assert bitwise_equal(value, golden_value), f"{backend}: value differs on {case_id}"
