"""Every rejection of the contract: the documented error type, and a message naming the input."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pakv_onnx
from pakv_onnx.cases import random_case
from test_front_paths import assert_same_rejection_everywhere
from validator_records import index_record, record, validate
from pakv_onnx.spec import INT64_MAX, CacheMode, bitwise_equal
from pakv_onnx.validator import plan_gather


def dtype_name(dtype: torch.dtype) -> str:
    """How the validator names a dtype: its torch name without the module (ONNX's type, torch's spelling)."""
    return str(dtype).removeprefix("torch.")


def norm_inputs(**overrides):
    """A small valid Norm call (bs=4, nb=6, Q=2, lengths [5, 3]) with some inputs replaced."""
    inputs = {
        "key_cache": torch.zeros(6, 4, 2, 8, dtype=torch.bfloat16),
        "value_cache": torch.zeros(6, 4, 1, 4, dtype=torch.bfloat16),
        "block_tables": torch.tensor([[0, 5, 9], [3, -1, -1]], dtype=torch.int32),
        "seq_lens": torch.tensor([0, 5, 8], dtype=torch.int32),
        "seq_offset": None,
    }
    attrs = {"cache_mode": "Norm", "is_seq_lens_cumsum": True}
    for name, value in overrides.items():
        (inputs if name in inputs or name.endswith("_out") else attrs)[name] = value
    return inputs, attrs


def caches(key_shape: tuple, value_shape: tuple, key_dtype: torch.dtype, value_dtype: torch.dtype | None = None):
    """Overrides for :func:`norm_inputs`: zero key/value caches (value_dtype defaults to key_dtype's)."""
    return {
        "key_cache": torch.zeros(key_shape, dtype=key_dtype),
        "value_cache": torch.zeros(value_shape, dtype=value_dtype or key_dtype),
    }


def expect(error: type[Exception], pattern: str, **overrides) -> None:
    inputs, attrs = norm_inputs(**overrides)
    with pytest.raises(error, match=pattern):
        plan_gather(**inputs, **attrs)
    # The public front raises the same thing before touching any backend.
    with pytest.raises(error, match=pattern):
        pakv_onnx.gather_pa_kv_cache(**inputs, **attrs, backend="torch")
    # And so does every other path (spec's full, list and fast checks, the front on every backend
    # with and without caller outputs, torch.ops, the ORT callback), word for word (issue 14).
    assert_same_rejection_everywhere(inputs, attrs, error, pattern)


def test_valid_baseline_passes() -> None:
    inputs, attrs = norm_inputs()
    plan = plan_gather(**inputs, **attrs)
    assert plan.num_tokens == 8 and plan.key_out_shape == (8, 2, 8)


# --- rank ------------------------------------------------------------------ #
@pytest.mark.parametrize(
    "name, value",
    [
        ("key_cache", torch.zeros(6, 4, 16, dtype=torch.bfloat16)),
        ("value_cache", torch.zeros(6, 4, 1, 4, 1, dtype=torch.bfloat16)),
        ("block_tables", torch.zeros(6, dtype=torch.int32)),
        ("seq_lens", torch.zeros(3, 1, dtype=torch.int32)),
        ("seq_offset", torch.zeros(2, 1, dtype=torch.int32)),
    ],
)
def test_wrong_rank(name: str, value: torch.Tensor) -> None:
    expect(ValueError, rf"{name} must have rank", **{name: value})


# --- dtype ----------------------------------------------------------------- #
def test_cache_dtype_outside_contract() -> None:
    pattern = r"key_cache dtype float64 is not in the contract"
    expect(TypeError, pattern, **caches((6, 4, 2, 8), (6, 4, 1, 4), torch.float64))


def test_value_cache_dtype_outside_contract() -> None:
    expect(TypeError, r"value_cache dtype float64 is not in the contract", value_cache=torch.zeros(6, 4, 1, 4, dtype=torch.float64))


@pytest.mark.parametrize(
    "key_dtype, value_dtype",
    [(torch.float8_e4m3fn, torch.bfloat16), (torch.float8_e5m2, torch.float16), (torch.bfloat16, torch.int8)],
)
def test_key_and_value_dtypes_may_differ(key_dtype: torch.dtype, value_dtype: torch.dtype) -> None:
    inputs, attrs = norm_inputs(**caches((6, 4, 2, 8), (6, 4, 1, 4), key_dtype, value_dtype))
    plan = plan_gather(**inputs, **attrs)
    assert (plan.key_dtype, plan.value_dtype) == (key_dtype, value_dtype)
    assert not hasattr(plan, "dtype")  # one dtype for both is gone for good
    # Each caller output must match its own cache.
    with pytest.raises(TypeError, match=rf"value_out must have value_cache's dtype {dtype_name(value_dtype)}, got {dtype_name(key_dtype)}$"):
        plan_gather(**inputs, **attrs, value_out=torch.zeros(8, 1, 4, dtype=key_dtype))


def test_pa_nz_e_is_per_cache() -> None:
    """E = 32 bytes / itemsize of that cache: 32 for an int8 key cache, 16 for a bf16 value cache."""
    inputs, attrs = norm_inputs(cache_mode="PA_NZ", **caches((6, 1, 4, 32), (6, 2, 4, 16), torch.int8, torch.bfloat16))
    plan = plan_gather(**inputs, **attrs)
    assert plan.key_out_shape == (8, 32) and plan.value_out_shape == (8, 32)


@pytest.mark.parametrize("name", ["block_tables", "seq_lens", "seq_offset"])
@pytest.mark.parametrize("dtype", [torch.int16, torch.float32, torch.uint32])
def test_index_dtype(name: str, dtype: torch.dtype) -> None:
    valid = {"block_tables": [[0, 5, 9], [3, -1, -1]], "seq_lens": [0, 5, 8], "seq_offset": [0, 0]}[name]
    expect(TypeError, rf"{name} must be int32 or int64, got {dtype_name(dtype)}$", **{name: torch.tensor(valid).to(dtype)})


def test_non_tensor_input() -> None:
    expect(TypeError, r"seq_lens must be a torch.Tensor, got list", seq_lens=[0, 5, 8])


# --- layout ---------------------------------------------------------------- #
@pytest.mark.parametrize(
    "name, make",
    [
        ("key_cache", lambda: torch.zeros(6, 4, 8, 2, dtype=torch.bfloat16).transpose(2, 3)),
        ("value_cache", lambda: torch.zeros(6, 8, 1, 4, dtype=torch.bfloat16)[:, ::2]),  # strided slots
        ("key_cache", lambda: torch.zeros(6, 4, 2, 16, dtype=torch.bfloat16)[..., :8]),  # strided rows
    ],
)
def test_cache_strided_inside_a_block_is_refused(name: str, make) -> None:
    expect(ValueError, rf"{name} must be row-major contiguous within each block \(only dim 0", **{name: make()})


def test_pool_views_strided_on_dim_0_are_accepted() -> None:
    pool = torch.zeros(6, 2, 4, 2, 8, dtype=torch.bfloat16)  # [nb, K/V, bs, H, D]
    inputs, attrs = norm_inputs(key_cache=pool[:, 0], value_cache=torch.zeros(12, 4, 1, 4, dtype=torch.bfloat16)[::2])
    assert not inputs["key_cache"].is_contiguous() and not inputs["value_cache"].is_contiguous()
    assert plan_gather(**inputs, **attrs).num_tokens == 8


@pytest.mark.parametrize(
    "value_shape, pattern",
    [
        ((7, 4, 1, 4), r"value_cache num_blocks/block_size \(7, 4\)"),
        ((6, 2, 1, 4), r"value_cache num_blocks/block_size \(6, 2\)"),
    ],
)
def test_key_value_geometry_mismatch(value_shape: tuple, pattern: str) -> None:
    expect(ValueError, pattern, value_cache=torch.zeros(value_shape, dtype=torch.bfloat16))


def test_zero_block_size() -> None:
    expect(ValueError, r"block_size must be >= 1", **caches((6, 0, 2, 8), (6, 0, 1, 4), torch.bfloat16))


@pytest.mark.parametrize("dtype, good_e", [(torch.bfloat16, 16), (torch.int8, 32), (torch.float32, 8)])
def test_pa_nz_last_dim(dtype: torch.dtype, good_e: int) -> None:
    bad = good_e * 2
    pattern = rf"key_cache: PA_NZ last dim must be 32 bytes / element size = {good_e}.*got {bad}"
    expect(ValueError, pattern, cache_mode="PA_NZ", **caches((6, 2, 4, bad), (6, 1, 4, good_e), dtype))


def test_bad_cache_mode_and_flag() -> None:
    expect(ValueError, r"cache_mode must be 'Norm' or 'PA_NZ', got 'NZ'", cache_mode="NZ")
    expect(TypeError, r"cache_mode must be a string", cache_mode=3)
    expect(TypeError, r"cache_mode must be a string, got list", cache_mode=["Norm"])  # unhashable too
    expect(ValueError, r"is_seq_lens_cumsum must be 0/1", is_seq_lens_cumsum=2)


# --- seq_lens -------------------------------------------------------------- #
def test_cumsum_must_start_at_zero() -> None:
    expect(ValueError, r"seq_lens \(cumsum\) must start at 0, got seq_lens\[0\] = 1", seq_lens=torch.tensor([1, 5, 8]))


def test_cumsum_must_not_decrease() -> None:
    expect(ValueError, r"non-decreasing, got seq_lens\[2\] = 4 < seq_lens\[1\] = 5", seq_lens=torch.tensor([0, 5, 4]))


def test_cumsum_decrease_hidden_by_wraparound() -> None:
    """A difference that wraps around int64 must not pass as a non-negative length."""
    expect(ValueError, r"non-decreasing", seq_lens=torch.tensor([0, INT64_MAX, -INT64_MAX]))


def test_negative_length() -> None:
    expect(
        ValueError,
        r"seq_lens \(lengths\) must be non-negative, got seq_lens\[1\] = -3",
        is_seq_lens_cumsum=False,
        seq_lens=torch.tensor([5, -3]),
    )


@pytest.mark.parametrize("is_cumsum, values", [(True, [0, 5]), (True, [0, 5, 8, 9]), (False, [5, 3, 1])])
def test_seq_lens_size(is_cumsum: bool, values: list) -> None:
    expect(ValueError, r"seq_lens must have Q", is_seq_lens_cumsum=is_cumsum, seq_lens=torch.tensor(values))


def test_total_tokens_overflow_int64() -> None:
    expect(
        ValueError,
        r"seq_lens \(lengths\): the total token count overflows int64 at seq_lens\[1\]",
        is_seq_lens_cumsum=False,
        seq_lens=torch.tensor([INT64_MAX, 1]),
        block_tables=torch.zeros(2, 3, dtype=torch.int64),
    )


def test_output_bytes_overflow_with_wide_blocks() -> None:
    """T x bytes per token past int64: a cache no torch tensor can hold (2**40-token blocks), so its
    record is made by hand; the validator never reads a cache, only the real index tensors."""
    tables = torch.zeros(1, 2**19, dtype=torch.int64)
    seq_lens = torch.tensor([0, 2**59])
    calls = {
        "key_cache": record((1, 2**40, 2, 8), strides=(0, 16, 8, 1)),
        "value_cache": record((1, 2**40, 1, 4), strides=(0, 4, 4, 1)),
        "block_tables": index_record(tables),
        "seq_lens": index_record(seq_lens),
    }
    assert validate(calls) == (ValueError, "key output of 576460752303423488 tokens x 32 bytes overflows int64 byte offsets")
    calls["key_cache"] = record((1, 2**40, 1, 1), strides=(0, 1, 1, 1))  # 2 bytes per token: the value side overflows
    calls["value_cache"] = record((1, 2**40, 1, 16), strides=(0, 16, 16, 1))
    assert validate(calls) == (
        ValueError, "value output of 576460752303423488 tokens x 32 bytes overflows int64 byte offsets"
    )


# --- seq_offset ------------------------------------------------------------ #
def test_seq_offset_negative() -> None:
    expect(ValueError, r"seq_offset must be non-negative, got seq_offset\[1\] = -4", seq_offset=torch.tensor([0, -4]))


@pytest.mark.parametrize("offsets, columns", [([2, 0], [0, 0]), ([3, 7], [0, 1]), ([5, 4], [1, 1])])
def test_seq_offset_is_floored_to_a_column(offsets: list, columns: list) -> None:
    """The FLOOR RULE: column seq_offset // bs, slot 0 of that block; the remainder is ignored."""
    inputs, attrs = norm_inputs(seq_offset=torch.tensor(offsets), block_tables=torch.tensor([[0, 5, 1], [3, 2, 4]]))
    plan = plan_gather(**inputs, **attrs)
    assert plan.table_col_starts.tolist() == columns


def test_seq_offset_size() -> None:
    expect(ValueError, r"seq_offset must have Q = 2 entries", seq_offset=torch.tensor([0, 0, 0]))


# --- block_tables ---------------------------------------------------------- #
def test_row_too_short() -> None:
    expect(
        ValueError, r"block_tables row 0 is too short: sequence 0 has 5 tokens", block_tables=torch.tensor([[0], [3]])
    )


def test_row_too_short_after_offset() -> None:
    expect(
        ValueError,
        r"block_tables row 0 is too short.*starting at column 2",
        seq_offset=torch.tensor([8, 0]),
    )


@pytest.mark.parametrize("bad_id", [6, 1000, -1, -(2**40)])
def test_used_block_id_out_of_range(bad_id: int) -> None:
    tables = torch.tensor([[0, bad_id, 0], [3, 0, 0]], dtype=torch.int64)
    expect(ValueError, rf"block_tables\[0, 1\] = {bad_id} is outside \[0, 6\)", block_tables=tables)


def test_unused_entries_may_hold_anything() -> None:
    tables = torch.tensor([[0, 5, -(2**62)], [3, 2**40, -7]], dtype=torch.int64)
    inputs, attrs = norm_inputs(block_tables=tables)
    plan_gather(**inputs, **attrs)


# --- caller outputs -------------------------------------------------------- #
@pytest.mark.parametrize(
    "name, value, error, pattern",
    [
        ("key_out", torch.zeros(7, 2, 8, dtype=torch.bfloat16), ValueError, r"key_out must have shape \[8, 2, 8\]"),
        ("value_out", torch.zeros(8, 4, dtype=torch.bfloat16), ValueError, r"value_out must have shape \[8, 1, 4\]"),
        ("key_out", torch.zeros(8, 2, 8, dtype=torch.float16), TypeError, r"key_out must have key_cache's dtype"),
        ("value_out", torch.zeros(16, 1, 4, dtype=torch.bfloat16)[::2], ValueError, r"value_out must be contiguous"),
        ("key_out", "not a tensor", TypeError, r"key_out must be a torch.Tensor"),
    ],
)
def test_caller_outputs(name: str, value: object, error: type, pattern: str) -> None:
    expect(error, pattern, **{name: value})


# --- aliasing: outputs overlapping each other or an input (issue 10.6) ----- #
def square_inputs(**overrides):
    """norm_inputs with value rows shaped like key rows, so one tensor could serve as both outputs."""
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(6, 4, 2, 8, generator=gen).to(torch.bfloat16)
    return norm_inputs(**{"key_cache": cache, "value_cache": cache.clone(), **overrides})


def aliasing_calls() -> dict:
    inputs, _ = square_inputs()
    caches = {"key_cache": inputs["key_cache"], "value_cache": inputs["value_cache"]}
    shared = torch.zeros(8, 2, 8, dtype=torch.bfloat16)
    buffer = torch.zeros(300, dtype=torch.bfloat16)
    tables = torch.zeros(2, 40, dtype=torch.int64)
    tables[0, :2], tables[1, 0] = torch.tensor([0, 5]), 3
    return {
        "same-tensor": ({"key_out": shared, "value_out": shared}, r"key_out and value_out overlap"),
        "partial": (
            {"key_out": buffer[:128].view(8, 2, 8), "value_out": buffer[127:255].view(8, 2, 8)},
            r"key_out and value_out overlap",
        ),
        "into-key-cache": (
            {**caches, "key_out": inputs["key_cache"].view(-1)[64:192].view(8, 2, 8)},
            r"key_out overlaps key_cache",
        ),
        "into-value-cache": (
            {**caches, "value_out": inputs["value_cache"][2:].reshape(-1)[:128].view(8, 2, 8)},
            r"value_out overlaps value_cache",
        ),
        # Another dtype over the same untyped storage: the int64 block table seen as bf16.
        "into-block-tables-other-dtype": (
            {"block_tables": tables, "value_out": tables.view(torch.bfloat16).view(-1)[:128].view(8, 2, 8)},
            r"value_out overlaps block_tables",
        ),
    }


@pytest.mark.parametrize("name", list(aliasing_calls()))
@pytest.mark.parametrize("backend", ["golden", "torch"])
def test_aliased_outputs_are_refused_before_anything_is_written(name: str, backend: str) -> None:
    overrides, pattern = aliasing_calls()[name]
    inputs, attrs = square_inputs(**overrides)
    before = {n: t.clone() for n, t in inputs.items() if isinstance(t, torch.Tensor)}
    with pytest.raises(ValueError, match=pattern):
        pakv_onnx.gather_pa_kv_cache(**inputs, **attrs, backend=backend)
    for n, t in before.items():
        assert bitwise_equal(inputs[n], t), f"{n} was written before the error"
    assert_same_rejection_everywhere(inputs, attrs, ValueError, pattern)
    for n, t in before.items():
        assert bitwise_equal(inputs[n], t), f"{n} was written before the error (some path)"


def test_adjacent_outputs_in_one_buffer_are_fine() -> None:
    inputs, attrs = square_inputs()
    buffer = torch.zeros(256, dtype=torch.bfloat16)
    key, value = buffer[:128].view(8, 2, 8), buffer[128:].view(8, 2, 8)
    got = pakv_onnx.gather_pa_kv_cache(**inputs, **attrs, key_out=key, value_out=value, backend="golden")
    want = pakv_onnx.gather_pa_kv_cache(**inputs, **attrs, backend="golden")
    assert bitwise_equal(got[0], want[0]) and bitwise_equal(got[1], want[1])


# --- zero-byte rows and T near INT64_MAX (issue 10.8) ---------------------- #
HUGE_BLOCK = 2**56  # a zero-element cache may claim any block size: 128 blocks cover INT64_MAX tokens


def empty_row_call(num_tokens: int) -> tuple[tuple, dict]:
    """PA_NZ caches with no fractals (rows of zero bytes), one sequence of ``num_tokens``."""
    key_cache = torch.zeros(2, 0, HUGE_BLOCK, 16, dtype=torch.bfloat16)
    value_cache = torch.zeros(2, 0, HUGE_BLOCK, 16, dtype=torch.bfloat16)
    tables = torch.zeros(1, 128, dtype=torch.int64)
    return (key_cache, value_cache, tables, torch.tensor([0, num_tokens])), {"cache_mode": "PA_NZ"}


@pytest.mark.parametrize("num_tokens", [2**41, INT64_MAX], ids=["2^41", "INT64_MAX"])
@pytest.mark.parametrize("backend", ["golden", "torch", "native", "auto"])
def test_zero_byte_rows_with_huge_t(num_tokens: int, backend: str, monkeypatch) -> None:
    args, attrs = empty_row_call(num_tokens)

    def no_per_token_state(self):
        raise AssertionError("a backend built a per-token index for rows of zero bytes")

    monkeypatch.setattr(pakv_onnx.GatherPlan, "token_slots", no_per_token_state)
    key, value = pakv_onnx.gather_pa_kv_cache(*args, **attrs, backend=backend)
    assert key.shape == (num_tokens, 0) and value.shape == (num_tokens, 0)
    assert key.dtype == value.dtype == torch.bfloat16


def test_runs_and_token_slots_never_overflow_near_int64_max() -> None:
    args, attrs = empty_row_call(INT64_MAX)
    plan = plan_gather(*args, **attrs)
    runs = plan.runs()  # ceil(len / bs) without len + bs - 1: 128 runs, rows summing to T
    assert runs.shape == (128, 4) and int(runs[:, 1].sum()) == INT64_MAX and int(runs[-1, 2]) == 127 * HUGE_BLOCK
    with pytest.raises(ValueError, match=r"token_slots\(\): 9223372036854775807 tokens is more than"):
        plan.token_slots()
    # A plan with more runs than any index could hold is refused by runs() itself.
    import array
    import dataclasses

    many = dataclasses.replace(plan, block_size=1, num_seqs=1, index=array.array("q", [2**40, 0, 0]))
    with pytest.raises(ValueError, match=r"runs\(\): 1099511627776 copy runs is more than"):
        many.runs()


def test_outputs_torch_cannot_describe_are_a_value_error() -> None:
    """Norm rows [3, 0] at T = INT64_MAX: torch's size arithmetic overflows; say so as a ValueError."""
    key_cache = torch.zeros(2, HUGE_BLOCK, 3, 0, dtype=torch.bfloat16)
    tables = torch.zeros(1, 128, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"key output of shape \[9223372036854775807, 3, 0\] cannot be described"):
        pakv_onnx.gather_pa_kv_cache(key_cache, key_cache, tables, torch.tensor([0, INT64_MAX]), backend="golden")


def test_unknown_backend() -> None:
    inputs, attrs = norm_inputs()
    with pytest.raises(ValueError, match=r"backend 'fast' is unknown \(choices: auto, "):
        pakv_onnx.gather_pa_kv_cache(**inputs, **attrs, backend="fast")


# --- property: malformed inputs only ever raise the documented errors ------ #
INT64_EDGES = [0, 1, -1, 2, 3, 4, 5, 7, 8, 63, 64, -(2**31), 2**31 - 1, 2**40, INT64_MAX, -INT64_MAX - 1]


@st.composite
def malformed_call(draw):
    case = random_case(draw(st.integers(0, 10_000)), max_blocks=8)
    inputs = dict(zip(("key_cache", "value_cache", "block_tables", "seq_lens", "seq_offset"), case.inputs()))
    target = draw(st.sampled_from(["block_tables", "seq_lens", "seq_offset", "key_cache", "value_cache", "mode"]))
    attrs = case.attributes()
    if target == "mode":
        attrs["cache_mode"] = CacheMode.PA_NZ if case.cache_mode is CacheMode.NORM else CacheMode.NORM
        attrs["is_seq_lens_cumsum"] = draw(st.booleans())
    elif target in ("key_cache", "value_cache"):
        shape = draw(st.lists(st.integers(0, 5), min_size=1, max_size=5))
        dtype = draw(st.sampled_from([torch.bfloat16, torch.int8, torch.float32, torch.float64]))
        inputs[target] = torch.zeros(shape, dtype=dtype)
    else:
        shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))
        numel = 1
        for dim in shape:
            numel *= dim
        values = draw(st.lists(st.sampled_from(INT64_EDGES), min_size=numel, max_size=numel))
        dtype = draw(st.sampled_from([torch.int32, torch.int64, torch.int16, torch.float32]))
        tensor = torch.tensor(values, dtype=torch.int64).reshape(shape)
        inputs[target] = tensor.to(dtype) if dtype != torch.int32 else tensor.to(torch.int32)
    return inputs, attrs


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(malformed_call(), st.sampled_from(["torch", "golden"]))
def test_malformed_inputs_only_raise_documented_errors(call, backend: str) -> None:
    inputs, attrs = call
    try:
        key, value = pakv_onnx.gather_pa_kv_cache(**inputs, **attrs, backend=backend)
    except (ValueError, TypeError) as err:
        assert re.search(r"key_cache|value_cache|block_tables|seq_lens|seq_offset|cache_mode|is_seq_lens", str(err)), (
            err
        )
        return
    # Accepted: the result must then be what the golden says.
    want_key, want_value = pakv_onnx.gather_pa_kv_cache(**inputs, **attrs, backend="golden")
    assert bitwise_equal(key, want_key) and bitwise_equal(value, want_value)


