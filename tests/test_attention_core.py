"""The attention core (pakv_attention*.c) on plans built directly (native_lib.AttentionPlan through
ctypes, caches as torch tensors), against the independent fp64 reference tests/attention_reference.py:
every type of query, output and cache, quantized caches, GQA ratios, LATENT, softcap, window, sinks,
causal 0, ragged batches mixing prefill and decode rows, block sizes; the non-finite rules; masked
positions never read; and the refusals of malformed plans.

Tolerances on ``|got - want| <= atol + rtol * |want|`` (NaN where the reference is NaN, nowhere else):

- float32 output: atol 2e-5, rtol 1e-5. The core accumulates in fp32 in another order than the fp64
  reference (scores over D, softmax sums over up to ~300 positions, a tanh and exp good to ~3e-7
  relative); the values are O(1), so an error of a few fp32 epsilons per term bounds it (measured
  at most ~2e-6). Quantized caches change nothing: the reference dequantizes the same stored bytes,
  and the core folds the same scales into the query and the output.
- float16 / bfloat16 output: the reference rounded once to the output dtype, then one unit in the
  last place (the core rounds its fp32 result once: the two can differ by one rounding step).

A plan's ``dequantized_type`` (float16 / bfloat16: each quantized element fp32 e x scale rounded to it,
ORT's CUDA arithmetic) is compared with the reference rounding the same elements (``round_dequantized``).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from attention_reference import NONE, PER_CHANNEL, PER_TENSOR, decode_float8_e4m3fn, paged_attention, stored_float64
from conftest import rerun_with_the_8_float_walk

from pakv_onnx import native_lib

ONNX_TYPE = {torch.float32: 1, torch.float16: 10, torch.bfloat16: 16, torch.int8: 3, torch.float8_e4m3fn: 17}
QUANT_CODE = {NONE: 0, PER_TENSOR: 1, PER_CHANNEL: 2}
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
QUANTIZED = [torch.int8, torch.float8_e4m3fn]
# Each cache type with the quantization modes it takes.
CACHE_KINDS = [(t, NONE) for t in FLOATS] + [(t, q) for t in QUANTIZED for q in (PER_TENSOR, PER_CHANNEL)]
TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.float16: (1e-3, 2**-10), torch.bfloat16: (1e-2, 2**-7)}


@dataclass
class CoreCase:
    """One attention for the core: torch tensors and the plan's scalars (see pakv_core.h)."""

    query: torch.Tensor  # [N, Hq, D] float32 / float16 / bfloat16
    key_cache: torch.Tensor  # [num_blocks, block_size, Hk, D]
    value_cache: torch.Tensor | None  # [num_blocks, block_size, Hk, Dv]; None: LATENT (V = K's leading Dv)
    value_head_dim: int
    block_table: torch.Tensor  # [B, cols] int32 / int64 (entries a sequence never reads may be -1)
    query_starts: torch.Tensor  # [B] int64
    query_counts: torch.Tensor
    context_lens: torch.Tensor
    out_dtype: torch.dtype
    scale: float
    key_quant: str = NONE
    key_scale: torch.Tensor | None = None  # [1] or [Hk * D] float32
    value_quant: str = NONE
    value_scale: torch.Tensor | None = None
    softcap: float = 0.0
    window: int = -1
    head_sink: torch.Tensor | None = None  # [Hq] float32
    causal: bool = True
    dequantized: torch.dtype | None = None  # the plan's dequantized_type: None (exact), float16 or bfloat16
    keep: list = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"q {self.query.dtype} k {self.key_cache.dtype}/{self.key_quant} "
            f"v {None if self.value_cache is None else self.value_cache.dtype}/{self.value_quant} out {self.out_dtype} "
            f"heads {self.query.shape[1]}/{self.key_cache.shape[2]} D {self.query.shape[2]}/{self.value_head_dim} "
            f"bs {self.key_cache.shape[1]} softcap {self.softcap} window {self.window} "
            f"sink {self.head_sink is not None} causal {self.causal} dequantized {self.dequantized} "
            f"new {self.query_counts.tolist()} "
            f"ctx {self.context_lens.tolist()}"
        )


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def make_plan(case: CoreCase, out: torch.Tensor) -> native_lib.AttentionPlan:
    """The plan of `case` writing `out` ([N, Hq, Dv] dense), byte strides read from the tensors."""
    p = native_lib.AttentionPlan()
    p.abi_version, p.struct_size = native_lib.ABI_VERSION, ctypes.sizeof(native_lib.AttentionPlan)
    k = case.key_cache
    v = k if case.value_cache is None else case.value_cache
    p.query_type, p.out_type = ONNX_TYPE[case.query.dtype], ONNX_TYPE[out.dtype]
    p.key_type, p.value_type = ONNX_TYPE[k.dtype], ONNX_TYPE[v.dtype]
    p.key_quant, p.value_quant = QUANT_CODE[case.key_quant], QUANT_CODE[case.value_quant]
    p.key_scale, p.value_scale = _pointer(case.key_scale), _pointer(case.value_scale)
    p.tables64 = int(case.block_table.dtype == torch.int64)
    p.causal = int(case.causal)
    p.num_blocks, p.block_size = k.shape[0], k.shape[1]
    p.key_cache, p.value_cache = k.data_ptr(), v.data_ptr()
    ki, vi = k.element_size(), v.element_size()
    p.key_block_stride, p.key_row_stride, p.key_head_stride = (s * ki for s in k.stride()[:3])
    p.value_block_stride, p.value_row_stride, p.value_head_stride = (s * vi for s in v.stride()[:3])
    p.num_heads, p.num_kv_heads = case.query.shape[1], k.shape[2]
    p.head_dim, p.value_head_dim = case.query.shape[2], case.value_head_dim
    p.query = case.query.data_ptr()
    qi = case.query.element_size()
    p.query_token_stride, p.query_head_stride = case.query.stride(0) * qi, case.query.stride(1) * qi
    p.out = out.data_ptr()
    p.num_tokens, p.num_seqs = case.query.shape[0], case.query_counts.shape[0]
    bt = case.block_table
    p.table_cols, p.block_tables = bt.shape[1], bt.data_ptr()
    p.table_row_stride, p.table_col_stride = bt.stride(0) * bt.element_size(), bt.stride(1) * bt.element_size()
    p.query_starts, p.query_counts = case.query_starts.data_ptr(), case.query_counts.data_ptr()
    p.context_lens = case.context_lens.data_ptr()
    p.scale, p.softcap, p.window = case.scale, case.softcap, case.window
    p.head_sink = _pointer(case.head_sink)
    p.dequantized_type = 0 if case.dequantized is None else ONNX_TYPE[case.dequantized]
    return p


