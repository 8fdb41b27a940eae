"""Parity with AscendC's contract in the C library (issue 13, C side), checked without spec:

* the floor rule: any non-negative seq_offset, first column ``seq_offset // block_size``, slot 0;
* key and value caches of different dtypes: every pair of contract dtypes runs through ORT, each
  output in its own cache's dtype; a dtype outside the contract is refused at session creation,
  named;
* caches that are views of one pool (``pool[:, 0]`` / ``pool[:, 1]`` of ``[nb, 2, bs, ...]``):
  the C core reads them in place by block stride, no copy of the pool.

Expected outputs come from the independent per-token reference (tests/per_token_reference.py) or
from the golden on dense copies, always compared bit-exact.
"""

from __future__ import annotations

import ctypes
import random

import pytest
import torch
from conftest import ORT_ERRORS
from onnx_graphs import plugin_model, plugin_model_for
from per_token_reference import gather_per_token

from pakv_onnx import golden, native_lib, runtime_plugin
from pakv_onnx.kernels import native
from pakv_onnx.plans import GatherTensors
from pakv_onnx.spec import (
    CACHE_DTYPES,
    INPUT_NAMES,
    OUTPUT_NAMES,
    CacheMode,
    bitwise_equal,
    block_size_axis,
    nz_last_dim,
)
from pakv_onnx.validator import plan_gather

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def random_cache(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (every bit pattern, NaNs included)."""
    bits = _BITS[dtype.itemsize]
    info = torch.iinfo(bits)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=bits).view(dtype)


def floor_case(seed: int, mode: CacheMode, cumsum: bool, key_dtype: torch.dtype, value_dtype: torch.dtype):
    """Raw inputs with seq_offset anywhere (not multiples of block_size) and every table entry valid.

    Returns (inputs tuple in the contract's order, attributes dict).
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    nb, bs, q = rng.randint(1, 12), rng.randint(1, 6), rng.randint(1, 5)
    heads, dim = rng.randint(1, 3), rng.randint(1, 4)

    def cache(dtype):
        if mode is CacheMode.NORM:
            return random_cache((nb, bs, heads, dim), dtype, gen)
        e = nz_last_dim(dtype.itemsize)
        return random_cache((nb, rng.randint(1, 3), bs, e), dtype, gen)

    key_cache, value_cache = cache(key_dtype), cache(value_dtype)
    lengths = [rng.randint(0, 3 * bs) for _ in range(q)]
    offsets = [rng.randint(0, 4 * bs) for _ in range(q)]  # any offset: remainders included
    cols = max(off // bs + -(-n // bs) for off, n in zip(offsets, lengths)) + rng.randint(0, 2)
    tables = torch.randint(0, nb, (q, max(cols, 1)), generator=gen, dtype=rng.choice((torch.int32, torch.int64)))
    if cumsum:
        seq_lens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    else:
        seq_lens = torch.tensor(lengths, dtype=torch.int64)
    seq_offset = torch.tensor(offsets, dtype=rng.choice((torch.int32, torch.int64)))
    inputs = (key_cache, value_cache, tables, seq_lens.to(rng.choice((torch.int32, torch.int64))), seq_offset)
    return inputs, {"cache_mode": mode.value, "is_seq_lens_cumsum": cumsum}


def run_native_ort(inputs, attributes, sessions: dict) -> dict[str, torch.Tensor]:
    model = plugin_model_for(*inputs, **attributes).SerializeToString()
    if model not in sessions:
        sessions[model] = runtime_plugin.make_session(model, backend="native")
    return runtime_plugin.run(sessions[model], dict(zip(INPUT_NAMES, inputs)))


def assert_matches_reference(outputs, inputs, attributes, label: str) -> None:
    expected = gather_per_token(*inputs, **attributes)
    for name, want in zip(OUTPUT_NAMES, expected):
        assert outputs[name].dtype == want.dtype, f"{label}: {name} dtype {outputs[name].dtype} != {want.dtype}"
        assert bitwise_equal(outputs[name], want), f"{label}: {name} differs from the per-token reference"


@pytest.mark.parametrize("mode", list(CacheMode))
@pytest.mark.parametrize("cumsum", [True, False], ids=["cumsum", "lengths"])
def test_any_seq_offset_takes_the_floor_column_through_ort(mode: CacheMode, cumsum: bool) -> None:
    sessions: dict = {}
    remainders = 0
    for seed in range(40):
        inputs, attributes = floor_case(seed, mode, cumsum, torch.bfloat16, torch.bfloat16)
        bs = inputs[0].shape[block_size_axis(mode)]
        remainders += int((inputs[4] % bs != 0).any())
        outputs = run_native_ort(inputs, attributes, sessions)
        assert_matches_reference(outputs, inputs, attributes, f"seed {seed}")
    assert remainders > 10  # the cases really use offsets that are not multiples of block_size


def test_negative_seq_offset_is_still_refused_naming_it() -> None:
    inputs, attributes = floor_case(3, CacheMode.NORM, True, torch.float16, torch.float16)
    offsets = inputs[4].clone()
    offsets[0] = -1
    with pytest.raises(ORT_ERRORS, match=r"seq_offset must be non-negative, got seq_offset\[0\] = -1"):
        run_native_ort((*inputs[:4], offsets), attributes, {})


def test_every_pair_of_key_and_value_dtypes_runs_through_ort() -> None:
    """All 11 x 11 pairs of contract dtypes (Norm and PA_NZ alternating), each output in its own
    cache's dtype, bit-exact against the per-token reference."""
    sessions: dict = {}
    pairs = [(k, v) for k in CACHE_DTYPES for v in CACHE_DTYPES]
    for n, (key_dtype, value_dtype) in enumerate(pairs):
        mode = (CacheMode.NORM, CacheMode.PA_NZ)[n % 2]
        inputs, attributes = floor_case(100 + n, mode, bool(n % 3), key_dtype.torch_dtype, value_dtype.torch_dtype)
        outputs = run_native_ort(inputs, attributes, sessions)
        assert_matches_reference(outputs, inputs, attributes, f"{key_dtype.name}/{value_dtype.name} {mode.value}")
    assert len(sessions) == len(pairs)  # one session per pair: each pair has its own kernel


@pytest.mark.parametrize("position", INPUT_NAMES[:2])
@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.bool])
def test_a_cache_dtype_outside_the_contract_is_refused_at_session_creation_naming_it(position, dtype) -> None:
    key_dtype, value_dtype = (dtype, torch.bfloat16) if position == INPUT_NAMES[0] else (torch.bfloat16, dtype)
    model = plugin_model(key_dtype, value_dtype=value_dtype, with_seq_offset=False, strict=False)
    for backend in ("native", "golden"):
        with pytest.raises(ORT_ERRORS, match=position):
            runtime_plugin.make_session(model, backend=backend)


# --- pool views in the C core -----------------------------------------------------------------------
def _pool_views(mode: CacheMode, dtype: torch.dtype, gen: torch.Generator):
    """A K/V pool ``[nb, 2, ...block...]`` and its two strided views (no copy)."""
    nb, bs = 9, 4
    block = (bs, 3, 8) if mode is CacheMode.NORM else (2, bs, nz_last_dim(dtype.itemsize))
    pool = random_cache((nb, 2, *block), dtype, gen)
    return pool, pool[:, 0], pool[:, 1]


@pytest.mark.parametrize("mode", list(CacheMode))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32], ids=str)
def test_native_backend_gathers_pool_views_in_place(monkeypatch, mode: CacheMode, dtype: torch.dtype) -> None:
    """The native backend hands the C core the views' own addresses (the pool's storage) and
    block strides; the result is bit-exact against the golden on dense copies."""
    gen = torch.Generator().manual_seed(7)
    pool, key_view, value_view = _pool_views(mode, dtype, gen)
    assert not key_view.is_contiguous()
    key_dense, value_dense = key_view.contiguous(), value_view.contiguous()
    tables = torch.randint(0, pool.shape[0], (3, 5), generator=gen, dtype=torch.int64)
    seq_lens = torch.tensor([0, 7, 7, 15], dtype=torch.int64)
    dense_plan = plan_gather(key_dense, value_dense, tables, seq_lens, None, cache_mode=mode)
    expected = [torch.empty(dense_plan.key_out_shape, dtype=dtype), torch.empty(dense_plan.value_out_shape, dtype=dtype)]
    golden.gather_golden(dense_plan, GatherTensors(key_dense, value_dense, *expected))
    seen = []
    real_gather = native_lib.run_gather

    def spy(plan_address, key_out, value_out):
        c_plan = native_lib.Plan.from_address(plan_address)
        seen.append((c_plan.key_cache, c_plan.value_cache, c_plan.key_block_stride, c_plan.value_block_stride))
        real_gather(plan_address, key_out, value_out)

    monkeypatch.setattr(native_lib, "run_gather", spy)
    out = [torch.empty_like(expected[0]), torch.empty_like(expected[1])]
    plan = plan_gather(key_view, value_view, tables, seq_lens, None, cache_mode=mode)
    native.gather_native(plan, GatherTensors(key_view, value_view, *out))
    block_bytes = key_view[0].numel() * dtype.itemsize
    assert seen == [(pool.data_ptr(), pool.data_ptr() + block_bytes, 2 * block_bytes, 2 * block_bytes)]
    assert bitwise_equal(out[0], expected[0]) and bitwise_equal(out[1], expected[1])