def test_the_gather_and_scatter_validators_bind_the_ops_inputs_positionally() -> None:
    """plan_gather and plan_scatter take the op's inputs positionally through the one binder
    (spec.GATHER / spec.SCATTER.inputs_of): seq_offset, the gather's optional last input, may be left
    out (the same plan as None), and inputs may come by name; too few or too many is a TypeError naming
    the inputs in order, as is a name given twice, unknown or missing."""
    from pakv_onnx.cases import random_scatter_case
    from pakv_onnx.validator import plan_scatter

    case = random_case(3, with_seq_offset=False)
    inputs = case.inputs()
    assert inputs[4] is None
    short, full = plan_gather(*inputs[:4], **case.attributes()), plan_gather(*inputs, **case.attributes())
    assert (short.num_tokens, short.key_out_shape, bytes(short.index)) == (full.num_tokens, full.key_out_shape, bytes(full.index))
    names = r"\(key_cache, value_cache, block_tables, seq_lens, seq_offset\)"
    for count in (3, 6):
        with pytest.raises(TypeError, match=rf"^GatherPaKvCache takes 4 to 5 inputs {names}, got {count}$"):
            plan_gather(*(inputs * 2)[:count])
    by_name = plan_gather(*inputs[:2], block_tables=inputs[2], seq_lens=inputs[3], **case.attributes())
    assert bytes(by_name.index) == bytes(full.index)
    with pytest.raises(TypeError, match=r"^GatherPaKvCache got 'key_cache' twice$"):
        plan_gather(*inputs[:4], key_cache=inputs[0])
    with pytest.raises(TypeError, match=r"^GatherPaKvCache got an unknown input 'seq_len' \(inputs: key_cache, "):
        plan_gather(*inputs[:3], seq_len=inputs[3])
    with pytest.raises(TypeError, match=r"^GatherPaKvCache is missing the required input 'seq_lens'$"):
        plan_gather(*inputs[:2], block_tables=inputs[2])
    scatter = random_scatter_case(3).inputs()
    with pytest.raises(TypeError, match=r"^ScatterPaKvCache takes 5 inputs \(key, value, key_cache, value_cache, "):
        plan_scatter(*scatter[:4])
