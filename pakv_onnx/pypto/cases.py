"""Named cases for the PyPTO kernel runs (``verify-kernel``, ``tune``, the tests).

Cases are named, never pickled, so a subprocess rebuilds the same bytes from the name:

* a seed id (``level0`` ... ``level9``, ``heads1_k128_v64``, ``heads64_k128_v128``): the seed
  case with ``num_blocks`` = :data:`SMALL_NUM_BLOCKS`, fewer for wide rows (the seed's
  5513-block caches take 812 MB and the interpreter's peak is about 24x its inputs);
* ``t4096``: the sweep's shapes with Q = 4 and T = 4096;
* ``random-N``: :func:`pakv_onnx.cases.random_case` (N) -- the same case as in every other
  command; the kernel may refuse it (then the run says why);
* ``kernel-N``: a random case inside the kernel's support (any supported dtype, both layouts,
  both seq_lens forms, int32/int64 indices, non-multiple seq_offset);
* ``dtype-NAME`` / ``nz-NAME``: a small Norm / PA_NZ case of cache dtype NAME;
* ``lengths``, ``offsets``, ``mixed``: lengths-mode seq_lens; seq_offset not a multiple of
  block_size; key and value caches of different dtypes;
* ``shape:DTYPE:KH,KD:VH,VD:BS:Q:T[:PA_NZ]``: explicit shapes in the sweep's pattern (for
  ``tune``), Norm unless ``:PA_NZ`` ends the id.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from pakv_onnx.cases import (
    BlockIds,
    GatherCase,
    UnusedColumns,
    even_split,
    paged_case,
    random_case,
    seed_case,
    seed_cases,
)
from pakv_onnx.pypto.host import SUPPORTED_DTYPES, dtype_name
from pakv_onnx.spec import CacheMode, nz_last_dim

SMALL_NUM_BLOCKS = 64
# Bytes of one small cache at most: the interpreter's peak is about 24x its inputs (the
# 64-head seed case with 64 blocks, 268 MB of caches, peaked at 7 GB), so wide rows get fewer blocks.
SMALL_CACHE_BYTES = 16 * 2**20
T4096_CASE = "t4096"
FEATURE_CASES = ("lengths", "offsets", "mixed")


def dtype_by_name() -> dict[str, torch.dtype]:
    return {dtype_name(d): d for d in SUPPORTED_DTYPES}


def small_seed_case(case_id: str, num_blocks: int | None = None) -> GatherCase:
    """The seed case ``case_id`` with few cache blocks (generation rule otherwise unchanged).

    ``num_blocks`` defaults to :data:`SMALL_NUM_BLOCKS`, fewer when a cache would pass
    :data:`SMALL_CACHE_BYTES`, never fewer than the case uses.
    """
    spec = seed_case(case_id)
    if num_blocks is None:
        block_bytes = max(
            2 * spec.key_cache_shape[1] * spec.key_cache_shape[2] * spec.key_cache_shape[3],
            2 * spec.value_cache_shape[1] * spec.value_cache_shape[2] * spec.value_cache_shape[3],
        )  # the seed's caches are bf16
        used = -(-spec.total_tokens // spec.key_cache_shape[1]) + spec.q_count
        num_blocks = max(min(SMALL_NUM_BLOCKS, SMALL_CACHE_BYTES // block_bytes), used)
    small = dataclasses.replace(
        spec,
        key_cache_shape=(num_blocks, *spec.key_cache_shape[1:]),
        value_cache_shape=(num_blocks, *spec.value_cache_shape[1:]),
    )
    case = small.build()
    return dataclasses.replace(case, description=f"{case.description}, num_blocks {num_blocks}")


def shape_spec(
    dtype: torch.dtype,
    key_hd,
    value_hd,
    block_size: int,
    q_count: int,
    total_tokens: int,
    mode: CacheMode = CacheMode.NORM,
) -> str:
    name = dtype_name(dtype)  # the key parse_shape_case looks up in dtype_by_name
    spec = f"{name}:{key_hd[0]},{key_hd[1]}:{value_hd[0]},{value_hd[1]}:{block_size}:{q_count}:{total_tokens}"
    return spec if mode is CacheMode.NORM else f"{spec}:{mode.value}"


def shape_case(
    dtype: torch.dtype,
    key_hd: tuple[int, int],
    value_hd: tuple[int, int],
    block_size: int,
    q_count: int,
    total_tokens: int,
    *,
    mode: CacheMode = CacheMode.NORM,
    seed: int = 0,
    case_id: str | None = None,
) -> GatherCase:
    """A case in the sweep's pattern (Norm or PA_NZ): T split evenly over Q, consecutive block ids, zero offsets."""
    lengths = even_split(total_tokens, q_count)
    used = sum(-(-n // block_size) for n in lengths)
    itemsize = dtype.itemsize
    block_bytes = block_size * max(key_hd[0] * key_hd[1], value_hd[0] * value_hd[1]) * itemsize
    return paged_case(
        case_id=case_id or f"shape:{shape_spec(dtype, key_hd, value_hd, block_size, q_count, total_tokens, mode)}",
        description=f"Q={q_count} T={total_tokens} block_size={block_size}",
        lengths=lengths,
        block_size=block_size,
        num_blocks=max(used, min(SMALL_NUM_BLOCKS, SMALL_CACHE_BYTES // block_bytes)),
        key_token=key_hd,
        value_token=value_hd,
        key_dtype=dtype,
        cache_mode=mode,
        block_ids=BlockIds.SEQUENTIAL,
        unused_columns=UnusedColumns.PAD,
        rng=random.Random(seed),
        generator=torch.Generator().manual_seed(seed),
    )


def t4096_case() -> GatherCase:
    """The sweep's shapes (key 1x512, value 1x64, bf16, 128-row blocks) with Q = 4, T = 4096."""
    return shape_case(torch.bfloat16, (1, 512), (1, 64), 128, 4, 4096, seed=4096, case_id=T4096_CASE)


def kernel_case(
    seed: int,
    *,
    dtype: torch.dtype | None = None,
    value_dtype: torch.dtype | None = None,
    mode: CacheMode | None = None,
    is_cumsum: bool | None = None,
    partial_offsets: bool | None = None,
    case_id: str | None = None,
) -> GatherCase:
    """A small random case inside the kernel's support; options left ``None`` are drawn from ``seed``.

    Shuffled and repeated block ids, junk in unused table columns, a zero-length sequence,
    a partial tail block, non-zero seq_offset.
    """
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    dtypes = list(dtype_by_name().values())
    dtype = dtype or rng.choice(dtypes)
    value_dtype = value_dtype or dtype
    mode = mode or rng.choice(list(CacheMode))
    is_cumsum = rng.random() < 0.5 if is_cumsum is None else is_cumsum
    if partial_offsets is None:
        partial_offsets = rng.random() < 0.5
    block_size = rng.choice((1, 2, 4, 8, 16, 32))
    num_blocks = rng.randint(8, SMALL_NUM_BLOCKS)
    num_seqs = rng.randint(2, 6)

    def token(dt: torch.dtype) -> tuple[int, int]:
        return rng.randint(1, 4), nz_last_dim(dt.itemsize) * rng.randint(1, 4)  # whole 32-byte blocks

    key_token, value_token = token(dtype), token(value_dtype)
    lengths = [rng.randint(0, 3 * block_size + block_size // 2) for _ in range(num_seqs)]
    lengths[rng.randrange(num_seqs)] = 0
    lengths[rng.randrange(num_seqs)] = block_size + max(1, block_size // 2) if block_size > 1 else 3
    offset_cols = [rng.randint(0, 2) for _ in range(num_seqs)]
    offset_cols[rng.randrange(num_seqs)] = rng.randint(1, 3)
    extra_cols = rng.randint(0, 2)
    index_dtype = rng.choice((torch.int32, torch.int64))
    return paged_case(
        case_id=case_id or f"kernel-{seed}",
        description=f"kernel case seed {seed}",
        lengths=lengths,
        block_size=block_size,
        num_blocks=num_blocks,
        key_token=key_token,
        value_token=value_token,
        key_dtype=dtype,
        value_dtype=value_dtype,
        offset_cols=offset_cols,
        offset_slots=[rng.randrange(block_size) if partial_offsets else 0 for _ in range(num_seqs)],
        extra_cols=extra_cols,
        cache_mode=mode,
        is_seq_lens_cumsum=is_cumsum,
        index_dtypes=(index_dtype,) * 3,
        rng=rng,
        generator=generator,
    )


def _feature_case(name: str) -> GatherCase:
    if name == "lengths":
        return kernel_case(11, dtype=torch.bfloat16, mode=CacheMode.NORM, is_cumsum=False, case_id=name)
    if name == "offsets":
        return kernel_case(12, dtype=torch.float16, mode=CacheMode.NORM, partial_offsets=True, case_id=name)
    return kernel_case(13, dtype=torch.bfloat16, value_dtype=torch.int8, mode=CacheMode.PA_NZ, case_id=name)


def seed_case_ids() -> list[str]:
    return [spec.case_id for spec in seed_cases()]


def default_case_ids(kernel_count: int = 4, first_seed: int = 0) -> list[str]:
    """verify-kernel's default list: seed sweep, t4096, each dtype in Norm and PA_NZ, the features, kernel-N."""
    names = list(dtype_by_name())
    return [
        *seed_case_ids(),
        T4096_CASE,
        *(f"dtype-{n}" for n in names),
        *(f"nz-{n}" for n in names),
        *FEATURE_CASES,
        *(f"kernel-{first_seed + i}" for i in range(kernel_count)),
    ]


def _int_suffix(case_id: str, prefix: str) -> int:
    try:
        return int(case_id.removeprefix(prefix))
    except ValueError:
        raise ValueError(f"bad case id {case_id!r} (want {prefix}N)") from None


def build_case(case_id: str) -> GatherCase:
    """Rebuild a named case (see the module docstring); ``ValueError`` on an unknown name."""
    if case_id == T4096_CASE:
        return t4096_case()
    if case_id.startswith("random-"):
        return random_case(_int_suffix(case_id, "random-"))
    if case_id.startswith("kernel-"):
        return kernel_case(_int_suffix(case_id, "kernel-"))
    for prefix, mode in (("dtype-", CacheMode.NORM), ("nz-", CacheMode.PA_NZ)):
        if case_id.startswith(prefix):
            name = case_id.removeprefix(prefix)
            dtypes = dtype_by_name()
            if name not in dtypes:
                raise ValueError(f"bad case id {case_id!r}: dtype {name!r} not one of {', '.join(dtypes)}")
            return kernel_case(sum(map(ord, name)), dtype=dtypes[name], mode=mode, case_id=case_id)
    if case_id in FEATURE_CASES:
        return _feature_case(case_id)
    if case_id.startswith("shape:"):
        return parse_shape_case(case_id)
    try:
        return small_seed_case(case_id)
    except ValueError:
        raise ValueError(
            f"unknown case id {case_id!r} (known: seed ids, {T4096_CASE}, random-N, kernel-N, dtype-NAME, nz-NAME, "
            f"{', '.join(FEATURE_CASES)}, shape:DTYPE:KH,KD:VH,VD:BS:Q:T[:PA_NZ])"
        ) from None


def parse_shape_case(case_id: str) -> GatherCase:
    dtypes = dtype_by_name()
    try:
        fields = case_id.split(":")
        mode = CacheMode.NORM
        if len(fields) == 8:
            mode = CacheMode(fields.pop())
        _, dtype, key, value, block_size, q_count, total = fields
        key_hd = tuple(int(v) for v in key.split(","))
        value_hd = tuple(int(v) for v in value.split(","))
        numbers = (int(block_size), int(q_count), int(total))
        if len(key_hd) != 2 or len(value_hd) != 2 or min(*key_hd, *value_hd, *numbers) < 1:
            raise ValueError
        return shape_case(dtypes[dtype], key_hd, value_hd, *numbers, mode=mode)
    except (ValueError, KeyError):
        raise ValueError(
            f"bad shape case {case_id!r}: want shape:DTYPE:KH,KD:VH,VD:BLOCK_SIZE:Q:T[:PA_NZ] (positive integers) "
            f"with DTYPE one of {', '.join(dtypes)}"
        ) from None