def test_native_backend_runs_only_the_plan_of_its_tensors() -> None:
    """A cache whose blocks are not row-major is the validator's refusal (for every backend); the
    native backend refuses to run a plan on caches other than the ones it was made for."""
    gen = torch.Generator().manual_seed(1)
    cache = random_cache((4, 4, 2, 8), torch.float16, gen)
    transposed = cache.transpose(2, 3)  # blocks not row-major
    with pytest.raises(ValueError, match="key_cache must be row-major contiguous within each block"):
        plan_gather(transposed, cache, torch.zeros(1, 1, dtype=torch.int64), torch.tensor([0, 3]))
    plan = plan_gather(cache, cache, torch.zeros(1, 1, dtype=torch.int64), torch.tensor([0, 3]))
    outputs = [torch.empty(3, 2, 8, dtype=torch.float16) for _ in range(2)]
    with pytest.raises(ValueError, match="not the tensors this plan was made for"):
        native.gather_native(plan, GatherTensors(cache.clone(), cache, *outputs))
    with pytest.raises(ValueError, match=r"key_out must be a contiguous CPU tensor of shape \[3, 2, 8\]"):
        native.gather_native(plan, GatherTensors(cache, cache, torch.empty(3, 8, 2, dtype=torch.float16), outputs[1]))


