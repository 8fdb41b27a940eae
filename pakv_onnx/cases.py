"""Reproducible GatherPaKvCache cases: the seed's network sweep, its manual shapes, random cases.

The seed cases follow the generation rule of ``data/seed_sweep.json`` exactly (seeds included),
so the same id always yields the same bytes. Random cases exercise what the seed's
ascending, contiguous block ids never do: shuffled, repeated and out-of-order blocks,
non-zero ``seq_offset``, zero-length sequences, partial tail blocks, junk in unused
block-table columns, every cache dtype, both layouts and both ``seq_lens`` forms.
"""

from __future__ import annotations

import dataclasses
import enum
import random
from collections.abc import Sequence
from typing import Any

import torch

from pakv_onnx import seed_sweep
from pakv_onnx.spec import (
    CACHE_DTYPES,
    CacheMode,
    cache_dtype,
    index_dtype,
    nz_last_dim,
)


@dataclasses.dataclass(frozen=True)
class GatherCase:
    """The inputs and attributes of one GatherPaKvCache call."""

    case_id: str
    description: str
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    seq_offset: torch.Tensor | None
    cache_mode: CacheMode = CacheMode.NORM
    is_seq_lens_cumsum: bool = True

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Positional inputs in the contract's order."""
        return (self.key_cache, self.value_cache, self.block_tables, self.seq_lens, self.seq_offset)

    def attributes(self) -> dict[str, Any]:
        """Keyword attributes for :func:`pakv_onnx.gather_pa_kv_cache`."""
        return {"cache_mode": self.cache_mode, "is_seq_lens_cumsum": self.is_seq_lens_cumsum}

    def golden(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(key, value) from the torch reference: the expected outputs of this case."""
        from pakv_onnx.ops import gather_pa_kv_cache  # ops imports kernels; keep cases importable alone

        return gather_pa_kv_cache(*self.inputs(), **self.attributes(), backend="golden")

    def summary(self) -> str:
        """One line: dtype, layout and shapes."""
        offset = "none" if self.seq_offset is None else str(list(self.seq_offset.shape))
        form = "cumsum" if self.is_seq_lens_cumsum else "lengths"
        return (
            f"{str(self.key_cache.dtype).removeprefix('torch.')} {self.cache_mode.value} "
            f"key_cache={list(self.key_cache.shape)} value_cache={list(self.value_cache.shape)} "
            f"block_tables={list(self.block_tables.shape)} seq_lens={list(self.seq_lens.shape)}({form}) "
            f"seq_offset={offset}"
        )


# --------------------------------------------------------------------------- #
# The seed sweep
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(frozen=True)
class SeedCaseSpec:
    """One entry of ``seed_sweep.json`` (cheap to list; :meth:`build` makes the tensors)."""

    case_id: str
    description: str
    seed: int
    key_cache_shape: tuple[int, int, int, int]
    value_cache_shape: tuple[int, int, int, int]
    block_table_cols: int
    q_count: int
    total_tokens: int
    manual: bool

    def build(self) -> GatherCase:
        """Generate the case's tensors by the sweep's rule (deterministic)."""
        return _build_seed_case(self)


def seed_cases() -> tuple[SeedCaseSpec, ...]:
    """The seed's network sweep (``level0`` ... ``level9``) then its two manual shapes."""
    return tuple(
        SeedCaseSpec(
            case_id=c["id"],
            description=c["description"],
            seed=c["seed"],
            key_cache_shape=tuple(c["key_cache_shape"]),
            value_cache_shape=tuple(c["value_cache_shape"]),
            block_table_cols=c["block_table_cols"],
            q_count=c["q_count"],
            total_tokens=c["total_tokens"],
            manual=manual,
        )
        for c, manual in seed_sweep.entries()
    )


def seed_case(case_id: str) -> SeedCaseSpec:
    """The seed case called ``case_id``; ``ValueError`` listing the ids otherwise."""
    seed_sweep.check_case_id(case_id)
    return next(spec for spec in seed_cases() if spec.case_id == case_id)


def even_split(total: int, parts: int) -> list[int]:
    """``total`` split over ``parts`` as evenly as possible; the first ``total % parts`` get one more."""
    base, extra = divmod(total, parts)
    return [base + (1 if q < extra else 0) for q in range(parts)]


# Elements per randn call in seeded_randn: ~16 MB of fp32, a few ms, so Ctrl-C lands promptly.
RANDN_CHUNK = 1 << 22


def seeded_randn(
    shape: tuple[int, ...], generator: torch.Generator, dtype: torch.dtype, chunk: int = RANDN_CHUNK
) -> torch.Tensor:
    """``torch.randn(shape, generator=generator).to(dtype)``, bit for bit, made chunk by chunk.

    One randn + cast over the seed's 361M-element key cache is two C calls of about 2 s each
    that Ctrl-C cannot interrupt (Python handles signals between calls) and a 1.4 GB fp32
    temporary. CPU randn draws one uniform per element in order and transforms them in groups
    of 16 (re-drawing the last 16 when the size is not a multiple of 16), so consecutive calls
    over chunks that are multiples of 16, the last one at least 16 long, draw the same stream
    and give the same values and generator state (``tests/test_cli_cases.py`` checks this).

    Args:
        shape: output shape.
        generator: CPU generator, advanced exactly as one ``randn(shape)`` would advance it.
        dtype: output dtype (the cast is per chunk).
        chunk: elements per call, a multiple of 16.
    """
    if chunk % 16:
        raise ValueError(f"chunk must be a multiple of 16, got {chunk}")
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(-1)
    total = flat.numel()
    if total < 2 * chunk:
        flat.copy_(torch.randn(total, generator=generator))
        return out
    bounds = list(range(0, total, chunk))
    if total - bounds[-1] < 16:  # a last piece under 16 would take randn's serial path
        bounds.pop()
    for start, stop in zip(bounds, [*bounds[1:], total]):
        flat[start:stop].copy_(torch.randn(stop - start, generator=generator))
    return out


def _build_seed_case(spec: SeedCaseSpec) -> GatherCase:
    nb, bs = spec.key_cache_shape[0], spec.key_cache_shape[1]
    lengths = even_split(spec.total_tokens, spec.q_count)
    seq_lens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    seq_offset = torch.zeros(spec.q_count, dtype=torch.int32)
    block_tables = torch.zeros(spec.q_count, spec.block_table_cols, dtype=torch.int32)
    counter = 0
    for q, length in enumerate(lengths):
        used = int(seq_offset[q]) // bs + -(-length // bs)
        for col in range(used):
            block_tables[q, col] = counter % nb
            counter += 1
    generator = torch.Generator().manual_seed(spec.seed)
    key_cache = seeded_randn(spec.key_cache_shape, generator, torch.bfloat16)
    value_cache = seeded_randn(spec.value_cache_shape, generator, torch.bfloat16)
    return GatherCase(
        case_id=spec.case_id,
        description=spec.description,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        seq_lens=seq_lens,
        seq_offset=seq_offset,
    )


# --------------------------------------------------------------------------- #
# Random cases
# --------------------------------------------------------------------------- #
def random_cache(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Random cache contents with no NaN: normal values for float types, random bytes for integers."""
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    itemsize = cache_dtype(dtype).itemsize
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8, generator=generator)
    return raw.view(dtype)


class BlockIds(str, enum.Enum):
    """How :func:`paged_case` fills the block-table columns a sequence reads."""

    RANDOM = "random"  # any block, repeats and any order: what the op must survive
    DISTINCT = "distinct"  # a shuffled permutation of the pool: what a block allocator hands out
    SEQUENTIAL = "sequential"  # ascending ids in order of use: the seed sweep's rule


class UnusedColumns(str, enum.Enum):
    """How :func:`paged_case` fills the block-table columns no sequence reads."""

    JUNK = "junk"  # random ids, out-of-range ones included: the op must never read them
    PAD = "pad"  # -1, as a serving engine pads its tables


def cache_layout(
    mode: CacheMode, num_blocks: int, block_size: int, heads: int, head_dim: int, itemsize: int
) -> tuple[int, ...]:
    """Cache shape for ``heads x head_dim`` token rows: Norm ``[nb, bs, H, D]``, PA_NZ ``[nb, H*D // E, bs, E]``."""
    if mode is CacheMode.NORM:
        return (num_blocks, block_size, heads, head_dim)
    e = nz_last_dim(itemsize)
    return (num_blocks, heads * head_dim // e, block_size, e)


def paged_case(
    *,
    case_id: str,
    description: str,
    lengths: Sequence[int],
    block_size: int,
    num_blocks: int,
    key_token: tuple[int, int],
    value_token: tuple[int, int],
    key_dtype: torch.dtype,
    value_dtype: torch.dtype | None = None,
    offset_cols: Sequence[int] | None = None,
    offset_slots: Sequence[int] | None = None,
    extra_cols: int = 0,
    cache_mode: CacheMode = CacheMode.NORM,
    is_seq_lens_cumsum: bool = True,
    index_dtypes: tuple[torch.dtype, torch.dtype, torch.dtype] = (torch.int32, torch.int32, torch.int32),
    with_seq_offset: bool = True,
    block_ids: BlockIds = BlockIds.RANDOM,
    unused_columns: UnusedColumns = UnusedColumns.JUNK,
    rng: random.Random,
    generator: torch.Generator,
) -> GatherCase:
    """The one builder of paged cases: every random case generator draws sizes, then calls this.

    Args:
        lengths: tokens of each sequence (Q = len(lengths)).
        key_token, value_token: ``(heads, head_dim)`` of one token row of each cache.
        key_dtype, value_dtype: the caches' dtypes (value defaults to key's).
        offset_cols: first block-table column of each sequence (default 0).
        offset_slots: tokens added to each ``seq_offset`` below a block (the floor rule drops
            them; default 0).
        extra_cols: block-table columns beyond the longest row.
        index_dtypes: dtypes of (block_tables, seq_lens, seq_offset).
        with_seq_offset: pass a ``seq_offset`` input (else ``None``; offsets must then be 0).
        block_ids, unused_columns: the policies of :class:`BlockIds` and :class:`UnusedColumns`.
        rng, generator: draw the block ids (``rng``) and the junk and cache values (``generator``).
    """
    value_dtype = value_dtype or key_dtype
    num_seqs = len(lengths)
    offset_cols = list(offset_cols) if offset_cols is not None else [0] * num_seqs
    offset_slots = list(offset_slots) if offset_slots is not None else [0] * num_seqs
    if not with_seq_offset and any(offset_cols + offset_slots):
        raise ValueError("paged_case: offsets need with_seq_offset=True")
    used_cols = [off + -(-n // block_size) for off, n in zip(offset_cols, lengths)]
    cols = max(1, max(used_cols, default=0) + extra_cols)
    if unused_columns is UnusedColumns.JUNK:
        tables = torch.randint(-3, num_blocks + 3, (num_seqs, cols), generator=generator)
    else:
        tables = torch.full((num_seqs, cols), -1, dtype=torch.int64)
    pool = list(range(num_blocks))
    if block_ids is BlockIds.DISTINCT:
        rng.shuffle(pool)
    counter = 0
    for q in range(num_seqs):
        for col in range(offset_cols[q], used_cols[q]):
            if block_ids is BlockIds.RANDOM:
                tables[q, col] = rng.randrange(num_blocks)
            elif block_ids is BlockIds.DISTINCT:
                tables[q, col] = pool.pop()
            else:
                tables[q, col] = counter % num_blocks
                counter += 1

    def cache(token: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        shape = cache_layout(cache_mode, num_blocks, block_size, *token, cache_dtype(dtype).itemsize)
        return random_cache(shape, dtype, generator)

    bt_dtype, sl_dtype, so_dtype = index_dtypes
    running = torch.tensor([0, *lengths]).cumsum(0)
    seq_lens = running if is_seq_lens_cumsum else torch.tensor(list(lengths), dtype=torch.int64)
    offsets = [c * block_size + x for c, x in zip(offset_cols, offset_slots)]
    return GatherCase(
        case_id=case_id,
        description=description,
        key_cache=cache(key_token, key_dtype),
        value_cache=cache(value_token, value_dtype),
        block_tables=tables.to(bt_dtype),
        seq_lens=seq_lens.to(sl_dtype),
        seq_offset=torch.tensor(offsets, dtype=so_dtype) if with_seq_offset else None,
        cache_mode=cache_mode,
        is_seq_lens_cumsum=is_seq_lens_cumsum,
    )


def random_case(
    seed: int,
    *,
    dtype: torch.dtype | None = None,
    cache_mode: CacheMode | None = None,
    is_seq_lens_cumsum: bool | None = None,
    index_dtypes: tuple[torch.dtype, torch.dtype, torch.dtype] | None = None,
    with_seq_offset: bool | None = None,
    max_seqs: int = 6,
    max_blocks: int = 24,
) -> GatherCase:
    """A small random valid case; every option left ``None`` is drawn from ``seed``.

    Args:
        seed: makes the case reproducible.
        dtype: cache dtype (any of the contract's).
        cache_mode: layout.
        is_seq_lens_cumsum: ``seq_lens`` form.
        index_dtypes: dtypes of (block_tables, seq_lens, seq_offset), each int32 or int64.
        with_seq_offset: pass a (non-zero) ``seq_offset`` input or ``None``.
        max_seqs, max_blocks: size bounds (Q in [1, max_seqs], num_blocks in [1, max_blocks]).
    """
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    dtype = dtype if dtype is not None else rng.choice(CACHE_DTYPES).torch_dtype
    mode = cache_mode if cache_mode is not None else rng.choice(list(CacheMode))
    is_cumsum = is_seq_lens_cumsum if is_seq_lens_cumsum is not None else rng.random() < 0.5
    index_dtypes = index_dtypes or tuple(rng.choice((torch.int32, torch.int64)) for _ in range(3))
    with_offset = with_seq_offset if with_seq_offset is not None else rng.random() < 0.7

    num_blocks = rng.randint(1, max_blocks)
    block_size = rng.choice((1, 2, 3, 4, 8, 16))
    num_seqs = rng.randint(1, max_seqs)
    e = nz_last_dim(cache_dtype(dtype).itemsize)

    def token() -> tuple[int, int]:
        heads = rng.randint(1, 3)
        if mode is CacheMode.PA_NZ:
            return heads, e * rng.randint(1, 3)  # heads*dim must split into 32-byte fractals
        return heads, rng.randint(1, 9)

    key_token, value_token = token(), token()
    lengths = [rng.choice((0, rng.randint(1, block_size), rng.randint(1, 3 * block_size + 1))) for _ in range(num_seqs)]
    return paged_case(
        case_id=f"random-{seed}",
        description=f"random case seed {seed}",
        lengths=lengths,
        block_size=block_size,
        num_blocks=num_blocks,
        key_token=key_token,
        value_token=value_token,
        key_dtype=dtype,
        offset_cols=[rng.randint(0, 2) if with_offset else 0 for _ in range(num_seqs)],
        extra_cols=rng.randint(0, 2),
        cache_mode=mode,
        is_seq_lens_cumsum=is_cumsum,
        index_dtypes=index_dtypes,
        with_seq_offset=with_offset,
        rng=rng,
        generator=generator,
    )


# --------------------------------------------------------------------------- #
# ScatterPaKvCache cases
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(frozen=True)
class ScatterCase:
    """The inputs and attribute of one ScatterPaKvCache call (the caches are the ones written)."""

    case_id: str
    description: str
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor
    cache_mode: CacheMode = CacheMode.NORM

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """Positional inputs in the contract's order (spec.SCATTER.input_names)."""
        return (self.key, self.value, self.key_cache, self.value_cache, self.slot_mapping)

    def fresh(self) -> ScatterCase:
        """The same case with caches of its own (a scatter writes them)."""
        return dataclasses.replace(self, key_cache=self.key_cache.clone(), value_cache=self.value_cache.clone())

    def fresh_inputs(self) -> tuple[torch.Tensor, ...]:
        """:meth:`inputs` with the caches cloned (a run writes into them)."""
        return self.fresh().inputs()

    def attributes(self) -> dict:
        """The node's attributes as keywords."""
        return {"cache_mode": self.cache_mode.value}

    def summary(self) -> str:
        """One line naming the dtypes, shapes and how many slots are written (not padding)."""
        written = int((self.slot_mapping >= 0).sum())
        return (
            f"{cache_dtype(self.key.dtype).name}/{cache_dtype(self.value.dtype).name} {self.cache_mode.value} "
            f"key={list(self.key.shape)} value={list(self.value.shape)} key_cache={list(self.key_cache.shape)} "
            f"value_cache={list(self.value_cache.shape)} slot_mapping={index_dtype(self.slot_mapping.dtype).name} "
            f"T={self.key.shape[0]} written={written}"
        )

    def golden(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache) after the torch reference wrote copies of them."""
        from pakv_onnx.ops import scatter_pa_kv_cache

        case = self.fresh()
        return scatter_pa_kv_cache(*case.inputs(), cache_mode=self.cache_mode, backend="golden")


def random_scatter_case(
    seed: int,
    *,
    dtype: torch.dtype | None = None,
    value_dtype: torch.dtype | None = None,
    cache_mode: CacheMode | None = None,
    slot_dtype: torch.dtype | None = None,
    num_tokens: int | None = None,
    padding: bool = True,
) -> ScatterCase:
    """A small random valid scatter: unique slots anywhere in the pool (some runs of consecutive
    slots, as a prefill writes), a few padding slots (-1) when ``padding``; every option left
    ``None`` is drawn from ``seed``."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    mode = cache_mode if cache_mode is not None else rng.choice(list(CacheMode))
    key_dtype = dtype if dtype is not None else rng.choice(CACHE_DTYPES).torch_dtype
    vdtype = (
        value_dtype
        if value_dtype is not None
        else (key_dtype if rng.random() < 0.7 else rng.choice(CACHE_DTYPES).torch_dtype)
    )
    block_size, num_blocks = rng.choice([1, 2, 4, 16]), rng.randint(2, 10)
    capacity = num_blocks * block_size
    tokens = num_tokens if num_tokens is not None else rng.randint(0, min(capacity, 24))
    tokens = min(tokens, capacity)
    if rng.random() < 0.5 and tokens:  # a run of consecutive slots (a prefill)
        start = rng.randint(0, capacity - tokens)
        slots = list(range(start, start + tokens))
    else:
        slots = rng.sample(range(capacity), tokens)
    if padding:
        slots = [-1 if rng.random() < 0.15 else s for s in slots]
    shapes = []
    for dt in (key_dtype, vdtype):
        itemsize = cache_dtype(dt).itemsize
        e = nz_last_dim(itemsize)
        heads = rng.randint(1, 3)
        dim = e * rng.randint(1, 2) if mode is CacheMode.PA_NZ else rng.randint(1, 9)
        shapes.append((heads, dim, cache_layout(mode, num_blocks, block_size, heads, dim, itemsize)))
    (kh, kd, kshape), (vh, vd, vshape) = shapes
    return ScatterCase(
        case_id=f"scatter-{seed}",
        description=f"random scatter {seed}",
        key=random_cache((tokens, kh, kd), key_dtype, gen),
        value=random_cache((tokens, vh, vd), vdtype, gen),
        key_cache=random_cache(kshape, key_dtype, gen),
        value_cache=random_cache(vshape, vdtype, gen),
        slot_mapping=torch.tensor(slots, dtype=slot_dtype or rng.choice([torch.int32, torch.int64])),
        cache_mode=mode,
    )


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """One PagedAttention call, with each sequence's context kept dense beside the paged caches.

    ``contexts[b]`` is ``(keys [L, Hk, D], values [L, Hk, Dv])`` of sequence b, exactly the rows the
    caches hold at its positions (an independent reference reads those, never the block table).
    Cache rows no sequence owns hold random values; table entries past a sequence's context are -1
    (or, for a sequence without new tokens, any junk: the op does not read it).
    """

    case_id: str
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    cumulative_sequence_lengths: torch.Tensor
    past_sequence_lengths: torch.Tensor
    contexts: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    scale: float = 0.0

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """Positional inputs in the contract's order (spec.ATTENTION.input_names)."""
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_table,
            self.cumulative_sequence_lengths,
            self.past_sequence_lengths,
        )

    def summary(self) -> str:
        q, kc, vc = self.query, self.key_cache, self.value_cache
        new = (self.cumulative_sequence_lengths[1:] - self.cumulative_sequence_lengths[:-1]).tolist()
        return (
            f"{cache_dtype(q.dtype).name} query={list(q.shape)} key_cache={list(kc.shape)} value_cache={list(vc.shape)} "
            f"past={self.past_sequence_lengths.tolist()} new={new} scale={self.scale}"
        )


def random_attention_case(
    seed: int,
    *,
    dtype: torch.dtype = torch.float32,
    group: int | None = None,
    kv_heads: int | None = None,
    block_size: int | None = None,
    head_dim: int | None = None,
    value_head_dim: int | None = None,
    new_tokens: Sequence[int] | None = None,
    past: Sequence[int] | None = None,
    index_dtype: torch.dtype = torch.int32,
    scale: float = 0.0,
) -> AttentionCase:
    """A random valid PagedAttention: B sequences mixing prefill (many new tokens, with or without a
    past), decode (one new token) and idle ones (no new token), their contexts written into shuffled
    blocks of one pool, the table -1 padded. Options left ``None`` are drawn from ``seed``."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    group = group if group is not None else rng.choice([1, 2, 4])
    kv_heads = kv_heads if kv_heads is not None else rng.randint(1, 3)
    block_size = block_size if block_size is not None else rng.choice([1, 3, 8, 16])
    head_dim = head_dim if head_dim is not None else rng.choice([4, 8, 19, 32])
    value_head_dim = value_head_dim if value_head_dim is not None else rng.choice([head_dim, 8, 40])
    if new_tokens is None:
        batch = rng.randint(1, 5)
        new_tokens = [rng.choice([0, 1, 1, rng.randint(2, 40)]) for _ in range(batch)]
        if not any(new_tokens):
            new_tokens[0] = 1
    if past is None:
        past = [rng.choice([0, rng.randint(1, 70)]) for _ in new_tokens]
    lengths = [p + n for p, n in zip(past, new_tokens)]
    blocks_of = [-(-length // block_size) for length in lengths]
    num_blocks = sum(blocks_of) + rng.randint(1, 4)
    order = list(range(num_blocks))
    rng.shuffle(order)
    cols = max(blocks_of + [1]) + rng.randint(0, 2)
    table = torch.full((len(lengths), cols), -1, dtype=torch.int64)
    key_cache = random_cache((num_blocks, block_size, kv_heads, head_dim), dtype, gen)
    value_cache = random_cache((num_blocks, block_size, kv_heads, value_head_dim), dtype, gen)
    contexts = []
    for b, (length, count) in enumerate(zip(lengths, blocks_of)):
        ids = [order.pop() for _ in range(count)]
        table[b, :count] = torch.tensor(ids, dtype=torch.int64)
        keys = random_cache((length, kv_heads, head_dim), dtype, gen)
        values = random_cache((length, kv_heads, value_head_dim), dtype, gen)
        for p in range(length):
            key_cache[ids[p // block_size], p % block_size] = keys[p]
            value_cache[ids[p // block_size], p % block_size] = values[p]
        contexts.append((keys, values))
        if new_tokens[b] == 0 and count:
            table[b, 0] = num_blocks + 7  # junk where nothing is read
    cu = torch.tensor([0, *new_tokens]).cumsum(0)
    query = random_cache((int(cu[-1]), kv_heads * group, head_dim), dtype, gen)
    return AttentionCase(
        case_id=f"attention-{seed}",
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=table.to(index_dtype),
        cumulative_sequence_lengths=cu.to(index_dtype),
        past_sequence_lengths=torch.tensor(list(past), dtype=index_dtype),
        contexts=tuple(contexts),
        scale=scale,
    )
