"""Named ScatterPaKvCache cases for the PyPTO scatter kernel (verify, tune, the tests).

Cases are named, never pickled, so a subprocess rebuilds the same bytes from the name:

* ``scatter-norm-NAME`` / ``scatter-nz-NAME``: a small Norm / PA_NZ case of dtype NAME (one of the
  9 the kernel moves): a prefill run crossing blocks, decode tokens, padding slots;
* ``scatter-mixed-norm`` / ``scatter-mixed-nz``: key and value of different dtypes, heads and dims;
* ``scatter-pad``: mostly padding (negative slots), int64 slot_mapping;
* ``scatter-kernel-N``: a random case inside the kernel's support (layout, dtypes, widths, block
  size, slot pattern, int32/int64 slot_mapping drawn from N);
* ``scatter:DTYPE:KH,KD:VH,VD:BS:NB:PATTERN:T[:PA_NZ]``: explicit shapes for the cost model
  (``tune --op scatter``): ``decode`` (T single-token writes at random rows of distinct blocks)
  or ``prefillQ`` (Q sequences of T/Q tokens, each from row 0 of fresh blocks). Their caches
  are zeros (the cost model does not read data; zeros cost no memory until written).
"""

from __future__ import annotations

import random

import torch

from pakv_onnx.cases import ScatterCase, cache_layout, random_cache
from pakv_onnx.pypto.host import SUPPORTED_DTYPES, dtype_name
from pakv_onnx.spec import CacheMode, nz_last_dim

SMALL_NUM_BLOCKS = 24


def dtype_by_name() -> dict[str, torch.dtype]:
    return {dtype_name(d): d for d in SUPPORTED_DTYPES}


def prefill_slots(lengths, block_size: int, pool: list[int], start_rows=None) -> list[int]:
    """Slots of sequences written from ``start_rows`` (default 0), each through fresh blocks popped from ``pool``."""
    slots = []
    for index, n in enumerate(lengths):
        row = start_rows[index] if start_rows else 0
        block = pool.pop()
        for _ in range(n):
            if row == block_size:
                block, row = pool.pop(), 0
            slots.append(block * block_size + row)
            row += 1
    return slots


