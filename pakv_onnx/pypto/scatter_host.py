"""The host side of the PyPTO ScatterPaKvCache kernel: checks, moves, tiles, one run.

Imports neither pypto nor torch_npu at import time. The op's contract (ScatterPaKvCache, the
write side of GatherPaKvCache; FACTS section 10):

* ``key [T, Hk, Dk]``, ``value [T, Hv, Dv]``; ``key_cache``/``value_cache`` in the gather's
  layouts (Norm ``[nb, bs, H, D]``; PA_NZ ``[nb, H*D/E, bs, E]``, ``E = 32 / itemsize`` per cache),
  each of its tokens' dtype; ``slot_mapping [T]`` int32 or int64.
* token ``t`` with slot ``s >= 0`` goes to block ``s // bs``, row ``s % bs`` (PA_NZ: fractal ``f``
  of the token to ``cache[s // bs, f, s % bs, :]``); a negative slot is padding and skipped;
  slots are unique. The caches are updated in place and nothing else in them changes.

The contract's rules are the C validator's (``pakv_onnx.validator.plan_scatter``): a caller
validates first and hands the result here through :func:`from_validated`; :func:`unsupported_reason`
names what the kernel cannot do. :func:`build_moves` / :func:`build_entries` turn ``slot_mapping`` into the kernel's
moves (consecutive tokens landing in consecutive rows of one block become one move of up to
``chunk`` rows); :func:`choose_tiles` picks chunk, pieces per task and PA_NZ fractal groups
(the cost-model-tuned choice cached by ``pakv-onnx tune --op scatter`` when there is one, else
:func:`rule_tiles`); :func:`scatter_in_process` runs it in this process (SIM with the interpreter
in the pypto-cpu worker, or the NPU), :func:`scatter_on_npu` on an Ascend NPU.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from pathlib import Path

import torch

from pakv_onnx.pypto import tiles as tiles_mod
from pakv_onnx.pypto.host import INT32_MAX, _dtype_reason, set_output_env
from pakv_onnx.pypto.tiles import ALIGN_BYTES, VECTOR_BUFFER_BYTES
from pakv_onnx.spec import NZ_FRACTAL_BYTES, CacheMode

MOVE_FIELDS = 5  # src, dst_a, dst_b, valid, first (as scatter_kernel.MOVE_FIELDS)
SLOT_DTYPES = (torch.int32, torch.int64)
PIECES = (1, 2, 3, 4, 6, 8)  # moves per task worth trying


# --------------------------------------------------------------------------- #
# The inputs
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(frozen=True)
class ScatterPlan:
    """What the kernel needs to know about one validated call (from :func:`from_validated`)."""

    mode: CacheMode
    num_tokens: int
    num_blocks: int
    block_size: int
    key_width: int  # elements per token row (H*D)
    value_width: int
    key_dtype: torch.dtype
    value_dtype: torch.dtype
    slots: torch.Tensor  # int64 [T], -1 (any negative) = padding

    @property
    def key_fractals(self) -> int:
        return self.key_width * self.key_dtype.itemsize // NZ_FRACTAL_BYTES

    @property
    def value_fractals(self) -> int:
        return self.value_width * self.value_dtype.itemsize // NZ_FRACTAL_BYTES

    @property
    def written(self) -> int:
        """Tokens written (slot >= 0)."""
        return int((self.slots >= 0).sum())


def from_validated(plan) -> ScatterPlan:
    """This module's plan from the op's validated plan (duck-typed: ``cache_mode``, ``num_tokens``,
    ``num_blocks``, ``block_size``, ``key_token_shape``, ``value_token_shape``, ``key_dtype``,
    ``value_dtype``, ``slots``), for a backend that has the op's own validation in front of it."""

    def width(shape) -> int:
        total = 1
        for size in shape:
            total *= int(size)
        return total

    return ScatterPlan(
        mode=CacheMode(plan.cache_mode),
        num_tokens=int(plan.num_tokens),
        num_blocks=int(plan.num_blocks),
        block_size=int(plan.block_size),
        key_width=width(plan.key_token_shape),
        value_width=width(plan.value_token_shape),
        key_dtype=plan.key_dtype,
        value_dtype=plan.value_dtype,
        slots=plan.slots.to(torch.int64).cpu(),
    )