def run_plan(plan: native_lib.Plan) -> None:
    """The copy core on a hand-made plan (its memory-safety checks, then the copy)."""
    native_lib.run_gather(ctypes.addressof(plan), plan.key_out or 0, plan.value_out or 0)


def test_core_reads_pool_views_with_any_offset_floor_rule() -> None:
    """The C core directly (no spec): strided pool views plus non-aligned offsets, checked against
    the per-token reference on dense copies."""
    gen = torch.Generator().manual_seed(3)
    for mode in CacheMode:
        pool, key_view, value_view = _pool_views(mode, torch.bfloat16, gen)
        bs = key_view.shape[block_size_axis(mode)]
        tables = torch.randint(0, pool.shape[0], (3, 6), generator=gen, dtype=torch.int64)
        lengths = torch.tensor([5, 0, 9], dtype=torch.int64)
        offsets = torch.tensor([3, 7, bs + 1], dtype=torch.int64)
        starts = torch.tensor([0, 5, 5], dtype=torch.int64)
        cols = offsets // bs
        row_k = key_view[0].numel() // bs * 2
        out_k = torch.empty(14 * row_k, dtype=torch.uint8)
        out_v = torch.empty_like(out_k)
        plan = native_lib.Plan(
            layout=int(mode is CacheMode.PA_NZ), tables64=1, num_blocks=pool.shape[0], block_size=bs,
            key_cache=key_view.data_ptr(), value_cache=value_view.data_ptr(),
            key_block_stride=key_view.stride(0) * 2, value_block_stride=value_view.stride(0) * 2,
            key_row_bytes=row_k, value_row_bytes=row_k, key_out=out_k.data_ptr(), value_out=out_v.data_ptr(),
            num_seqs=3, table_cols=6, block_tables=tables.data_ptr(), table_row_stride=48, table_col_stride=8,
            seq_lengths=lengths.data_ptr(), out_starts=starts.data_ptr(), col_starts=cols.data_ptr(), num_tokens=14,
        )  # fmt: skip
        run_plan(plan)
        expected = gather_per_token(
            key_view.contiguous(), value_view.contiguous(), tables, lengths, offsets,
            cache_mode=mode.value, is_seq_lens_cumsum=False,
        )  # fmt: skip
        assert torch.equal(out_k, expected[0].contiguous().view(torch.uint8).reshape(-1))
        assert torch.equal(out_v, expected[1].contiguous().view(torch.uint8).reshape(-1))


