"""Tiles of the PyPTO kernel: chunk and vector tile per cache, the closed-form rule, the tuned cache.

A *chunk* is the number of token slots one kernel task moves (a divisor of ``block_size``);
the *vector tile* is what ``pypto.set_vec_tile_shapes`` gets for that task. A tile must fit
the AICore vector buffer (:data:`VECTOR_BUFFER_BYTES`): pypto 0.2.0 compiles a Norm copy tile
iff ``rows * cols * itemsize <= 196,608`` (64 heads x 128 bf16 compiles with 12 rows, not 13).

PA_NZ tiles are ``(fractals, rows)``: one task moves ``fractals`` of a token row's ``C``
32-byte fractals (a *fractal group*; ``C / fractals`` groups per chunk) for ``rows = chunk``
slots. The cost model charges a TRANSPOSE_MOVEOUT about 68 cycles per fractal plane whatever
the rows, so a chunk of a wide row is cheaper split into groups spread over the cores, and a
chunk of one slot needs no transpose at all (the rows kernel). Key and value group counts
may differ when one divides the other (an entry moves group ``g % G`` of each; the cache
with fewer groups is then moved more than once, which the cost model charges like any copy).

What the cost model charges (FACTS section 8): the static view shape, not its valid rows; a
large fixed latency per DMA; tasks spread over 48 vector cores, dispatched one after another.
So a chunk that is too big pays for rows that a short sequence does not have, and one that is
too small pays the fixed latency many times. :func:`rule_tiles` estimates both with that
model and takes the cheapest chunk; ``pakv-onnx tune`` measures the candidates with the real
cost model, and caches the cheapest (:func:`remember`), which :func:`tuned` then returns for
that shape.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from pakv_onnx.spec import NZ_FRACTAL_BYTES

if TYPE_CHECKING:  # plans imports torch; tiles is read without it
    from pakv_onnx.plans import GatherPlan

VECTOR_BUFFER_BYTES = 196_608
ALIGN_BYTES = 32  # a vector tile row must be a multiple of one 32-byte block
NO_TILE_FITS = f"no 32-byte aligned vector tile fits the {VECTOR_BUFFER_BYTES}-byte vector buffer"

# The seed kernel's fixed rule, kept to compare against.
SEED_DEFAULT_ROWS = (16, 32)
SEED_LARGE_TOKEN_ROWS = (8, 8)
SEED_LARGE_TOKEN_ELEMENTS = 4096

# The rule's model of the cost model (cycles). Shape from FACTS section 8 (a fixed DMA latency
# per task, bytes at a DMA rate, 48 vector cores, a dispatch gap per task); the three constants
# were fitted to `tune`'s measurements of every chunk on the seed sweep, manual shapes, t4096,
# the fp16 shape, a PA_NZ and an fp32 case (worst pick 1.13x the best chunk).
_TASK_FIXED_CYCLES = 1_700
_CYCLES_PER_BYTE = 0.05  # per byte of a token row (key + value), in and out
_VECTOR_CORES = 48
_DISPATCH_CYCLES = 170

# The PA_NZ rule's model (cycles), read off the cost model's per-operation trace
# (CostModelSimulationOutput/_simulate.pipe.swim.json, pypto 0.2.0) and checked against the
# end-to-end time of 40 PA_NZ runs (nz-*, 6 x 8192, T=4096, fp16 T=300, decode; within ~5 %
# for one round of tasks):
#   COPY_IN             1,400 + bytes / 96 (+ 5.3 per fractal plane of a 3-D view)
#   TRANSPOSE_MOVEOUT   68 per fractal plane (independent of the rows)
#   COPY_OUT            300 + bytes / 76
# A task moves key then value in (serially on its MTE_IN pipe), then the last move-out; the
# first 48 tasks start 200 cycles apart in 8 lanes; each further round of 48 starts about
# 3,400 cycles after the previous one ends and pays the dispatch again.
_NZ_IN_FIXED = 1_400
_NZ_IN_BYTES_PER_CYCLE = 96
_NZ_IN_PER_PLANE = 5.3
_NZ_TRANSPOSE_PER_PLANE = 68
_NZ_OUT_FIXED = 300
_NZ_OUT_BYTES_PER_CYCLE = 76
_NZ_LANES = 8
_NZ_LANE_CYCLES = 200
_NZ_ROUND_GAP = 3_400


@dataclasses.dataclass(frozen=True)
class KernelShape:
    """What tiles depend on: layout, row widths (elements), itemsizes, block size, sequence lengths."""

    mode: str  # "Norm" or "PA_NZ"
    key_width: int
    value_width: int
    key_itemsize: int
    value_itemsize: int
    block_size: int
    lengths: tuple[int, ...]

    def cache_key(self) -> str:
        # PA_NZ tiles are fractal groups since 2026-12 (before: one view of all fractals); a
        # choice tuned for the old kernel would mean something else, so the key says which.
        mode = "PA_NZ/groups" if self.mode == "PA_NZ" else self.mode
        return (
            f"{mode}:{self.key_width}x{self.key_itemsize}:{self.value_width}x{self.value_itemsize}:"
            f"bs{self.block_size}:lens{','.join(map(str, self.lengths))}"
        )

    def fractals(self) -> tuple[int, int]:
        """(key C, value C): 32-byte fractals per token row (PA_NZ)."""
        return (
            self.key_width * self.key_itemsize // NZ_FRACTAL_BYTES,
            self.value_width * self.value_itemsize // NZ_FRACTAL_BYTES,
        )

    def tasks(self, chunk: int) -> int:
        """Entries of ``chunk`` slots (before fractal groups)."""
        return sum(-(-n // chunk) for n in self.lengths)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """One kernel specialisation.

    ``kind`` "entries": the flat entry kernel, ``chunk`` token slots per task, ``*_tile`` the
    vector tile of each cache ((rows, cols) for Norm, (fractals, rows) for PA_NZ). ``kind``
    "seed": the seed's nested-loop kernel, ``*_tile`` = (rows, cols), chunk 0.
    """

    kind: str
    chunk: int
    key_tile: tuple[int, int]
    value_tile: tuple[int, int]

    def groups(self, shape: KernelShape) -> tuple[int, int, int]:
        """PA_NZ: (key groups, value groups, entries per chunk = the larger of the two)."""
        key_c, value_c = shape.fractals()
        key_groups, value_groups = key_c // self.key_tile[0], value_c // self.value_tile[0]
        return key_groups, value_groups, max(key_groups, value_groups)

    def kernel_tuple(self) -> tuple[int, ...]:
        if self.kind == "seed":
            return (*self.key_tile, *self.value_tile)
        return (self.chunk, *self.key_tile, *self.value_tile)

    def label(self) -> str:
        if self.kind == "seed":
            return f"seed kernel, rows {self.key_tile[0]}/{self.value_tile[0]}"
        return f"chunk {self.chunk}"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Tiles:
        return cls(
            kind=str(data["kind"]),
            chunk=int(data["chunk"]),
            key_tile=tuple(int(v) for v in data["key_tile"]),
            value_tile=tuple(int(v) for v in data["value_tile"]),
        )


def row_width(plan: GatherPlan, which: str) -> int:
    """Elements per output token row of ``which`` ("key" or "value"): H*D."""
    shape = plan.key_token_shape if which == "key" else plan.value_token_shape
    width = 1
    for size in shape:
        width *= int(size)
    return width


def shape_of(plan, key_itemsize: int, value_itemsize: int) -> KernelShape:
    return KernelShape(
        mode=plan.cache_mode.value,
        key_width=row_width(plan, "key"),
        value_width=row_width(plan, "value"),
        key_itemsize=key_itemsize,
        value_itemsize=value_itemsize,
        block_size=plan.block_size,
        lengths=tuple(int(n) for n in plan.seq_lengths.tolist()),
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def norm_tile(chunk: int, width: int, itemsize: int) -> tuple[int, int] | None:
    """(rows, cols) of a Norm tile for ``chunk`` rows of ``width``; ``None`` if no aligned tile fits."""
    if width * itemsize <= VECTOR_BUFFER_BYTES:
        rows = max(d for d in _divisors(chunk) if d * width * itemsize <= VECTOR_BUFFER_BYTES)
        return rows, width
    cols = [c for c in _divisors(width) if (c * itemsize) % ALIGN_BYTES == 0 and c * itemsize <= VECTOR_BUFFER_BYTES]
    return (1, max(cols)) if cols else None


def nz_groups(chunk: int, fractals: int) -> list[int]:
    """Fractals per task that divide ``fractals`` and whose ``[fractals, chunk, E]`` tile fits."""
    return [d for d in _divisors(fractals) if d * chunk * NZ_FRACTAL_BYTES <= VECTOR_BUFFER_BYTES]


def nz_task_cycles(chunk: int, key_fractals: int, value_fractals: int) -> float:
    """The PA_NZ rule's cycles of one task: key and value groups in, then the last move-out."""

    def moves(fractals: int) -> tuple[float, float]:
        size = chunk * fractals * NZ_FRACTAL_BYTES
        if chunk == 1:  # the rows kernel: 2-D copies, no transpose
            return _NZ_IN_FIXED + size / _NZ_IN_BYTES_PER_CYCLE, _NZ_OUT_FIXED + size / _NZ_OUT_BYTES_PER_CYCLE
        copy_in = _NZ_IN_FIXED + size / _NZ_IN_BYTES_PER_CYCLE + _NZ_IN_PER_PLANE * fractals
        return copy_in, _NZ_TRANSPOSE_PER_PLANE * fractals

    key_in, key_out = moves(key_fractals)
    value_in, value_out = moves(value_fractals)
    return key_in + value_in + max(key_out, value_out)