def mixed_slots(rng: random.Random, num_tokens: int, num_blocks: int, block_size: int, pad_share: float) -> list[int]:
    """A continuous batch: a prefill run (from a random row, through fresh blocks), decode tokens at random
    free slots, and padding (-1) at random positions."""
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    prefill = rng.randint(num_tokens // 3, num_tokens) if num_tokens > 1 else num_tokens
    need = -(-prefill // block_size) + 1
    slots = prefill_slots([prefill], block_size, pool[-need:], [rng.randrange(block_size)])
    taken = set(slots)
    free = [b * block_size + r for b in pool[:-need] for r in range(block_size)]
    rng.shuffle(free)
    slots += [s for s in free if s not in taken][: num_tokens - prefill]
    for index in range(len(slots)):
        if rng.random() < pad_share:
            slots[index] = -1
    return slots


def build_case(
    case_id: str,
    *,
    mode: CacheMode,
    key_dtype: torch.dtype,
    value_dtype: torch.dtype,
    key_hd: tuple[int, int],
    value_hd: tuple[int, int],
    block_size: int,
    num_blocks: int,
    slots: list[int],
    slot_dtype: torch.dtype = torch.int32,
    seed: int = 0,
    zero_caches: bool = False,
    description: str = "",
) -> ScatterCase:
    generator = torch.Generator().manual_seed(seed)
    num_tokens = len(slots)
    key = random_cache((num_tokens, *key_hd), key_dtype, generator)
    value = random_cache((num_tokens, *value_hd), value_dtype, generator)
    key_shape = cache_layout(mode, num_blocks, block_size, *key_hd, key_dtype.itemsize)
    value_shape = cache_layout(mode, num_blocks, block_size, *value_hd, value_dtype.itemsize)
    if zero_caches:
        key_cache, value_cache = torch.zeros(key_shape, dtype=key_dtype), torch.zeros(value_shape, dtype=value_dtype)
    else:
        key_cache = random_cache(key_shape, key_dtype, generator)
        value_cache = random_cache(value_shape, value_dtype, generator)
    return ScatterCase(
        case_id=case_id,
        description=description,
        key=key,
        value=value,
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=torch.tensor(slots, dtype=slot_dtype),
        cache_mode=mode,
    )


def kernel_case(
    seed: int,
    *,
    dtype: torch.dtype | None = None,
    value_dtype: torch.dtype | None = None,
    mode: CacheMode | None = None,
    slot_dtype: torch.dtype | None = None,
    pad_share: float | None = None,
    block_size: int | None = None,
    num_tokens: int | None = None,
    case_id: str | None = None,
) -> ScatterCase:
    """A small random case inside the kernel's support; options left ``None`` are drawn from ``seed``."""
    rng = random.Random(seed)
    dtypes = list(dtype_by_name().values())
    dtype = dtype or rng.choice(dtypes)
    value_dtype = value_dtype or (rng.choice(dtypes) if rng.random() < 0.3 else dtype)
    mode = mode or rng.choice(list(CacheMode))
    slot_dtype = slot_dtype or rng.choice((torch.int32, torch.int64))
    pad_share = rng.choice((0.0, 0.15)) if pad_share is None else pad_share
    block_size = block_size or rng.choice((1, 2, 4, 8, 16, 32))
    num_tokens = num_tokens or rng.randint(1, 3 * block_size + 5)
    num_blocks = max(SMALL_NUM_BLOCKS, 2 * (-(-num_tokens // block_size)) + 4)

    def token(dt: torch.dtype) -> tuple[int, int]:
        return rng.randint(1, 4), nz_last_dim(dt.itemsize) * rng.randint(1, 4)  # whole 32-byte blocks

    key_hd, value_hd = token(dtype), token(value_dtype)
    slots = mixed_slots(rng, num_tokens, num_blocks, block_size, pad_share)
    return build_case(
        case_id or f"scatter-kernel-{seed}",
        mode=mode,
        key_dtype=dtype,
        value_dtype=value_dtype,
        key_hd=key_hd,
        value_hd=value_hd,
        block_size=block_size,
        num_blocks=num_blocks,
        slots=slots,
        slot_dtype=slot_dtype,
        seed=seed,
        description=f"scatter kernel case seed {seed}",
    )


def _dtype_case(case_id: str, name: str, mode: CacheMode) -> ScatterCase:
    dtypes = dtype_by_name()
    if name not in dtypes:
        raise ValueError(f"bad case id {case_id!r}: dtype {name!r} not one of {', '.join(dtypes)}")
    seed = sum(map(ord, name)) + (0 if mode is CacheMode.NORM else 1000)
    return kernel_case(
        seed,
        dtype=dtypes[name],
        value_dtype=dtypes[name],
        mode=mode,
        pad_share=0.15,
        block_size=8,
        num_tokens=29,
        case_id=case_id,
    )


# each feature case: its seed and the options of :func:`kernel_case` it fixes
_FEATURE_OPTIONS = {
    "scatter-mixed-norm": (
        21,
        dict(dtype=torch.bfloat16, value_dtype=torch.int8, mode=CacheMode.NORM, block_size=16, num_tokens=40),  # noqa: C408
    ),
    "scatter-mixed-nz": (
        22,
        dict(dtype=torch.float16, value_dtype=torch.float32, mode=CacheMode.PA_NZ, block_size=16, num_tokens=40),  # noqa: C408
    ),
    "scatter-pad": (23, dict(pad_share=0.7, slot_dtype=torch.int64, block_size=4, num_tokens=20)),  # noqa: C408
}

FEATURE_CASES = tuple(_FEATURE_OPTIONS)


def _feature_case(name: str) -> ScatterCase:
    seed, options = _FEATURE_OPTIONS[name]
    return kernel_case(seed, case_id=name, **options)


def parse_shape_case(case_id: str) -> ScatterCase:
    """``scatter:DTYPE:KH,KD:VH,VD:BS:NB:PATTERN:T[:PA_NZ]`` (see the module docstring)."""
    dtypes = dtype_by_name()
    try:
        fields = case_id.split(":")
        mode = CacheMode.PA_NZ if len(fields) == 9 and fields.pop() == CacheMode.PA_NZ.value else CacheMode.NORM
        _, dtype, key, value, block_size, num_blocks, pattern, total = fields
        key_hd = tuple(int(v) for v in key.split(","))
        value_hd = tuple(int(v) for v in value.split(","))
        block_size, num_blocks, total = int(block_size), int(num_blocks), int(total)
        if len(key_hd) != 2 or len(value_hd) != 2 or min(*key_hd, *value_hd, block_size, num_blocks, total) < 1:
            raise ValueError
        rng = random.Random(total)
        pool = list(range(num_blocks))
        rng.shuffle(pool)
        if pattern == "decode":
            if total > num_blocks:
                raise ValueError
            slots = [pool.pop() * block_size + rng.randrange(block_size) for _ in range(total)]
        elif pattern.startswith("prefill"):
            q_count = int(pattern.removeprefix("prefill"))
            lengths = [total // q_count + (q < total % q_count) for q in range(q_count)]
            if sum(-(-n // block_size) for n in lengths) > num_blocks:
                raise ValueError
            slots = prefill_slots(lengths, block_size, pool)
        else:
            raise ValueError
        return build_case(
            case_id,
            mode=mode,
            key_dtype=dtypes[dtype],
            value_dtype=dtypes[dtype],
            key_hd=key_hd,
            value_hd=value_hd,
            block_size=block_size,
            num_blocks=num_blocks,
            slots=slots,
            zero_caches=True,
            description=f"{pattern} T={total} into {num_blocks} blocks of {block_size}",
        )
    except (ValueError, KeyError):
        raise ValueError(
            f"bad scatter shape case {case_id!r}: want scatter:DTYPE:KH,KD:VH,VD:BLOCK_SIZE:NUM_BLOCKS:"
            f"decode|prefillQ:T[:PA_NZ] (positive integers; decode needs T <= NUM_BLOCKS) with DTYPE one of "
            f"{', '.join(dtypes)}"
        ) from None


def default_case_ids(kernel_count: int = 4, first_seed: int = 0) -> list[str]:
    names = list(dtype_by_name())
    return [
        *(f"scatter-norm-{n}" for n in names),
        *(f"scatter-nz-{n}" for n in names),
        *FEATURE_CASES,
        *(f"scatter-kernel-{first_seed + i}" for i in range(kernel_count)),
    ]


# Representative shapes of the write side (tune --op scatter; the README's table): decode steps
# into a 1k-block pool, prefills of 512 and 4096 tokens, both layouts.
REPRESENTATIVE = (
    "scatter:bfloat16:8,128:8,128:128:1024:decode:4",
    "scatter:bfloat16:8,128:8,128:128:1024:decode:16",
    "scatter:bfloat16:8,128:8,128:128:1024:decode:64",
    "scatter:bfloat16:8,128:8,128:128:1024:prefill1:512",
    "scatter:bfloat16:8,128:8,128:128:1024:prefill4:4096",
    "scatter:bfloat16:8,128:8,128:128:1024:decode:16:PA_NZ",
    "scatter:bfloat16:8,128:8,128:128:1024:decode:64:PA_NZ",
    "scatter:bfloat16:8,128:8,128:128:1024:prefill1:512:PA_NZ",
    "scatter:bfloat16:8,128:8,128:128:1024:prefill4:4096:PA_NZ",
)


def build(case_id: str) -> ScatterCase:
    """Rebuild a named scatter case; ``ValueError`` on an unknown name."""
    if case_id.startswith("scatter-kernel-"):
        try:
            return kernel_case(int(case_id.removeprefix("scatter-kernel-")))
        except ValueError:
            raise ValueError(f"bad case id {case_id!r} (want scatter-kernel-N)") from None
    for prefix, mode in (("scatter-norm-", CacheMode.NORM), ("scatter-nz-", CacheMode.PA_NZ)):
        if case_id.startswith(prefix):
            return _dtype_case(case_id, case_id.removeprefix(prefix), mode)
    if case_id in FEATURE_CASES:
        return _feature_case(case_id)
    if case_id.startswith("scatter:"):
        return parse_shape_case(case_id)
    raise ValueError(
        f"unknown scatter case id {case_id!r} (known: scatter-norm-NAME, scatter-nz-NAME, {', '.join(FEATURE_CASES)}, "
        "scatter-kernel-N, scatter:DTYPE:KH,KD:VH,VD:BS:NB:decode|prefillQ:T[:PA_NZ])"
    )


def is_scatter_case(case_id: str) -> bool:
    return case_id.startswith("scatter")
