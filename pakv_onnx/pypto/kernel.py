"""The PyPTO GatherPaKvCache kernels. Imports pypto: load only through :mod:`.host`.

The host (:mod:`.host`) turns a validated plan into a flat list of *entries*, one per
(sequence, used block, sub-chunk of ``chunk`` slots): int32 rows ``(block, slot, dst, valid)``
meaning "copy ``valid`` token slots of cache block ``block`` starting at slot ``slot`` to output
rows ``dst ..``". The kernel is one flat ``pypto.loop`` over those entries per cache: the
cost model charges nested sequence/block loops thousands of cycles each, and a flat loop of
equal-sized DMA tasks is what reached the copy floor (FACTS section 8). Key and value have
their own entry lists (their best chunk differs with their row width and dtype).

* Norm: the cache ``[nb, bs, H, D]`` is reshaped in place to rows ``[nb*bs, H*D]``; an entry
  views ``[chunk, H*D]`` at row ``block*bs + slot`` and assembles it at ``[dst, 0]``.
* PA_NZ: the cache ``[nb, C, bs, E]`` (``C = H*D/E``) is reshaped in place to
  ``[nb*C, bs, E]``; an entry views ``[C, chunk, E]`` at ``[block*C, slot, 0]``, transposes it
  to ``[chunk, C, E]`` and assembles it into the output, handed in by the host as a
  ``[T, C, E]`` view of ``[T, H*D]`` (reshaping the output inside the kernel breaks the
  interpreter).
* :func:`copy_kernel` copies ``[T, W]`` rows contiguously with the same loop: the floor.
* :func:`seed_kernel` is the seed's nested sequence/block loop, kept so ``tune`` can price
  the seed's rule with the seed's own kernel.

Static axes (heads, dims, block size, chunk) make one specialisation per shape; token and
entry counts are dynamic. Note: no ``from __future__ import annotations`` here (PyPTO reads
the tensor annotations as objects).
"""

import pypto

DYN = pypto.DYNAMIC
STATIC = pypto.STATIC

ENTRY_FIELDS = 4  # block, slot, dst, valid

_RUNTIME_OPTIONS = {
    "device_sched_mode": 1,
    "stitch_function_max_num": 128,
    "valid_shape_optimize": 1,
}
# Index tensors read on the host (scalars drive the loop and the offsets); every name here
# must be a parameter of the kernel.
_HOST_TENSORS = {
    "norm": ["key_entries", "value_entries"],
    "nz": ["key_entries", "value_entries"],
    "copy": [],
    "seed": ["block_tables", "seq_starts", "table_cols"],
}
_PASS_OPTIONS = {"vec_nbuffer_setting": {-2: 1, -1: 8}}


def _copy_rows(rows, entries, out, chunk: int, tile: tuple, block_size: int):
    """Norm body: one task per entry, ``[chunk, W]`` rows of ``rows`` to ``out``."""
    width = rows.shape[1]
    for e in pypto.loop(entries.shape[0], name="entry_loop", idx_name="e"):
        src = entries[e, 0] * block_size + entries[e, 1]
        pypto.set_vec_tile_shapes(tile[0], tile[1])
        part = pypto.view(rows, [chunk, width], [src, 0], valid_shape=[entries[e, 3], width])
        pypto.assemble(part, [entries[e, 2], 0], out)


def gather_norm_kernel(
    key_cache: pypto.Tensor([DYN, STATIC, STATIC, STATIC]),
    value_cache: pypto.Tensor([DYN, STATIC, STATIC, STATIC]),
    key_entries: pypto.Tensor([DYN, ENTRY_FIELDS], pypto.DT_INT32),
    value_entries: pypto.Tensor([DYN, ENTRY_FIELDS], pypto.DT_INT32),
    key_out: pypto.Tensor([DYN, STATIC]),
    value_out: pypto.Tensor([DYN, STATIC]),
    tiles: tuple,
):
    """Norm gather. ``tiles`` = (key chunk, key tile rows, key tile cols, value chunk, value tile rows, value tile cols)."""
    block_size = key_cache.shape[1]
    key_rows = pypto.reshape(
        key_cache, [key_cache.shape[0] * block_size, key_cache.shape[2] * key_cache.shape[3]], inplace=True
    )
    value_rows = pypto.reshape(
        value_cache, [value_cache.shape[0] * block_size, value_cache.shape[2] * value_cache.shape[3]], inplace=True
    )
    _copy_rows(key_rows, key_entries, key_out, tiles[0], tiles[1:3], block_size)
    _copy_rows(value_rows, value_entries, value_out, tiles[3], tiles[4:6], block_size)


def _copy_nz(cache, entries, out, chunk: int, tile: tuple):
    """PA_NZ body: one task per entry, ``[C, chunk, E]`` fractal rows transposed to ``[chunk, C, E]``."""
    fractals, block_size, e_dim = cache.shape[1], cache.shape[2], cache.shape[3]
    planes = pypto.reshape(cache, [cache.shape[0] * fractals, block_size, e_dim], inplace=True)
    for e in pypto.loop(entries.shape[0], name="entry_loop", idx_name="e"):
        pypto.set_vec_tile_shapes(tile[0], tile[1], e_dim)
        part = pypto.view(
            planes,
            [fractals, chunk, e_dim],
            [entries[e, 0] * fractals, entries[e, 1], 0],
            valid_shape=[fractals, entries[e, 3], e_dim],
        )
        pypto.set_vec_tile_shapes(tile[1], tile[0], e_dim)
        pypto.assemble(pypto.transpose(part, 0, 1), [entries[e, 2], 0, 0], out)