def nz_estimate_cycles(shape: KernelShape, tiles: Tiles) -> float:
    """The PA_NZ rule's end-to-end estimate: rounds of 48 tasks (see the constants above)."""
    tasks = shape.tasks(tiles.chunk) * tiles.groups(shape)[2]
    if tasks == 0:
        return 0.0
    task = nz_task_cycles(tiles.chunk, tiles.key_tile[0], tiles.value_tile[0])
    rounds = -(-tasks // _VECTOR_CORES)
    dispatch = _NZ_LANE_CYCLES * (min(tasks, _NZ_LANES) - 1)
    return (rounds - 1) * (task + _NZ_ROUND_GAP + _NZ_LANE_CYCLES * (_NZ_LANES - 1)) + dispatch + task


def nz_entry_tiles(shape: KernelShape, chunk: int) -> Tiles | None:
    """The PA_NZ tiles at ``chunk`` with the cheapest fractal groups by :func:`nz_estimate_cycles`."""
    key_c, value_c = shape.fractals()
    options = [
        Tiles("entries", chunk, (dk, chunk), (dv, chunk))
        for dk in nz_groups(chunk, key_c)
        for dv in nz_groups(chunk, value_c)
        if (key_c // dk) % (value_c // dv) == 0 or (value_c // dv) % (key_c // dk) == 0
    ]
    if not options:
        return None
    # ties: fewer tasks (bigger groups)
    return min(options, key=lambda t: (nz_estimate_cycles(shape, t), t.groups(shape)[2]))


def candidate_chunks(block_size: int) -> list[int]:
    """Chunks worth trying: power-of-two divisors of ``block_size``, and ``block_size`` itself."""
    powers = [c for c in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if c <= block_size and block_size % c == 0]
    return sorted(set(powers) | {block_size})


def estimate_cycles(shape: KernelShape, tiles: Tiles) -> float:
    """The rule's estimate of the loop (Norm: one task per entry, key and value DMAs, over 48 cores)."""
    if shape.mode != "Norm":
        return nz_estimate_cycles(shape, tiles)
    tasks = shape.tasks(tiles.chunk)
    if tasks == 0:
        return 0.0
    row_bytes = shape.key_width * shape.key_itemsize + shape.value_width * shape.value_itemsize
    task = _TASK_FIXED_CYCLES + tiles.chunk * row_bytes * _CYCLES_PER_BYTE
    return math.ceil(tasks / _VECTOR_CORES) * task + tasks * _DISPATCH_CYCLES


def entry_tiles(shape: KernelShape, chunk: int) -> Tiles | None:
    """The entry kernel with ``chunk`` slots per task (``None`` if a tile cannot fit)."""
    if shape.mode != "Norm":
        return nz_entry_tiles(shape, chunk)
    key_tile = norm_tile(chunk, shape.key_width, shape.key_itemsize)
    value_tile = norm_tile(chunk, shape.value_width, shape.value_itemsize)
    if key_tile is None or value_tile is None:
        return None
    return Tiles("entries", chunk, key_tile, value_tile)


def candidate_tiles(shape: KernelShape) -> list[Tiles]:
    """The entry kernel at every candidate chunk whose tiles fit."""
    return [t for t in (entry_tiles(shape, c) for c in candidate_chunks(shape.block_size)) if t is not None]


def rule_tiles(shape: KernelShape) -> Tiles:
    """The closed-form choice: the candidate chunk with the lowest :func:`estimate_cycles`."""
    options = candidate_tiles(shape)
    if not options:
        raise ValueError(NO_TILE_FITS)
    return min(options, key=lambda t: estimate_cycles(shape, t))


def seed_tiles(shape: KernelShape) -> Tiles | None:
    """The seed's rule on the seed's kernel: [16, 32] rows, [8, 8] when heads*dim >= 4096 (Norm only)."""
    if shape.mode != "Norm":
        return None
    large = max(shape.key_width, shape.value_width) >= SEED_LARGE_TOKEN_ELEMENTS
    rows = SEED_LARGE_TOKEN_ROWS if large else SEED_DEFAULT_ROWS
    return Tiles("seed", 0, (rows[0], shape.key_width), (rows[1], shape.value_width))


def tile_bytes(tiles: Tiles, shape: KernelShape) -> tuple[int, int]:
    """Vector-buffer bytes of the key and value tiles."""
    if shape.mode == "Norm" or tiles.kind == "seed":
        return (
            tiles.key_tile[0] * tiles.key_tile[1] * shape.key_itemsize,
            tiles.value_tile[0] * tiles.value_tile[1] * shape.value_itemsize,
        )
    return (
        tiles.key_tile[0] * tiles.key_tile[1] * NZ_FRACTAL_BYTES,
        tiles.value_tile[0] * tiles.value_tile[1] * NZ_FRACTAL_BYTES,
    )


def fits(tiles: Tiles, shape: KernelShape) -> bool:
    return all(b <= VECTOR_BUFFER_BYTES for b in tile_bytes(tiles, shape))


def valid_for(tiles: Tiles, shape: KernelShape) -> bool:
    """Whether the kernel can run ``tiles`` on ``shape`` (a tuned entry is checked before use)."""
    if tiles.kind == "seed":
        return shape.mode == "Norm"
    if tiles.chunk < 1 or shape.block_size % tiles.chunk or not fits(tiles, shape):
        return False
    if shape.mode == "Norm":
        return True
    key_c, value_c = shape.fractals()
    dk, dv = tiles.key_tile[0], tiles.value_tile[0]
    if tiles.key_tile[1] != tiles.chunk or tiles.value_tile[1] != tiles.chunk or key_c % dk or value_c % dv:
        return False
    key_groups, value_groups, _ = tiles.groups(shape)
    return key_groups % value_groups == 0 or value_groups % key_groups == 0


# --------------------------------------------------------------------------- #
# Tuned choices, cached by `pakv-onnx tune`
# --------------------------------------------------------------------------- #
def _tuned_path() -> Path:
    from pakv_onnx.paths import cache_dir

    return cache_dir("pypto") / "tuned_tiles.json"


def _load() -> dict:
    try:
        return json.loads(_tuned_path().read_text())
    except (OSError, ValueError):
        return {}


def tuned(shape: KernelShape) -> Tiles | None:
    """The tiles ``tune`` measured cheapest for exactly this shape, if any."""
    entry = _load().get(shape.cache_key())
    try:
        tiles = Tiles.from_json(entry) if entry else None
    except (KeyError, TypeError, ValueError):
        return None
    return tiles if tiles is not None and valid_for(tiles, shape) else None


def remember(shape: KernelShape, tiles: Tiles) -> None:
    """Cache ``tiles`` as the choice for ``shape`` (atomic replace of the JSON file)."""
    data = _load()
    data[shape.cache_key()] = tiles.to_json()
    path = _tuned_path()
    scratch = path.with_suffix(".tmp")
    scratch.write_text(json.dumps(data, indent=1, sort_keys=True))
    scratch.replace(path)