def unsupported_reason(plan: ScatterPlan, tensors=()) -> str | None:
    """``None`` when the kernel handles ``plan``; otherwise the one thing it cannot do.

    ``tensors``: the call's tensors, checked for contiguity (the kernel hands each in as a view).
    """
    for name, dtype in (("key", plan.key_dtype), ("value", plan.value_dtype)):
        reason = _dtype_reason(name, dtype)
        if reason:
            return reason
    for index, tensor in enumerate(tensors):
        if tensor is not None and not tensor.is_contiguous():
            names = ("key", "value", "key_cache", "value_cache")
            name = names[index] if index < len(names) else f"tensor {index}"
            return (
                f"{name} is strided (the PyPTO kernel hands each tensor in as a reshaped view and needs it contiguous)"
            )
    if plan.mode is CacheMode.NORM:
        for which, width, dtype in (
            ("key", plan.key_width, plan.key_dtype),
            ("value", plan.value_width, plan.value_dtype),
        ):
            if (width * dtype.itemsize) % ALIGN_BYTES:
                return (
                    f"{which} token row of {width} x {dtype.itemsize} bytes = {width * dtype.itemsize} bytes "
                    f"(PyPTO vector tiles need rows that are a multiple of {ALIGN_BYTES} bytes)"
                )
    rows = plan.num_blocks * plan.block_size
    if plan.mode is CacheMode.PA_NZ:
        fractals = max(plan.key_fractals, plan.value_fractals)
        rows = max(plan.num_blocks, plan.num_tokens) * fractals
    if rows > INT32_MAX or plan.num_tokens > INT32_MAX:
        return "more than 2**31 - 1 cache rows or tokens (the kernel indexes with int32)"
    if not candidate_tiles(shape_of(plan)):
        return tiles_mod.NO_TILE_FITS
    return None


# --------------------------------------------------------------------------- #
# Runs and moves
# --------------------------------------------------------------------------- #
def runs_of(plan: ScatterPlan) -> torch.Tensor:
    """``[R, 3]`` int64 rows ``(first token, first slot, length)``: maximal runs of written tokens
    ``t, t+1, ..`` landing in slots ``s, s+1, ..`` of one block."""
    slots = plan.slots
    tokens = torch.nonzero(slots >= 0).flatten()
    if tokens.numel() == 0:
        return torch.zeros((0, 3), dtype=torch.int64)
    written = slots[tokens]
    bs = plan.block_size
    starts = torch.ones_like(tokens, dtype=torch.bool)
    starts[1:] = (tokens[1:] != tokens[:-1] + 1) | (written[1:] != written[:-1] + 1) | (written[1:] % bs == 0)
    first = torch.nonzero(starts).flatten()
    lengths = torch.diff(torch.cat((first, torch.tensor([tokens.numel()]))))
    return torch.stack((tokens[first], written[first], lengths), dim=1)


