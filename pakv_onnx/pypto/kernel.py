"""The PyPTO GatherPaKvCache kernels. Imports pypto: load only through :mod:`.host`.

The host (:mod:`.host`) turns a validated plan into a flat list of *entries*, one per
(sequence, used block, sub-chunk of ``chunk`` slots): int32 rows ``(block, slot, dst, valid)``
meaning "copy ``valid`` token slots of cache block ``block`` starting at slot ``slot`` to output
rows ``dst ..``" (for Norm the host folds block and slot into one cache row, ``block*bs + slot``).
The kernel is one flat ``pypto.loop`` over those entries, each moving key and value: the
cost model charges every loop (nested sequence/block loops thousands of cycles each), and
one flat loop of equal-sized DMA tasks is what reached the copy floor (FACTS section 8).

* Norm: the host hands the cache ``[nb, bs, H, D]`` in as rows ``[nb*bs, H*D]`` (a view;
  reshaping inside the kernel costs two extra tasks in the cost model); an entry
  views ``[chunk, H*D]`` at its cache row and assembles it at ``[dst, 0]``.
* PA_NZ: the host hands the cache ``[nb, C, bs, E]`` (``C = H*D/E``) in as a
  ``[nb*C, bs, E]`` view; an entry views ``[C, chunk, E]`` at ``[block*C, slot, 0]``, transposes it
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
    "norm": ["entries"],
    "nz": ["entries"],
    "copy": [],
    "seed": ["block_tables", "seq_starts", "table_cols"],
}
_PASS_OPTIONS = {"vec_nbuffer_setting": {-2: 1, -1: 8}}


def _copy_rows(src, out, rows: int, tile, src_row, dst_row, valid):
    """Copy ``valid`` rows of ``src`` ``[N, W]`` from row ``src_row`` to ``out`` at row ``dst_row``.

    The view is ``rows`` rows long (static, what the cost model charges); ``tile`` = (tile rows,
    tile cols) of the vector tiles that move it.
    """
    width = src.shape[1]
    pypto.set_vec_tile_shapes(tile[0], tile[1])
    part = pypto.view(src, [rows, width], [src_row, 0], valid_shape=[valid, width])
    pypto.assemble(part, [dst_row, 0], out)


def gather_norm_kernel(
    key_rows: pypto.Tensor([DYN, STATIC]),
    value_rows: pypto.Tensor([DYN, STATIC]),
    entries: pypto.Tensor([DYN, ENTRY_FIELDS], pypto.DT_INT32),
    key_out: pypto.Tensor([DYN, STATIC]),
    value_out: pypto.Tensor([DYN, STATIC]),
    tiles: tuple,
):
    """Norm gather; entries ``(src_row, 0, dst, valid)``.

    The caches come as ``[nb*bs, H*D]`` row views. ``tiles`` = (chunk, key tile rows, key tile
    cols, value tile rows, value tile cols).
    """
    chunk = tiles[0]
    for e in pypto.loop(entries.shape[0], name="entry_loop", idx_name="e"):
        src = entries[e, 0]
        dst = entries[e, 2]
        valid = entries[e, 3]
        _copy_rows(key_rows, key_out, chunk, tiles[1:3], src, dst, valid)
        _copy_rows(value_rows, value_out, chunk, tiles[3:5], src, dst, valid)


def _nz_part(planes, fractals: int, e_dim: int, chunk: int, tile: tuple, block, slot, valid):
    """``[C, chunk, E]`` fractal rows of one block, transposed to ``[chunk, C, E]``."""
    pypto.set_vec_tile_shapes(tile[0], tile[1], e_dim)
    part = pypto.view(
        planes, [fractals, chunk, e_dim], [block * fractals, slot, 0], valid_shape=[fractals, valid, e_dim]
    )
    pypto.set_vec_tile_shapes(tile[1], tile[0], e_dim)
    return pypto.transpose(part, 0, 1)


def gather_nz_kernel(
    key_planes: pypto.Tensor([DYN, STATIC, STATIC]),
    value_planes: pypto.Tensor([DYN, STATIC, STATIC]),
    entries: pypto.Tensor([DYN, ENTRY_FIELDS], pypto.DT_INT32),
    key_out: pypto.Tensor([DYN, STATIC, STATIC]),
    value_out: pypto.Tensor([DYN, STATIC, STATIC]),
    tiles: tuple,
):
    """PA_NZ gather; entries ``(block, slot, dst, valid)``.

    The caches come as ``[nb*C, bs, E]`` views. ``tiles`` = (chunk, key tile C, key tile rows,
    value tile C, value tile rows, key C, value C).
    """
    key_e = key_planes.shape[2]
    value_e = value_planes.shape[2]
    key_c = tiles[5]
    value_c = tiles[6]
    chunk = tiles[0]
    for e in pypto.loop(entries.shape[0], name="entry_loop", idx_name="e"):
        block = entries[e, 0]
        slot = entries[e, 1]
        dst = entries[e, 2]
        valid = entries[e, 3]
        key_part = _nz_part(key_planes, key_c, key_e, chunk, tiles[1:3], block, slot, valid)
        pypto.assemble(key_part, [dst, 0, 0], key_out)
        value_part = _nz_part(value_planes, value_c, value_e, chunk, tiles[3:5], block, slot, valid)
        pypto.assemble(value_part, [dst, 0, 0], value_out)


def copy_kernel(
    key_src: pypto.Tensor([DYN, STATIC]),
    value_src: pypto.Tensor([DYN, STATIC]),
    key_out: pypto.Tensor([DYN, STATIC]),
    value_out: pypto.Tensor([DYN, STATIC]),
    tiles: tuple,
):
    """The floor: ``[T, W]`` rows copied contiguously in ``chunk``-row tasks (no block table). ``tiles`` as Norm."""
    total = key_src.shape[0]
    chunk = tiles[0]
    for c in pypto.loop(pypto.ceildiv(total, chunk), name="chunk_loop", idx_name="c"):
        start = c * chunk
        valid = (total - start).min(chunk)
        _copy_rows(key_src, key_out, chunk, tiles[1:3], start, start, valid)
        _copy_rows(value_src, value_out, chunk, tiles[3:5], start, start, valid)


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
                _copy_rows(key_rows, key_out, block_size, tiles[0:2], src_row, dst_row, valid)
                _copy_rows(value_rows, value_out, block_size, tiles[2:4], src_row, dst_row, valid)


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
