"""The golden and the torch backend against an independent per-token reference (tests/conftest.py)."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import assert_matches_reference
from per_token_reference import gather_per_token

import pakv_onnx
from pakv_onnx.cases import GatherCase, random_case
from pakv_onnx.spec import CACHE_DTYPES, CacheMode, bitwise_equal

BACKENDS = ("golden", "torch")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [d.torch_dtype for d in CACHE_DTYPES], ids=[d.name for d in CACHE_DTYPES])
@pytest.mark.parametrize("cache_mode", list(CacheMode), ids=[m.value for m in CacheMode])
def test_every_dtype_and_layout(backend: str, dtype: torch.dtype, cache_mode: CacheMode) -> None:
    for seed in range(6):
        case = random_case(seed, dtype=dtype, cache_mode=cache_mode)
        assert_matches_reference(case, backend, caller_outputs=seed % 2 == 1)


INDEX_COMBOS = list(itertools.product((torch.int32, torch.int64), repeat=3))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("is_cumsum", [True, False], ids=["cumsum", "lengths"])
@pytest.mark.parametrize("with_offset", [True, False], ids=["offset", "no-offset"])
@pytest.mark.parametrize("index_dtypes", INDEX_COMBOS, ids=lambda c: "-".join(str(d)[-5:] for d in c))
def test_index_forms(backend: str, is_cumsum: bool, with_offset: bool, index_dtypes: tuple) -> None:
    for seed in range(3):
        case = random_case(
            100 + seed, is_seq_lens_cumsum=is_cumsum, with_seq_offset=with_offset, index_dtypes=index_dtypes
        )
        assert_matches_reference(case, backend, caller_outputs=seed == 0)


def _norm_case(lengths: list[int], block_size: int, num_blocks: int, tables: list[list[int]], **kw) -> GatherCase:
    gen = torch.Generator().manual_seed(len(lengths) * 31 + block_size)
    return GatherCase(
        case_id="edge",
        description="edge",
        key_cache=torch.randn(num_blocks, block_size, 2, 3, generator=gen).to(torch.bfloat16),
        value_cache=torch.randn(num_blocks, block_size, 1, 5, generator=gen).to(torch.bfloat16),
        block_tables=torch.tensor(tables, dtype=torch.int32).reshape(len(lengths), -1),
        seq_lens=torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32),
        seq_offset=kw.get("seq_offset"),
    )


EDGE_CASES = {
    "zero-length-sequences": _norm_case([0, 5, 0, 3], 4, 6, [[9, 9], [2, 4], [9, 9], [1, 9]]),
    "T=0": _norm_case([0, 0], 4, 2, [[-1], [99]]),
    "Q=1": _norm_case([7], 4, 3, [[2, 0]]),
    "single-block": _norm_case([3], 4, 1, [[0]]),
    "full-last-block": _norm_case([8, 4], 4, 4, [[3, 1], [2, 77]]),
    "partial-tail-block": _norm_case([9, 1], 4, 5, [[4, 0, 2], [1, -3, -3]]),
    "repeated-block": _norm_case([6, 6], 3, 2, [[1, 1], [1, 0]]),
    "offset-skips-junk-columns": _norm_case(
        [5, 2], 2, 4, [[-9, 3, 2, 0], [77, 77, 77, 1]], seq_offset=torch.tensor([2, 6], dtype=torch.int64)
    ),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_edge_shapes(backend: str, name: str) -> None:
    assert_matches_reference(EDGE_CASES[name], backend)
    assert_matches_reference(EDGE_CASES[name], backend, caller_outputs=True)


def test_zero_tokens_gives_empty_outputs() -> None:
    key, value = pakv_onnx.gather_pa_kv_cache(*EDGE_CASES["T=0"].inputs(), backend="golden")
    assert key.shape == (0, 2, 3) and value.shape == (0, 1, 5)


def test_pa_nz_output_is_flat_heads_times_dim() -> None:
    case = random_case(3, dtype=torch.int8, cache_mode=CacheMode.PA_NZ)
    key, _ = pakv_onnx.gather_pa_kv_cache(*case.inputs(), **case.attributes(), backend="torch")
    assert key.dim() == 2 and key.shape[1] == case.key_cache.shape[1] * 32


def test_reference_detects_a_wrong_gather() -> None:
    """The comparison can fail: a gather that reads the next slot is caught."""
    case = EDGE_CASES["partial-tail-block"]
    key, _ = pakv_onnx.gather_pa_kv_cache(*case.inputs(), backend="golden")
    shifted = torch.roll(case.key_cache, shifts=1, dims=1)
    want_key, _ = gather_per_token(
        shifted, case.value_cache, case.block_tables, case.seq_lens, None, cache_mode="Norm", is_seq_lens_cumsum=True
    )
    assert not bitwise_equal(key, want_key)