def build_moves(plan: ScatterPlan, chunk: int) -> torch.Tensor:
    """``[M, 4]`` int64 rows ``(src token, block, row, valid)``: each run split at ``chunk``-aligned rows.

    ``chunk`` divides ``block_size``, so no move crosses a block and its ``chunk``-row window
    (``row // chunk * chunk ..``) stays inside the block.
    """
    bs = plan.block_size
    if chunk < 1 or bs % chunk:
        raise ValueError(f"chunk {chunk} must divide block_size {bs}")
    runs = runs_of(plan)
    if runs.shape[0] == 0:
        return torch.zeros((0, 4), dtype=torch.int64)
    token, slot, length = runs.unbind(1)
    row = slot % bs
    windows = (row + length - 1) // chunk - row // chunk + 1  # chunk-aligned windows each run touches
    run = torch.repeat_interleave(torch.arange(runs.shape[0]), windows)
    index = torch.arange(run.numel()) - (torch.cumsum(windows, 0) - windows)[run]
    window_start = (row[run] // chunk + index) * chunk
    start = torch.maximum(window_start, row[run])
    end = torch.minimum(window_start + chunk, row[run] + length[run])
    src = token[run] + (start - row[run])
    return torch.stack((src, slot[run] // bs, start, end - start), dim=1)


def build_entries(plan: ScatterPlan, tiles: ScatterTiles, which: str) -> torch.Tensor:
    """Int32 ``[E, 5 * pieces]`` entries of cache ``which`` ("key"/"value"): the moves, each repeated
    per fractal group (PA_NZ), ``pieces`` per task, the last task padded with ``valid = 0`` moves."""
    moves = build_moves(plan, tiles.chunk)
    src, block, row, valid = moves.unbind(1)
    if plan.mode is CacheMode.NORM:
        fields = torch.stack(
            (src, block * plan.block_size + row, torch.zeros_like(row), valid, torch.zeros_like(row)), 1
        )
    else:
        fractals = plan.key_fractals if which == "key" else plan.value_fractals
        group = (tiles.key_tile if which == "key" else tiles.value_tile)[0]
        if fractals % group:
            raise ValueError(f"fractal group {group} must divide the {which}'s {fractals} fractals")
        groups = fractals // group
        first = (torch.arange(groups) * group).repeat(moves.shape[0])
        fields = torch.cat((moves.repeat_interleave(groups, dim=0), first[:, None]), dim=1)
    pad = -fields.shape[0] % tiles.pieces
    fields = torch.cat((fields, torch.zeros((pad, MOVE_FIELDS), dtype=torch.int64)))
    entries = fields.reshape(-1, MOVE_FIELDS * tiles.pieces)
    if entries.numel() and int(entries.max()) > INT32_MAX:
        raise ValueError("an entry exceeds int32 (the kernel reads int32 entries)")
    return entries.to(torch.int32).contiguous()


# --------------------------------------------------------------------------- #
# Tiles
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(frozen=True)
class ScatterShape:
    """What tiles depend on: layout, row widths (elements), itemsizes, block size, the runs' rows and lengths."""

    mode: str
    key_width: int
    value_width: int
    key_itemsize: int
    value_itemsize: int
    block_size: int
    runs: tuple[tuple[int, int], ...]  # (first row in its block, length)

    def cache_key(self) -> str:
        digest = hashlib.sha1(json.dumps(self.runs).encode()).hexdigest()[:16]
        return (
            f"scatter:{self.mode}:{self.key_width}x{self.key_itemsize}:{self.value_width}x{self.value_itemsize}:"
            f"bs{self.block_size}:runs{len(self.runs)}:{digest}"
        )

    def fractals(self) -> tuple[int, int]:
        return (
            self.key_width * self.key_itemsize // NZ_FRACTAL_BYTES,
            self.value_width * self.value_itemsize // NZ_FRACTAL_BYTES,
        )

    @functools.cached_property
    def _moves_at(self) -> dict[int, int]:
        return {}  # chunk -> moves (the rule asks for each chunk many times)

    def moves(self, chunk: int) -> int:
        """Moves at ``chunk`` (before fractal groups): the chunk-aligned windows the runs touch."""
        if chunk not in self._moves_at:
            self._moves_at[chunk] = sum((row + n - 1) // chunk - row // chunk + 1 for row, n in self.runs)
        return self._moves_at[chunk]

    def norm_view(self) -> tiles_mod.KernelShape:
        """The gather's Norm shape of the same widths (for the floor's tiles)."""
        return tiles_mod.KernelShape(
            "Norm", self.key_width, self.value_width, self.key_itemsize, self.value_itemsize, self.block_size, ()
        )


def shape_of(plan: ScatterPlan) -> ScatterShape:
    runs = runs_of(plan)
    rows = (runs[:, 1] % plan.block_size).tolist()
    return ScatterShape(
        mode=plan.mode.value,
        key_width=plan.key_width,
        value_width=plan.value_width,
        key_itemsize=plan.key_dtype.itemsize,
        value_itemsize=plan.value_dtype.itemsize,
        block_size=plan.block_size,
        runs=tuple(zip(rows, runs[:, 2].tolist())),
    )


@dataclasses.dataclass(frozen=True)
class ScatterTiles:
    """One scatter specialisation: ``chunk`` rows per move, ``pieces`` moves per task, each cache's
    vector tile ((rows, cols) for Norm, (fractal group, chunk) for PA_NZ)."""

    chunk: int
    pieces: int
    key_tile: tuple[int, int]
    value_tile: tuple[int, int]
    kind: str = "scatter"

    def kernel_tuple(self) -> tuple[int, ...]:
        return (self.chunk, self.pieces, *self.key_tile, *self.value_tile)

    def label(self) -> str:
        return f"chunk {self.chunk}, {self.pieces} per task"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> ScatterTiles:
        return cls(
            chunk=int(data["chunk"]),
            pieces=int(data["pieces"]),
            key_tile=tuple(int(v) for v in data["key_tile"]),
            value_tile=tuple(int(v) for v in data["value_tile"]),
        )


# The rule's model of the cost model (cycles), read off its per-operation trace as for the
# gather (tiles.py): per move one COPY_IN (fixed + bytes) and one move-out; a task's copy-ins
# run one after another, its last move-out after them; key and value tasks share rounds of 48
# cores; each further round pays about 4,800 cycles more. PA_NZ's transposing move-out costs
# 68 cycles per row of the tile's first axis: for the gather that is the fractal group, for the
# scatter ([chunk, group, E] in, [group, chunk, E] out) it is the chunk, so the scatter wants
# short chunks of wide groups.
_IN_FIXED = 1_400
_IN_BYTES_PER_CYCLE = 96
_NZ_IN_PER_ROW = 5.3  # a PA_NZ [chunk, group, E] source view: one burst per token row
_OUT_FIXED = 300
_OUT_BYTES_PER_CYCLE = 76
_NZ_TRANSPOSE_PER_ROW = 68  # per row of the UB tile's first axis (the scatter's chunk)
_NZ_ROWS_OUT_PER_ROW = 5.0  # chunk 1: group rows of 32 bytes, strided in the cache
_LANES = 8
_LANE_CYCLES = 200
_ROUND_GAP = 3_400


def _move_cycles(
    shape: ScatterShape, chunk: int, tile: tuple[int, int], width: int, itemsize: int
) -> tuple[float, float]:
    if shape.mode == "Norm":
        size = chunk * width * itemsize
        return _IN_FIXED + size / _IN_BYTES_PER_CYCLE, _OUT_FIXED + size / _OUT_BYTES_PER_CYCLE
    group = tile[0]
    size = chunk * group * NZ_FRACTAL_BYTES
    if chunk == 1:
        return (
            _IN_FIXED + size / _IN_BYTES_PER_CYCLE,
            _OUT_FIXED + size / _OUT_BYTES_PER_CYCLE + _NZ_ROWS_OUT_PER_ROW * group,
        )
    return _IN_FIXED + size / _IN_BYTES_PER_CYCLE + _NZ_IN_PER_ROW * chunk, _NZ_TRANSPOSE_PER_ROW * chunk


def groups_of(shape: ScatterShape, tiles: ScatterTiles) -> tuple[int, int]:
    if shape.mode == "Norm":
        return 1, 1
    key_c, value_c = shape.fractals()
    return key_c // tiles.key_tile[0], value_c // tiles.value_tile[0]


def estimate_cycles(shape: ScatterShape, tiles: ScatterTiles) -> float:
    """The rule's end-to-end estimate of both loops."""
    moves = shape.moves(tiles.chunk)
    if moves == 0:
        return 0.0
    key_groups, value_groups = groups_of(shape, tiles)
    tasks = -(-moves * key_groups // tiles.pieces) + -(-moves * value_groups // tiles.pieces)
    task = 0.0
    for tile, width, itemsize in (
        (tiles.key_tile, shape.key_width, shape.key_itemsize),
        (tiles.value_tile, shape.value_width, shape.value_itemsize),
    ):
        move_in, move_out = _move_cycles(shape, tiles.chunk, tile, width, itemsize)
        task = max(task, tiles.pieces * move_in + move_out)
    rounds = -(-tasks // tiles_mod._VECTOR_CORES)
    dispatch = _LANE_CYCLES * (min(tasks, _LANES) - 1)
    return (rounds - 1) * (task + _ROUND_GAP + _LANE_CYCLES * (_LANES - 1)) + dispatch + task


def _tiles_at(shape: ScatterShape, chunk: int, pieces: int) -> list[ScatterTiles]:
    if shape.mode == "Norm":
        key_tile = tiles_mod.norm_tile(chunk, shape.key_width, shape.key_itemsize)
        value_tile = tiles_mod.norm_tile(chunk, shape.value_width, shape.value_itemsize)
        if key_tile is None or value_tile is None:
            return []
        return [ScatterTiles(chunk, pieces, key_tile, value_tile)]
    key_c, value_c = shape.fractals()
    return [
        ScatterTiles(chunk, pieces, (dk, chunk), (dv, chunk))
        for dk in tiles_mod.nz_groups(chunk, key_c)
        for dv in tiles_mod.nz_groups(chunk, value_c)
    ]


def chunk_tiles(shape: ScatterShape, chunk: int) -> ScatterTiles | None:
    """The cheapest tiles at ``chunk`` by :func:`estimate_cycles` (pieces and groups), ``None`` if none fits."""
    options = [t for pieces in PIECES for t in _tiles_at(shape, chunk, pieces)]
    if not options:
        return None
    return min(options, key=lambda t: (estimate_cycles(shape, t), t.pieces, -t.key_tile[0]))


def candidate_tiles(shape: ScatterShape) -> list[ScatterTiles]:
    """One candidate per chunk (the estimate's best pieces and groups there)."""
    return [t for t in (chunk_tiles(shape, c) for c in tiles_mod.candidate_chunks(shape.block_size)) if t is not None]


def rule_tiles(shape: ScatterShape) -> ScatterTiles:
    options = candidate_tiles(shape)
    if not options:
        raise ValueError(tiles_mod.NO_TILE_FITS)
    return min(options, key=lambda t: estimate_cycles(shape, t))


def tile_bytes(tiles: ScatterTiles, shape: ScatterShape) -> tuple[int, int]:
    if shape.mode == "Norm":
        return (
            tiles.key_tile[0] * tiles.key_tile[1] * shape.key_itemsize,
            tiles.value_tile[0] * tiles.value_tile[1] * shape.value_itemsize,
        )
    return (tiles.key_tile[0] * tiles.chunk * NZ_FRACTAL_BYTES, tiles.value_tile[0] * tiles.chunk * NZ_FRACTAL_BYTES)


def valid_for(tiles: ScatterTiles, shape: ScatterShape) -> bool:
    """Whether the kernel can run ``tiles`` on ``shape`` (a tuned entry is checked before use)."""
    if tiles.chunk < 1 or shape.block_size % tiles.chunk or tiles.pieces < 1:
        return False
    if any(b > VECTOR_BUFFER_BYTES for b in tile_bytes(tiles, shape)):
        return False
    if shape.mode == "Norm":
        return True
    key_c, value_c = shape.fractals()
    return key_c % tiles.key_tile[0] == 0 and value_c % tiles.value_tile[0] == 0


def _tuned_path() -> Path:
    return tiles_mod._tuned_path()


def tuned(shape: ScatterShape) -> ScatterTiles | None:
    """The tiles ``tune --op scatter`` measured cheapest for exactly this shape, if any."""
    entry = tiles_mod._load().get(shape.cache_key())
    try:
        tiles = ScatterTiles.from_json(entry) if entry else None
    except (KeyError, TypeError, ValueError):
        return None
    return tiles if tiles is not None and valid_for(tiles, shape) else None


def remember(shape: ScatterShape, tiles: ScatterTiles) -> None:
    tiles_mod.remember(shape, tiles)  # same file, same atomic replace; keys start with "scatter:"


def choose_tiles(plan: ScatterPlan) -> ScatterTiles:
    shape = shape_of(plan)
    return tuned(shape) or rule_tiles(shape)


# --------------------------------------------------------------------------- #
# One run
# --------------------------------------------------------------------------- #
def kernel_kind(plan: ScatterPlan, tiles: ScatterTiles) -> str:
    if plan.mode is CacheMode.NORM:
        return "norm"
    return "nz_rows" if tiles.chunk == 1 else "nz"


def kernel_inputs(plan: ScatterPlan, key, value, key_cache, value_cache, tiles: ScatterTiles) -> tuple:
    """The scatter kernel's tensor arguments on the caches' device (views of the caller's tensors, no copy)."""
    device = key_cache.device
    key_entries = build_entries(plan, tiles, "key").to(device)
    value_entries = build_entries(plan, tiles, "value").to(device)
    kind = kernel_kind(plan, tiles)
    if kind == "norm":
        return (
            key.view(plan.num_tokens, plan.key_width),
            value.view(plan.num_tokens, plan.value_width),
            key_entries,
            value_entries,
            key_cache.view(-1, plan.key_width),
            value_cache.view(-1, plan.value_width),
        )
    key_e, value_e = key_cache.shape[3], value_cache.shape[3]
    if kind == "nz_rows":
        return (
            key.view(-1, key_e),
            value.view(-1, value_e),
            key_entries,
            value_entries,
            key_cache.view(-1, key_cache.shape[2] * key_e),
            value_cache.view(-1, value_cache.shape[2] * value_e),
        )
    return (
        key.view(plan.num_tokens, -1, key_e),
        value.view(plan.num_tokens, -1, value_e),
        key_entries,
        value_entries,
        key_cache.view(-1, key_cache.shape[2], key_e),
        value_cache.view(-1, value_cache.shape[2], value_e),
    )


def kernel_scalars(plan: ScatterPlan, tiles: ScatterTiles) -> tuple:
    if plan.mode is CacheMode.NORM:
        return tiles.kernel_tuple()
    return (*tiles.kernel_tuple(), plan.key_fractals, plan.value_fractals)


def scatter_in_process(
    plan: ScatterPlan,
    key,
    value,
    key_cache,
    value_cache,
    *,
    sim: bool,
    verify: bool = False,
    tiles: ScatterTiles | None = None,
    kernel_fn=None,
) -> ScatterTiles:
    """Run the scatter kernel in this process (NPU, or SIM with the interpreter); returns the tiles used.

    ``plan``: the validated call (:func:`from_validated` of ``pakv_onnx.validator.plan_scatter``).
    With ``sim=True, verify=True`` the caller must have installed :mod:`.adapter` (the
    interpreter then reads the real tensors and writes into ``key_cache``/``value_cache``).
    """
    reason = unsupported_reason(plan, (key, value, key_cache, value_cache))
    if reason is not None:
        raise ValueError(f"the PyPTO scatter kernel cannot run this call: {reason}")
    tiles = tiles or choose_tiles(plan)
    if not valid_for(tiles, shape_of(plan)):
        raise ValueError(f"tiles {tiles} do not fit this scatter")
    if plan.written == 0:
        return tiles
    set_output_env()
    from pakv_onnx.pypto import scatter_kernel

    args = kernel_inputs(plan, key, value, key_cache, value_cache, tiles)
    fn = scatter_kernel.jit_kernel(kernel_kind(plan, tiles), sim=sim, verify=verify, kernel_fn=kernel_fn)
    fn(*args, kernel_scalars(plan, tiles))
    return tiles


def scatter_on_npu(plan: ScatterPlan, key, value, key_cache, value_cache) -> ScatterTiles:
    """The kernel on an Ascend NPU, caches updated in place (moved there and back when on the CPU)."""
    if key_cache.device.type == "npu":
        return scatter_in_process(plan, key, value, key_cache, value_cache, sim=False)
    npu = torch.device("npu", torch.npu.current_device())
    moved = [t.to(npu) for t in (key, value, key_cache, value_cache)]
    tiles = scatter_in_process(plan, *moved, sim=False)
    key_cache.copy_(moved[2].cpu())
    value_cache.copy_(moved[3].cpu())
    return tiles


def input_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def floor_tiles(shape: ScatterShape, chunk: int):
    """The copy floor's tiles at ``chunk``: Norm row tiles of the same widths and dtypes (gather's copy kernel)."""
    return tiles_mod.entry_tiles(shape.norm_view(), chunk)
