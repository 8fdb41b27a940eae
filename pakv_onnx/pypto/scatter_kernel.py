"""The PyPTO ScatterPaKvCache kernels (the write side). Imports pypto: load only through :mod:`.scatter_host`.

The host (:mod:`.scatter_host`) turns ``slot_mapping`` into *moves*: a move copies ``valid``
consecutive token rows (``valid`` <= ``chunk``) that land in consecutive rows of one cache block,
and never crosses a ``chunk``-aligned row of the block (so a move's static ``chunk``-row view
never leaves its block). A prefill's run of tokens becomes a few full moves; a decode step's
token per sequence one move each; a padding token (negative slot) none. For PA_NZ a move also
carries the first fractal of a *fractal group* (see :mod:`.tiles`): a token row's ``C``
fractals are split into ``C / group`` moves.

Each cache has its own flat ``pypto.loop`` over int32 entries ``[E, 5 * pieces]``: an entry is
one task of ``pieces`` moves ``(src, dst_a, dst_b, valid, first)`` (a task's last entries are
padded with ``valid = 0`` moves, which write nothing). Two loops rather than one per token
pair: in the cost model a task's copy-ins run one after another, and what bounds a decode
step is DMAs per core, so key and value tasks are balanced separately (a prefill's key and
value moves still share the rounds of 48 cores).

* Norm (``dst_a`` = cache row ``block*bs + row``, ``dst_b``/``first`` unused): the token rows
  come as ``[T, H*D]``, the cache as rows ``[nb*bs, H*D]``; a move views ``[chunk, H*D]`` at
  ``[src, 0]`` and assembles it at ``[dst_a, 0]``.
* PA_NZ, ``chunk > 1`` (``dst_a`` = block, ``dst_b`` = row): the tokens come as ``[T, C, E]``,
  the cache as planes ``[nb*C, bs, E]``; a move views ``[chunk, group, E]`` at ``[src, first, 0]``,
  transposes it to ``[group, chunk, E]`` (one vector tile for both) and assembles it at
  ``[block*C + first, row, 0]``.
* PA_NZ, ``chunk == 1``: the tokens come as ``[T*C, E]``, the cache as fractal rows
  ``[nb*C, bs*E]``; a move views ``group`` rows at ``[src*C + first, 0]`` and assembles them at
  ``[block*C + first, row*E]``: no transpose.

Only the moved rows are written: ``assemble`` writes a view's valid rows, so the rest of the
caches keeps its bytes (the host hands in the caller's caches, updated in place). Static axes
(widths, block size, chunk, group, pieces) make one specialisation per shape; token and entry
counts are dynamic. No ``from __future__ import annotations`` here (PyPTO reads the tensor
annotations as objects).
"""

import functools

import pypto

from pakv_onnx.pypto.kernel import compiled, each_move

DYN = pypto.DYNAMIC
STATIC = pypto.STATIC

MOVE_FIELDS = 5  # src, dst_a, dst_b, valid, first
_NORM_FIELDS = (0, 1, 3)  # src, dst (a cache row), valid
_NZ_FIELDS = (0, 1, 2, 3, 4)  # src, block, row, valid, first


def _norm_move(src_rows, cache_rows, chunk: int, tile, src, dst, valid):
    width = src_rows.shape[1]
    pypto.set_vec_tile_shapes(tile[0], tile[1])
    part = pypto.view(src_rows, [chunk, width], [src, 0], valid_shape=[valid, width])
    pypto.assemble(part, [dst, 0], cache_rows)


def _norm_loop(src_rows, entries, cache_rows, chunk: int, pieces: int, tile, name: str):
    move = functools.partial(_norm_move, src_rows, cache_rows, chunk, tile)
    each_move(entries, name, pieces, MOVE_FIELDS, _NORM_FIELDS, move)


def scatter_norm_kernel(
    key_rows: pypto.Tensor([DYN, STATIC]),
    value_rows: pypto.Tensor([DYN, STATIC]),
    key_entries: pypto.Tensor([DYN, STATIC], pypto.DT_INT32),
    value_entries: pypto.Tensor([DYN, STATIC], pypto.DT_INT32),
    key_cache_rows: pypto.Tensor([DYN, STATIC]),
    value_cache_rows: pypto.Tensor([DYN, STATIC]),
    tiles: tuple,
):
    """Norm scatter. ``tiles`` = (chunk, pieces, key tile rows, key tile cols, value tile rows, value tile cols)."""
    chunk = tiles[0]
    pieces = tiles[1]
    _norm_loop(key_rows, key_entries, key_cache_rows, chunk, pieces, tiles[2:4], "key_loop")
    _norm_loop(value_rows, value_entries, value_cache_rows, chunk, pieces, tiles[4:6], "value_loop")


