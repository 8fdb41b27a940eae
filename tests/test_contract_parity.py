"""AscendC parity on the Python side (issue 13): the floor rule for seq_offset, mixed key/value
dtypes and caches that are views of a larger pool, on every Python backend, against the
independent per-token reference. (The stock-ORT fallback's share is in test_export_fallback.py.)"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from conftest import as_pool_views, assert_matches_reference, reference_outputs, unaligned_offsets, with_value_dtype

import pakv_onnx
from pakv_onnx import golden, kernels
from pakv_onnx.cases import random_cache, random_case
from pakv_onnx.kernels import BackendUnavailableError
from pakv_onnx.spec import CACHE_DTYPES, CacheMode, bitwise_equal

def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


FORMS = list(itertools.product(list(CacheMode), (True, False)))
FORM_IDS = [f"{m.value}-{'cumsum' if c else 'lengths'}" for m, c in FORMS]


# --------------------------------------------------------------------------- #
# 13.1 the floor rule
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("backend", ["golden", "torch", "native"])
@pytest.mark.parametrize("mode, is_cumsum", FORMS, ids=FORM_IDS)
def test_unaligned_seq_offset_matches_per_token_reference(backend: str, mode: CacheMode, is_cumsum: bool) -> None:
    for seed in range(8):
        base = random_case(2000 + seed, cache_mode=mode, is_seq_lens_cumsum=is_cumsum, with_seq_offset=seed % 4 != 0)
        case = unaligned_offsets(base, seed)
        assert_matches_reference(case, backend, caller_outputs=seed % 2 == 0)


def test_floor_rule_reads_slot_0_of_the_floored_column() -> None:
    """Hand-checked: bs = 4, seq_offset 6 -> column 1 (not column 1 slot 2); token 0 is block 7 slot 0."""
    cache = torch.arange(8 * 4, dtype=torch.int32).reshape(8, 4, 1, 1)
    tables = torch.tensor([[5, 7, 2]], dtype=torch.int32)
    key, _ = pakv_onnx.gather_pa_kv_cache(
        cache, cache, tables, torch.tensor([0, 5]), torch.tensor([6]), backend="golden"
    )
    assert key.flatten().tolist() == [28, 29, 30, 31, 8]  # block 7 slots 0-3, then block 2 slot 0


def test_offset_remainder_needs_no_extra_table_column() -> None:
    """seq_offset 7 with bs 4 and 4 tokens uses only column 1 (floor), so a 2-column row is enough."""
    cache = torch.arange(3 * 4, dtype=torch.int16).reshape(3, 4, 1, 1)
    key, _ = pakv_onnx.gather_pa_kv_cache(
        cache, cache, torch.tensor([[9, 2]]), torch.tensor([0, 4]), torch.tensor([7]), backend="torch"
    )
    assert key.flatten().tolist() == [8, 9, 10, 11]


# --------------------------------------------------------------------------- #
# 13.2 mixed key/value dtypes
# --------------------------------------------------------------------------- #
# Every pair AscendC 950 names (float8 key, bf16/fp16 value) plus pairs across widths.
MIXED_PAIRS = [
    (torch.float8_e4m3fn, torch.bfloat16),
    (torch.float8_e5m2, torch.float16),
    (torch.float8_e4m3fn, torch.float16),
    (torch.float8_e5m2, torch.bfloat16),
    (torch.bfloat16, torch.int8),
    (torch.int8, torch.float32),
    (torch.uint16, torch.uint8),
]


@pytest.mark.parametrize("backend", ["golden", "torch"])
@pytest.mark.parametrize("key_dtype, value_dtype", MIXED_PAIRS, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("mode", list(CacheMode), ids=[m.value for m in CacheMode])
def test_mixed_dtypes_match_per_token_reference(
    backend: str, key_dtype: torch.dtype, value_dtype: torch.dtype, mode: CacheMode
) -> None:
    for seed in range(4):
        base = random_case(2100 + seed, dtype=key_dtype, cache_mode=mode)
        case = unaligned_offsets(with_value_dtype(base, value_dtype, seed), seed)
        assert (case.key_cache.dtype, case.value_cache.dtype) == (key_dtype, value_dtype)
        assert_matches_reference(case, backend, caller_outputs=seed == 1)
        key, value = pakv_onnx.gather_pa_kv_cache(*case.inputs(), **case.attributes(), backend=backend)
        assert (key.dtype, value.dtype) == (key_dtype, value_dtype)


def test_every_dtype_pair_is_accepted_and_gathered() -> None:
    base = random_case(2200, cache_mode=CacheMode.NORM, dtype=torch.int8)
    for key_d, value_d in itertools.product(CACHE_DTYPES, repeat=2):
        case = with_value_dtype(base, value_d.torch_dtype, 2)
        case = dataclasses.replace(case, key_cache=random_cache(tuple(base.key_cache.shape), key_d.torch_dtype, gen(3)))
        plan = pakv_onnx.plan_gather(*case.inputs(), **case.attributes())
        assert (plan.key_dtype, plan.value_dtype) == (key_d.torch_dtype, value_d.torch_dtype)
        assert_matches_reference(case, "torch")


# --------------------------------------------------------------------------- #
# 13.3 pool views
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("backend", ["golden", "torch"])
@pytest.mark.parametrize("pad", [0, 1, 16], ids=["stride-whole-rows", "stride-odd", "stride-padded"])
@pytest.mark.parametrize("mode", list(CacheMode), ids=[m.value for m in CacheMode])
def test_pool_views_match_per_token_reference(backend: str, pad: int, mode: CacheMode) -> None:
    for seed in range(5):
        case = as_pool_views(unaligned_offsets(random_case(2300 + seed, cache_mode=mode), seed), pad=pad)
        nb = case.key_cache.shape[0]
        assert nb < 2 or not case.key_cache.is_contiguous()
        assert_matches_reference(case, backend, caller_outputs=seed % 2 == 1)


def _shares_storage(tensor: torch.Tensor, pool_view: torch.Tensor) -> bool:
    return tensor.untyped_storage().data_ptr() == pool_view.untyped_storage().data_ptr()


def test_torch_backend_indexes_the_pool_itself(monkeypatch) -> None:
    """The torch backend's index_select reads the pool's storage: no copy of the pool is made."""
    case = as_pool_views(random_case(2400, cache_mode=CacheMode.NORM, max_blocks=8), pad=0)
    pools = (case.key_cache, case.value_cache)
    sources = []
    real = torch.index_select

    def spy(source, dim, index, *, out=None):
        sources.append(source)
        return real(source, dim, index, out=out)

    monkeypatch.setattr(torch, "index_select", spy)
    got = pakv_onnx.gather_pa_kv_cache(*case.inputs(), **case.attributes(), backend="torch")
    monkeypatch.undo()
    want = reference_outputs(case)
    assert bitwise_equal(got[0], want[0]) and bitwise_equal(got[1], want[1])
    if int(case.seq_lens[-1] if case.is_seq_lens_cumsum else case.seq_lens.sum()):
        assert len(sources) == 2
        assert all(_shares_storage(src, pool) for src, pool in zip(sources, pools)), "the pool was copied"


def test_golden_reads_blocks_of_the_pool_itself(monkeypatch) -> None:
    case = as_pool_views(random_case(2401, cache_mode=CacheMode.PA_NZ, max_blocks=8), pad=3)
    pools = {case.key_cache.data_ptr(): case.key_cache, case.value_cache.data_ptr(): case.value_cache}
    seen = []
    real = golden._block_rows

    def spy(cache, mode, block, rows):
        seen.append(cache)
        return real(cache, mode, block, rows)

    monkeypatch.setattr(golden, "_block_rows", spy)
    pakv_onnx.gather_pa_kv_cache(*case.inputs(), **case.attributes(), backend="golden")
    assert seen and all(c.data_ptr() in pools and _shares_storage(c, pools[c.data_ptr()]) for c in seen)


def test_backend_that_cannot_read_pool_views_is_refused_by_name_and_auto_skips_it(monkeypatch) -> None:
    case = as_pool_views(random_case(2402, cache_mode=CacheMode.NORM), pad=0)
    monkeypatch.setitem(kernels.BACKEND_MODULES, "contiguous_only", "broken_backend")  # reads_pool_views=False
    with pytest.raises(BackendUnavailableError, match=r"backend 'contiguous_only' cannot run this call: it reads "
                       r"contiguous caches only, and key_cache is a pool view \(block stride \d+ elements"):
        pakv_onnx.gather_pa_kv_cache(*case.inputs(), **case.attributes(), backend="contiguous_only")
    plan = pakv_onnx.plan_gather(*case.inputs(), **case.attributes())
    chosen = kernels.resolve_backend("auto", plan, case.key_cache, case.value_cache)
    assert chosen.reads_pool_views
    got = pakv_onnx.gather_pa_kv_cache(*case.inputs(), **case.attributes())  # auto
    want = reference_outputs(case)
    assert bitwise_equal(got[0], want[0]) and bitwise_equal(got[1], want[1])


def test_value_cache_alone_strided_is_seen() -> None:
    """The refusal looks at both caches, not only key_cache."""
    case = random_case(2403, cache_mode=CacheMode.NORM)
    case = dataclasses.replace(case, value_cache=as_pool_views(case).value_cache)
    plan = pakv_onnx.plan_gather(*case.inputs(), **case.attributes())
    backend = kernels.get_backend("golden")
    assert backend.refusal(plan, (case.key_cache, case.value_cache)) is None
    contiguous_only = kernels.Backend(name="c", description="c", gather=backend.gather)
    reason = contiguous_only.refusal(plan, (case.key_cache, case.value_cache))
    assert reason is not None and "value_cache is a pool view" in reason


def test_backend_without_mixed_dtypes_is_refused_by_name() -> None:
    case = with_value_dtype(random_case(2404, dtype=torch.float8_e4m3fn, cache_mode=CacheMode.NORM), torch.bfloat16, 1)
    plan = pakv_onnx.plan_gather(*case.inputs(), **case.attributes())
    one_dtype = kernels.Backend(name="one_dtype", description="d", gather=kernels.get_backend("golden").gather)
    reason = one_dtype.refusal(plan, (case.key_cache, case.value_cache))
    assert reason == (
        "it takes one element type for both caches, and key_cache is torch.float8_e4m3fn while value_cache is "
        "torch.bfloat16"
    )
    assert kernels.resolve_backend("auto", plan, case.key_cache, case.value_cache).mixed_dtypes