def gather_nz_kernel(
    key_cache: pypto.Tensor([DYN, STATIC, STATIC, STATIC]),
    value_cache: pypto.Tensor([DYN, STATIC, STATIC, STATIC]),
    key_entries: pypto.Tensor([DYN, ENTRY_FIELDS], pypto.DT_INT32),
    value_entries: pypto.Tensor([DYN, ENTRY_FIELDS], pypto.DT_INT32),
    key_out: pypto.Tensor([DYN, STATIC, STATIC]),
    value_out: pypto.Tensor([DYN, STATIC, STATIC]),
    tiles: tuple,
):
    """PA_NZ gather. ``tiles`` = (key chunk, key tile C, key tile rows, value chunk, value tile C, value tile rows)."""
    _copy_nz(key_cache, key_entries, key_out, tiles[0], tiles[1:3])
    _copy_nz(value_cache, value_entries, value_out, tiles[3], tiles[4:6])


def copy_kernel(
    key_src: pypto.Tensor([DYN, STATIC]),
    value_src: pypto.Tensor([DYN, STATIC]),
    key_out: pypto.Tensor([DYN, STATIC]),
    value_out: pypto.Tensor([DYN, STATIC]),
    tiles: tuple,
):
    """The floor: ``[T, W]`` copied contiguously in chunks (no block table). ``tiles`` as Norm."""
    for src, out, chunk, tile in ((key_src, key_out, tiles[0], tiles[1:3]), (value_src, value_out, tiles[3], tiles[4:6])):
        width = src.shape[1]
        total = src.shape[0]
        for c in pypto.loop(pypto.ceildiv(total, chunk), name="chunk_loop", idx_name="c"):
            start = c * chunk
            pypto.set_vec_tile_shapes(tile[0], tile[1])
            part = pypto.view(src, [chunk, width], [start, 0], valid_shape=[(total - start).min(chunk), width])
            pypto.assemble(part, [start, 0], out)


def seed_kernel(
    key_cache: pypto.Tensor([DYN, STATIC, STATIC, STATIC]),
    value_cache: pypto.Tensor([DYN, STATIC, STATIC, STATIC]),
    block_tables: pypto.Tensor([DYN, DYN], pypto.DT_INT32),
    seq_starts: pypto.Tensor([DYN], pypto.DT_INT32),
    table_cols: pypto.Tensor([DYN], pypto.DT_INT32),
    key_out: pypto.Tensor([DYN, STATIC]),
    value_out: pypto.Tensor([DYN, STATIC]),
    tiles: tuple,
):
    """The seed's Norm kernel (nested sequence/block loops). ``tiles`` = (key rows, key cols, value rows, value cols)."""
    num_blocks = key_cache.shape[0]
    block_size = key_cache.shape[1]
    key_width = key_cache.shape[2] * key_cache.shape[3]
    value_width = value_cache.shape[2] * value_cache.shape[3]
    key_rows = pypto.reshape(key_cache, [num_blocks * block_size, key_width], inplace=True)
    value_rows = pypto.reshape(value_cache, [num_blocks * block_size, value_width], inplace=True)
    for seq_base, seq_unroll in pypto.loop_unroll(
        0, block_tables.shape[0], 1, name="seq_loop", idx_name="seq", unroll_list=[2, 1]
    ):
        for seq_step in range(seq_unroll):
            seq = seq_base + seq_step
            first_row = seq_starts[seq]
            length = seq_starts[seq + 1] - first_row
            first_col = table_cols[seq]
            for blk in pypto.loop(
                pypto.ceildiv(length, block_size), name="block_loop", idx_name="blk", unroll_list=[1]
            ):
                src_row = block_tables[seq, first_col + blk] * block_size
                done = blk * block_size
                valid = (length - done).min(block_size)
                dst_row = first_row + done
                pypto.set_vec_tile_shapes(tiles[0], tiles[1])
                key_block = pypto.view(key_rows, [block_size, key_width], [src_row, 0], valid_shape=[valid, key_width])
                pypto.assemble(key_block, [dst_row, 0], key_out)
                pypto.set_vec_tile_shapes(tiles[2], tiles[3])
                value_block = pypto.view(
                    value_rows, [block_size, value_width], [src_row, 0], valid_shape=[valid, value_width]
                )
                pypto.assemble(value_block, [dst_row, 0], value_out)


KERNELS = {"norm": gather_norm_kernel, "nz": gather_nz_kernel, "copy": copy_kernel, "seed": seed_kernel}
_JIT_CACHE: dict = {}


def jit_kernel(kind: str, *, sim: bool, verify: bool = False, kernel_fn=None):
    """Kernel ``kind`` (a key of :data:`KERNELS`) compiled by ``pypto.frontend.jit`` for NPU or SIM.

    ``kernel_fn`` replaces the kernel body (tests inject deliberately wrong kernels);
    ``verify`` turns on PyPTO's pass-verify interpreter (SIM only).
    """
    fn = kernel_fn or KERNELS[kind]
    key = (fn, sim, verify)
    if key not in _JIT_CACHE:
        runtime = dict(_RUNTIME_OPTIONS, run_mode=pypto.RunMode.SIM if sim else pypto.RunMode.NPU)
        if _HOST_TENSORS[kind]:  # an empty list raises std::bad_cast in pypto 0.2.0
            runtime["ready_on_host_tensors"] = list(_HOST_TENSORS[kind])
        _JIT_CACHE[key] = pypto.frontend.jit(
            runtime_options=runtime,
            pass_options=dict(_PASS_OPTIONS),
            verify_options={"enable_pass_verify": True} if verify else None,
        )(fn)
    return _JIT_CACHE[key]