def _nz_move(src_fractals, planes, fractals: int, group: int, chunk: int, src, block, row, valid, first):
    e_dim = src_fractals.shape[2]
    pypto.set_vec_tile_shapes(chunk, group, e_dim)
    part = pypto.view(src_fractals, [chunk, group, e_dim], [src, first, 0], valid_shape=[valid, group, e_dim])
    flipped = pypto.transpose(part, 0, 1)
    pypto.assemble(flipped, [block * fractals + first, row, 0], planes)


def _nz_loop(src_fractals, entries, planes, fractals: int, group: int, chunk: int, pieces: int, name: str):
    move = functools.partial(_nz_move, src_fractals, planes, fractals, group, chunk)
    each_move(entries, name, pieces, MOVE_FIELDS, _NZ_FIELDS, move)


def scatter_nz_kernel(
    key_fractals: pypto.Tensor([DYN, STATIC, STATIC]),
    value_fractals: pypto.Tensor([DYN, STATIC, STATIC]),
    key_entries: pypto.Tensor([DYN, STATIC], pypto.DT_INT32),
    value_entries: pypto.Tensor([DYN, STATIC], pypto.DT_INT32),
    key_planes: pypto.Tensor([DYN, STATIC, STATIC]),
    value_planes: pypto.Tensor([DYN, STATIC, STATIC]),
    tiles: tuple,
):
    """PA_NZ scatter, ``chunk > 1``. ``tiles`` = (chunk, pieces, key group, chunk, value group, chunk, key C, value C)."""
    chunk = tiles[0]
    pieces = tiles[1]
    _nz_loop(key_fractals, key_entries, key_planes, tiles[6], tiles[2], chunk, pieces, "key_loop")
    _nz_loop(value_fractals, value_entries, value_planes, tiles[7], tiles[4], chunk, pieces, "value_loop")


def _nz_row_move(src_rows, cache_rows, fractals: int, group: int, src, block, row, valid, first):
    e_dim = src_rows.shape[1]
    pypto.set_vec_tile_shapes(group, e_dim)
    part = pypto.view(src_rows, [group, e_dim], [src * fractals + first, 0], valid_shape=[valid * group, e_dim])
    pypto.assemble(part, [block * fractals + first, row * e_dim], cache_rows)


def _nz_rows_loop(src_rows, entries, cache_rows, fractals: int, group: int, pieces: int, name: str):
    move = functools.partial(_nz_row_move, src_rows, cache_rows, fractals, group)
    each_move(entries, name, pieces, MOVE_FIELDS, _NZ_FIELDS, move)


def scatter_nz_rows_kernel(
    key_rows: pypto.Tensor([DYN, STATIC]),
    value_rows: pypto.Tensor([DYN, STATIC]),
    key_entries: pypto.Tensor([DYN, STATIC], pypto.DT_INT32),
    value_entries: pypto.Tensor([DYN, STATIC], pypto.DT_INT32),
    key_cache_rows: pypto.Tensor([DYN, STATIC]),
    value_cache_rows: pypto.Tensor([DYN, STATIC]),
    tiles: tuple,
):
    """PA_NZ scatter, ``chunk == 1`` (no transpose). ``tiles`` as :func:`scatter_nz_kernel`."""
    pieces = tiles[1]
    _nz_rows_loop(key_rows, key_entries, key_cache_rows, tiles[6], tiles[2], pieces, "key_loop")
    _nz_rows_loop(value_rows, value_entries, value_cache_rows, tiles[7], tiles[4], pieces, "value_loop")


KERNELS = {"norm": scatter_norm_kernel, "nz": scatter_nz_kernel, "nz_rows": scatter_nz_rows_kernel}
_HOST_TENSORS = ["key_entries", "value_entries"]
_JIT_CACHE: dict = {}


def jit_kernel(kind: str, *, sim: bool, verify: bool = False, kernel_fn=None):
    """Scatter kernel ``kind`` (a key of :data:`KERNELS`) compiled by ``pypto.frontend.jit`` for NPU or SIM.

    ``kernel_fn`` replaces the kernel body (tests inject deliberately wrong kernels);
    ``verify`` turns on PyPTO's pass-verify interpreter (SIM only).
    """
    return compiled(kernel_fn or KERNELS[kind], _HOST_TENSORS, _JIT_CACHE, sim=sim, verify=verify)