def run_core(case: CoreCase, plan_edit=None, threads: int = 1) -> torch.Tensor:
    """The core's output for `case` ([N, Hq, Dv] of case.out_dtype; NaN where nothing was written),
    on this thread or `threads` of the library's."""
    out = torch.full((case.query.shape[0], case.query.shape[1], case.value_head_dim), math.nan, dtype=case.out_dtype)
    plan = make_plan(case, out)
    if plan_edit:
        plan_edit(plan)
    native_lib.run_attention(ctypes.addressof(plan), threads)
    return out


def reference(case: CoreCase) -> np.ndarray:
    def scale(t):
        return None if t is None else t.double().numpy()

    def round_dequantized(values: np.ndarray) -> np.ndarray:  # fp32 e x scale (exact in fp64), rounded to the type
        return torch.from_numpy(values).float().to(case.dequantized).double().numpy()

    return paged_attention(
        stored_float64(case.query),
        stored_float64(case.key_cache),
        None if case.value_cache is None else stored_float64(case.value_cache),
        case.block_table.numpy(),
        case.query_starts.numpy(),
        case.query_counts.numpy(),
        case.context_lens.numpy(),
        scale=case.scale,
        value_head_dim=case.value_head_dim,
        key_quant=case.key_quant,
        key_scale=scale(case.key_scale),
        value_quant=case.value_quant,
        value_scale=scale(case.value_scale),
        softcap=case.softcap,
        window=case.window,
        head_sink=scale(case.head_sink),
        causal=case.causal,
        round_dequantized=None if case.dequantized is None else round_dequantized,
    )


def assert_matches_reference(case: CoreCase, got: torch.Tensor | None = None) -> None:
    got = run_core(case) if got is None else got
    want = torch.from_numpy(reference(case))
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got.double()), nan), f"NaN rows differ: {case.summary()}"
    atol, rtol = TOLERANCE[case.out_dtype]
    want_rounded = want.to(case.out_dtype).double()
    err = (got.double() - want_rounded).abs()[~nan]
    bound = (atol + rtol * want_rounded.abs())[~nan]
    assert bool((err <= bound).all()), f"error {float(err.max()):.3g} past tolerance: {case.summary()}"