def test_core_refuses_bad_plans_by_name() -> None:
    """Plans the core must never run: wrong struct size, a negative block stride, a block id out of
    range, sizes whose byte products overflow. (A stride below one block is a pool whose blocks
    overlap: read, not refused.)"""
    cache = torch.zeros(2, 2, 1, 4, dtype=torch.int16)
    out = torch.empty(4, 1, 4, dtype=torch.int16)
    table = torch.tensor([[0, 5]], dtype=torch.int64)
    index = torch.tensor([4], dtype=torch.int64), torch.tensor([0], dtype=torch.int64), torch.tensor([0])

    def plan(**changes):
        fields = dict(
            layout=0, tables64=1, num_blocks=2, block_size=2, key_cache=cache.data_ptr(),
            value_cache=cache.data_ptr(), key_block_stride=16, value_block_stride=16, key_row_bytes=8,
            value_row_bytes=8, key_out=out.data_ptr(), value_out=out.data_ptr(), num_seqs=1, table_cols=2,
            block_tables=table.data_ptr(), table_row_stride=16, table_col_stride=8, seq_lengths=index[0].data_ptr(),
            out_starts=index[1].data_ptr(), col_starts=index[2].data_ptr(), num_tokens=4,
        )  # fmt: skip
        fields.update(changes)
        return native_lib.Plan(**fields)

    with pytest.raises(ValueError, match=r"block_tables changed after validation .*entry \(0, 1\) = 5 is outside \[0, 2\)"):
        run_plan(plan())
    table[0, 1] = 1
    run_plan(plan())  # now valid
    run_plan(plan(key_block_stride=8))  # blocks overlapping by half: read
    short = plan()
    short.struct_size -= 8
    with pytest.raises(ValueError, match="plan ABI mismatch"):
        run_plan(short)
    with pytest.raises(ValueError, match="block stride -8 bytes is negative"):
        run_plan(plan(key_block_stride=-8))
    with pytest.raises(ValueError, match="overflow"):
        run_plan(plan(num_blocks=2**62))
    with pytest.raises(ValueError, match="overflow"):
        run_plan(plan(key_row_bytes=2**62, value_row_bytes=2**62, key_block_stride=2**63 - 1))