# --------------------------------------------------------------------------- #
# Cases
# --------------------------------------------------------------------------- #
def _stored(shape, dtype, gen) -> torch.Tensor:
    """Random stored elements: N(0, 1) for float types, int8 in [-127, 127], fp8 of N(0, 2) (its
    subnormals included)."""
    if dtype == torch.int8:
        return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
    if dtype == torch.float8_e4m3fn:
        return (torch.randn(shape, generator=gen) * 2).to(dtype)
    return torch.randn(shape, generator=gen).to(dtype)


def _scale(quant: str, dtype: torch.dtype, channels: int, gen) -> torch.Tensor | None:
    """Scales that keep dequantized values O(1): int8 x ~0.02, fp8 x ~0.5."""
    if quant == NONE:
        return None
    base = 0.02 if dtype == torch.int8 else 0.5
    count = 1 if quant == PER_TENSOR else channels
    return (base * (0.5 + torch.rand(count, generator=gen))).float()


def _poison(pool: torch.Tensor) -> None:
    """Mark pool slots no query may read: NaN (fp8: its NaN byte), int8 its extreme."""
    if pool.dtype == torch.int8:
        pool.fill_(-128)
    elif pool.dtype == torch.float8_e4m3fn:
        pool.view(torch.uint8).fill_(0x7F)
    else:
        pool.fill_(math.nan)


def make_case(
    seed: int = 0,
    *,
    sequences=((5, 3), (17, 1), (0, 6), (40, 0), (33, 1)),
    heads=(8, 2),
    head_dim=32,
    value_head_dim=None,
    block_size=16,
    query_dtype=torch.float32,
    out_dtype=None,
    key=(torch.float32, NONE),
    value=None,
    latent=False,
    softcap=0.0,
    window=-1,
    sink=False,
    causal=True,
    table_dtype=torch.int32,
    scale=None,
    dequantized=None,
) -> CoreCase:
    """A random attention: sequences as (past, new) pairs (decode rows have new 1, prefill more, a
    sequence with new 0 reads nothing), scattered over a shuffled pool whose slots no query sees are
    poisoned (NaN), and whose table entries no query reads are -1."""
    gen = torch.Generator().manual_seed(seed)
    hq, hk = heads
    dv = value_head_dim or head_dim
    value = value or key
    out_dtype = out_dtype or query_dtype
    counts = [n for _, n in sequences]
    lengths = [past + n for past, n in sequences]
    cols = [-(-length // block_size) for length in lengths]
    num_blocks = sum(cols) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    key_pool = torch.empty(num_blocks, block_size, hk, head_dim, dtype=key[0])
    _poison(key_pool)
    value_pool = None
    if not latent:
        value_pool = torch.empty(num_blocks, block_size, hk, dv, dtype=value[0])
        _poison(value_pool)
    table = torch.full((len(sequences), max(cols + [1]) + 1), -1, dtype=table_dtype)
    used = 0
    for b, (length, n) in enumerate(zip(lengths, counts)):
        first = 0
        if n and window >= 0:  # positions before the first new token's window are never read
            first = max(0, length - n - window)
        for c in range(cols[b]):
            block = order[used]
            used += 1
            if n == 0 or (c + 1) * block_size <= first:
                continue  # an entry no query reads: stays -1
            table[b, c] = block
            lo, hi = max(first, c * block_size), min(length, (c + 1) * block_size)
            rows = slice(lo - c * block_size, hi - c * block_size)
            key_pool[block, rows] = _stored((hi - lo, hk, head_dim), key[0], gen)
            if value_pool is not None:
                value_pool[block, rows] = _stored((hi - lo, hk, dv), value[0], gen)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    query = torch.randn(sum(counts), hq, head_dim, generator=gen).to(query_dtype)
    return CoreCase(
        query=query,
        key_cache=key_pool,
        value_cache=value_pool,
        value_head_dim=dv,
        block_table=table,
        query_starts=torch.from_numpy(starts),
        query_counts=torch.tensor(counts, dtype=torch.int64),
        context_lens=torch.tensor(lengths, dtype=torch.int64),
        out_dtype=out_dtype,
        scale=scale if scale is not None else 1.0 / math.sqrt(head_dim),
        key_quant=key[1],
        key_scale=_scale(key[1], key[0], hk * head_dim, gen),
        value_quant=value[1],
        value_scale=_scale(value[1], value[0], hk * dv, gen),
        softcap=softcap,
        window=window,
        head_sink=(torch.randn(hq, generator=gen) * 2).float() if sink else None,
        causal=causal,
        dequantized=dequantized,
    )


# --------------------------------------------------------------------------- #
# Values: the matrix
# --------------------------------------------------------------------------- #
def test_float8_decode_is_torchs_for_every_byte() -> None:
    bits = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    theirs = bits.view(torch.float8_e4m3fn).double().numpy()
    mine = decode_float8_e4m3fn(bits.numpy())
    assert np.array_equal(mine, theirs, equal_nan=True)
    assert np.isnan(mine[[0x7F, 0xFF]]).all() and np.isnan(mine).sum() == 2 and mine[0x7E] == 448.0


@pytest.mark.parametrize("value", CACHE_KINDS, ids=lambda k: f"v-{str(k[0])[6:]}-{k[1]}")
@pytest.mark.parametrize("key", CACHE_KINDS, ids=lambda k: f"k-{str(k[0])[6:]}-{k[1]}")
def test_every_cache_type_and_quantization(key, value) -> None:
    seed = CACHE_KINDS.index(key) * len(CACHE_KINDS) + CACHE_KINDS.index(value)
    assert_matches_reference(make_case(seed, key=key, value=value, head_dim=24, value_head_dim=40))


@pytest.mark.parametrize("out_dtype", FLOATS)
@pytest.mark.parametrize("query_dtype", FLOATS)
def test_query_and_output_types(query_dtype, out_dtype) -> None:
    assert_matches_reference(make_case(3, query_dtype=query_dtype, out_dtype=out_dtype, key=(torch.bfloat16, NONE)))


@pytest.mark.parametrize("dims", [(64, 64), (13, 7), (8, 24)])
@pytest.mark.parametrize("heads", [(1, 1), (4, 4), (8, 2), (8, 1), (6, 3), (16, 4), (32, 2)])
def test_gqa_ratios_and_head_dims(heads, dims) -> None:
    assert_matches_reference(make_case(5, heads=heads, head_dim=dims[0], value_head_dim=dims[1]))


@pytest.mark.parametrize("kind", CACHE_KINDS, ids=lambda k: f"{str(k[0])[6:]}-{k[1]}")
def test_latent_reads_values_from_the_key_rows(kind) -> None:
    # One cache, one kv head; V = the leading channels of each key row (its own value scale).
    value = (kind[0], PER_CHANNEL if kind[1] == PER_TENSOR else kind[1])
    case = make_case(7, heads=(8, 1), head_dim=48, value_head_dim=32, key=kind, value=value, latent=True, scale=0.11)
    assert_matches_reference(case)


DEQUANTIZED = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dequantized", DEQUANTIZED, ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("value", CACHE_KINDS[2:], ids=lambda k: f"v-{str(k[0])[6:]}-{k[1]}")
@pytest.mark.parametrize("key", CACHE_KINDS[2:], ids=lambda k: f"k-{str(k[0])[6:]}-{k[1]}")
def test_dequantized_elements_rounded_to_the_plans_type(key, value, dequantized) -> None:
    # Each quantized side's elements rounded to float16 / bfloat16 after the scale (a float side is
    # read as is): the reference rounding the same elements, prefill and decode rows, a head_dim that
    # is no multiple of a vector (the scalar tail), GQA.
    seed = 100 + CACHE_KINDS.index(key) * len(CACHE_KINDS) + CACHE_KINDS.index(value)
    case = make_case(seed, key=key, value=value, head_dim=40, value_head_dim=24, query_dtype=dequantized,
                     dequantized=dequantized)  # fmt: skip
    assert_matches_reference(case)


@pytest.mark.parametrize("dequantized", DEQUANTIZED, ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("kind", CACHE_KINDS[3:], ids=lambda k: f"{str(k[0])[6:]}-{k[1]}")
@pytest.mark.parametrize("value_scaling", ["the key's", "its own"])
def test_latent_values_dequantized_with_their_scales(kind, value_scaling, dequantized) -> None:
    # LATENT with the key's scales (V read through the rounded K rows: ORT's LATENT) or its own
    # (V's rows dequantized apart from K's).
    value = kind if value_scaling == "the key's" else (kind[0], PER_CHANNEL if kind[1] == PER_TENSOR else PER_TENSOR)
    case = make_case(9, heads=(8, 1), head_dim=48, value_head_dim=32, key=kind, value=value, latent=True, scale=0.11,
                     sequences=((5, 3), (40, 1), (0, 20)), dequantized=dequantized)  # fmt: skip
    if value_scaling == "the key's":
        case.value_scale = case.key_scale  # one kv head: channel c's scale is the key's channel c
    assert_matches_reference(case)


def test_latent_at_deepseek_width() -> None:
    case = make_case(8, heads=(4, 1), head_dim=576, value_head_dim=512, latent=True, sequences=((30, 2), (9, 1)))
    assert_matches_reference(case)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("window", [-1, 0, 1, 5, 40])
@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_softcap_window_sink_causal(softcap, window, sink, causal) -> None:
    seqs = ((70, 12), (3, 1), (50, 1), (0, 9), (20, 0))
    assert_matches_reference(
        make_case(11, sequences=seqs, softcap=softcap, window=window, sink=sink, causal=causal, scale=0.6)
    )


@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("block_size", [1, 3, 16, 32, 64])
def test_block_sizes(block_size, table_dtype) -> None:
    seqs = ((100, 1), (31, 33), (0, 1), (64, 0), (7, 2))
    assert_matches_reference(make_case(13, sequences=seqs, block_size=block_size, table_dtype=table_dtype))


@pytest.mark.parametrize("seed", range(40))
def test_random_mixtures(seed: int) -> None:
    rng = np.random.default_rng(seed)
    hk = int(rng.choice([1, 2, 4]))
    key = CACHE_KINDS[rng.integers(len(CACHE_KINDS))]
    latent = bool(rng.random() < 0.2)
    value = (key[0], PER_CHANNEL if key[1] == PER_TENSOR else key[1]) if latent else CACHE_KINDS[rng.integers(7)]
    head_dim = int(rng.choice([8, 16, 40, 64, 72]))
    seqs = tuple((int(rng.integers(0, 90)), int(rng.choice([0, 1, 1, 2, 5, 20]))) for _ in range(rng.integers(1, 6)))
    case = make_case(
        seed,
        sequences=seqs,
        heads=(hk * int(rng.choice([1, 2, 3, 4, 8])), hk),
        head_dim=head_dim,
        value_head_dim=int(rng.integers(4, head_dim + 1)) if latent else int(rng.choice([8, 32, 64])),
        block_size=int(rng.choice([1, 2, 5, 16, 32])),
        query_dtype=FLOATS[rng.integers(3)],
        out_dtype=FLOATS[rng.integers(3)],
        key=key,
        value=value,
        latent=latent,
        softcap=float(rng.choice([0.0, 0.0, 2.5, 30.0])),
        window=int(rng.choice([-1, -1, 0, 3, 25])),
        sink=bool(rng.random() < 0.4),
        causal=bool(rng.random() < 0.7),
        table_dtype=torch.int64 if rng.random() < 0.5 else torch.int32,
    )
    assert_matches_reference(case)


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(key=(torch.bfloat16, NONE), softcap=5.0, window=70, sink=True),
        dict(key=(torch.float8_e4m3fn, PER_CHANNEL), value=(torch.int8, PER_TENSOR), causal=False),
        dict(heads=(16, 1), head_dim=96, value_head_dim=64, latent=True, key=(torch.float16, NONE)),
    ],
)
def test_threads_split_the_work_and_give_the_same_bytes(options) -> None:
    # Big enough to split (work over PAKV_ONNX_ATTENTION_PARALLEL_MIN): prefill, decode and long rows.
    seqs = ((300, 40), (900, 1), (0, 64), (1500, 1), (64, 3))
    case = make_case(41, sequences=seqs, head_dim=options.pop("head_dim", 64), **{"heads": (8, 2), **options})
    one = run_core(case)
    for threads in (2, 3, 16):
        assert torch.equal(run_core(case, threads=threads).view(torch.uint8), one.view(torch.uint8)), threads
    assert_matches_reference(case, one)


def test_the_8_float_walk_matches_the_reference_too() -> None:
    # The core runs the widest walk the CPU has (16 floats with AVX-512); the 8-float one (AVX2 and
    # the baseline) is the same source at another width: this file again with it forced.
    rerun_with_the_8_float_walk(__file__, "8_float")


def test_thread_counts_out_of_range_are_refused() -> None:
    for threads in (0, 17):
        with pytest.raises(ValueError, match=rf"threads must be in \[1, 16\], got {threads}"):
            run_core(make_case(43), threads=threads)


# --------------------------------------------------------------------------- #
# What is never read
# --------------------------------------------------------------------------- #
def test_positions_no_query_sees_are_never_read() -> None:
    # Slots past each context and before each window are NaN, the table entries of blocks wholly
    # before a window are -1: reading any of them would show (NaN output, or a refused entry).
    case = make_case(17, sequences=((90, 3), (40, 1), (12, 12)), window=6, block_size=4)
    assert int((case.block_table[:, :10] == -1).sum()) >= 10, "the case must leave unread entries"
    got = run_core(case)
    assert bool(torch.isfinite(got).all())
    assert_matches_reference(case, got)


# --------------------------------------------------------------------------- #
# Non-finite scores
# --------------------------------------------------------------------------- #
def _infinite_key_case(positions, sink=None, softcap=0.0) -> CoreCase:
    """One sequence (8 past + 1 new), heads (2, 1): key channel 0 is +inf at `positions`, query head
    0 has channel 0 negative (those scores are -inf), head 1 positive (+inf); value rows there NaN."""
    case = make_case(19, sequences=((8, 1),), heads=(2, 1), head_dim=16, block_size=4, softcap=softcap)
    case.query[0, 0, 0], case.query[0, 1, 0] = -1.5, 1.5
    for position in positions:
        block = int(case.block_table[0, position // 4])
        case.key_cache[block, position % 4, 0, 0] = math.inf
        case.value_cache[block, position % 4, 0] = math.nan
    if sink is not None:
        case.head_sink = torch.tensor([sink, sink], dtype=torch.float32)
    return case


def test_a_negative_infinite_score_weighs_zero_and_its_value_is_not_multiplied_in() -> None:
    # +inf key x negative query: -inf, weight exactly 0; its NaN value row must not poison the
    # output (the core before this fix gave a NaN row). Head 1 sees +inf: its row is NaN.
    case = _infinite_key_case([2, 5])
    got = run_core(case)
    assert bool(torch.isfinite(got[0, 0]).all()) and bool(torch.isnan(got[0, 1]).all())
    assert_matches_reference(case, got)


def test_a_nan_score_makes_the_row_nan() -> None:
    case = make_case(23, sequences=((8, 2),), heads=(2, 1), head_dim=16, block_size=4)
    case.key_cache[int(case.block_table[0, 1]), 1, 0, 3] = math.nan  # position 5: both tokens see it
    got = run_core(case)
    assert bool(torch.isnan(got).all())
    assert_matches_reference(case, got)


@pytest.mark.parametrize("sink", [None, 0.5, -math.inf, math.nan, math.inf])
def test_every_score_negative_infinite(sink) -> None:
    # No finite score: NaN, unless a finite sink gives the denominator (then the output is 0).
    case = _infinite_key_case(range(9), sink=sink)
    got = run_core(case)
    if sink == 0.5:
        assert bool((got[0, 0] == 0).all())
    else:
        assert bool(torch.isnan(got[0, 0]).all())
    assert bool(torch.isnan(got[0, 1]).all())  # +inf scores (and any sink)
    assert_matches_reference(case, got)


@pytest.mark.parametrize("sink", [None, 0.25])
def test_a_split_context_merges_by_the_same_rules(sink) -> None:
    # A decode over 1,200 positions is cut in shares (at least 256 positions each) merged afterwards:
    # a share whose scores are all -inf adds nothing, a NaN in one share poisons the row, and with
    # every share -inf the sink alone gives 0.
    case = make_case(47, sequences=((1199, 1),), heads=(2, 1), head_dim=16, block_size=16)
    case.query[0, 0, 0], case.query[0, 1, 0] = -1.5, -1.5
    if sink is not None:
        case.head_sink = torch.tensor([sink, sink], dtype=torch.float32)

    def set_key(positions, value):
        for position in positions:
            case.key_cache[int(case.block_table[0, position // 16]), position % 16, 0, 0] = value

    set_key(range(0, 600), math.inf)  # the first shares: every score -inf, their values NaN
    for position in range(0, 600):
        case.value_cache[int(case.block_table[0, position // 16]), position % 16, 0] = math.nan
    got = run_core(case)
    assert bool(torch.isfinite(got).all())
    assert_matches_reference(case, got)
    set_key(range(600, 1200), math.inf)  # every share -inf: NaN, or 0 with the sink
    got = run_core(case)
    assert bool((got == 0).all()) if sink is not None else bool(torch.isnan(got).all())
    assert_matches_reference(case, got)
    set_key([1000], math.nan)  # one NaN score in a late share
    assert bool(torch.isnan(run_core(case)).all())


def test_a_nan_or_positive_infinite_sink_makes_the_row_nan() -> None:
    for sink in (math.nan, math.inf):
        case = make_case(29, sink=True)
        case.head_sink[3] = sink
        got = run_core(case)
        assert bool(torch.isnan(got[:, 3]).all()) and bool(torch.isfinite(got[:, [0, 1, 2, 4]]).all())
        assert_matches_reference(case, got)


def test_softcap_maps_infinite_scores_to_its_limits() -> None:
    # tanh(+-inf) = +-1: with a softcap, +-inf scores are +-softcap, finite; the rules above apply
    # to capped scores, and the NaN value rows are then multiplied in (their weights are not 0).
    case = _infinite_key_case([2], softcap=4.0)
    case.value_cache.nan_to_num_(0.0)
    got = run_core(case)
    assert bool(torch.isfinite(got).all())
    assert_matches_reference(case, got)


# --------------------------------------------------------------------------- #
# Refusals: the core runs only plans it can run memory-safely, and says why not
# --------------------------------------------------------------------------- #
def _refused(case: CoreCase, edit, error, match: str) -> None:
    with pytest.raises(error, match=match):
        run_core(case, edit)


def _set(**fields):
    def edit(plan):
        for name, value in fields.items():
            setattr(plan, name, value)

    return edit


@pytest.mark.parametrize(
    "fields, error, match",
    [
        (dict(key_type=7), TypeError, r"key_cache type 7 is not one the attention core reads"),
        (dict(value_type=11), TypeError, r"value_cache type 11 is not one"),
        (dict(query_type=3), TypeError, r"query type 3 / output type 1"),
        (dict(out_type=17), TypeError, r"output type 17"),
        (dict(key_quant=1), TypeError, r"key_cache of type 1 has quantization 1: float types take none"),
        (dict(key_type=3), TypeError, r"key_cache of type 3 has quantization 0"),
        (dict(value_type=17, value_quant=2), ValueError, r"value_cache is quantized \(mode 2\) but its scale is NULL"),
        (dict(key_type=3, key_quant=1), ValueError, r"key_cache is quantized \(mode 1\) but its scale is NULL"),
        (dict(softcap=-1.0), ValueError, r"softcap must be finite and >= 0"),
        (dict(softcap=math.nan), ValueError, r"softcap must be finite"),
        (dict(softcap=math.inf), ValueError, r"softcap must be finite"),
        (dict(scale=math.inf), ValueError, r"scale must be finite"),
        (dict(window=-2), ValueError, r"window must be >= 0 .* got -2"),
        (dict(causal=2), ValueError, r"causal must be 0 or 1, got 2"),
        (dict(struct_size=8), ValueError, r"ABI mismatch"),
        (dict(num_kv_heads=3), ValueError, r"sizes out of range"),
        (dict(dequantized_type=1), TypeError, r"dequantized_type 1: 0 .*, float16 \(10\) or bfloat16 \(16\)"),
        (dict(dequantized_type=3), TypeError, r"dequantized_type 3"),
    ],
)
def test_malformed_plans_are_refused(fields, error, match) -> None:
    _refused(make_case(31), _set(**fields), error, match)


def test_a_quantized_plan_with_its_scale_runs() -> None:
    # The refusal above is for the NULL scale only: the same plan with its scale runs.
    case = make_case(31, key=(torch.int8, PER_TENSOR))
    assert_matches_reference(case)
    _refused(case, _set(key_scale=None), ValueError, "scale is NULL")


def test_a_block_id_a_query_reads_is_checked_and_one_it_does_not_is_not() -> None:
    case = make_case(37, sequences=((40, 2),), window=4, block_size=8)
    assert int(case.block_table[0, 0]) == -1  # positions 0..7: before every window, never read
    assert_matches_reference(case)
    case.block_table[0, 4] = case.key_cache.shape[0]  # positions 32..39: read
    _refused(case, None, ValueError, r"entry \(0, 4\) = \d+ is outside \[0, \d+\)")
