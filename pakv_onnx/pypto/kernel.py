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
* PA_NZ (``C = H*D/E`` fractals per token row): each chunk's entry is repeated once per
  *fractal group* and carries the group's first key and value fractal (``[E, 6]`` rows
  ``(block, slot, dst, valid, key_first, value_first)``), so one task moves ``group`` fractals
  of each cache (see :mod:`.tiles` for why: the cost model charges a transposing move-out per
  fractal plane, so a wide row's chunk is spread over cores).
  - ``chunk > 1`` (:func:`gather_nz_kernel`): the cache ``[nb, C, bs, E]`` comes as a
    ``[nb*C, bs, E]`` view; an entry views ``[group, chunk, E]`` at ``[block*C + first, slot, 0]``,
    transposes it to ``[chunk, group, E]`` (one vector tile for both: a different transpose tile
    splits the copy-in in two) and assembles it at ``[dst, first, 0]`` of the output, handed in
    as a ``[T, C, E]`` view of ``[T, H*D]`` (reshaping the output inside the kernel breaks the
    interpreter).
  - ``chunk == 1`` (:func:`gather_nz_rows_kernel`): one slot's fractals are ``group`` rows of
    ``E`` in the cache seen as ``[nb*C, bs*E]`` and consecutive rows of the output seen as
    ``[T*C, E]``: a 2-D view assembled as it is, no transpose (3-D ``[group, 1, E]`` copies
    cost twice as much in the cost model, a reshape of the tile does not compile).
* :func:`copy_kernel` copies ``[T, W]`` rows contiguously with the same loop: the floor.
* :func:`seed_kernel` is the seed's nested sequence/block loop, kept so ``tune`` can price
  the seed's rule with the seed's own kernel.

Static axes (heads, dims, block size, chunk) make one specialisation per shape; token and
entry counts are dynamic. Note: no ``from __future__ import annotations`` here (PyPTO reads
the tensor annotations as objects).
"""

import functools

import pypto

DYN = pypto.DYNAMIC
STATIC = pypto.STATIC

ENTRY_FIELDS = 4  # block, slot, dst, valid
NZ_ENTRY_FIELDS = 6  # block, slot, dst, valid, key_first, value_first (first fractal of the group)

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
    "nz_rows": ["entries"],
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


def each_move(entries, name: str, pieces: int, stride: int, fields: tuple, move) -> None:
    """One flat ``pypto.loop`` named ``name`` over the int32 rows of ``entries`` ``[E, pieces * stride]``.

    A row holds ``pieces`` moves of ``stride`` fields each; ``move`` is called once per move with
    that move's fields ``fields`` (indices into its ``stride``), in that order, as PyPTO scalars:
    only the named fields are read. Called from the kernels' bodies, this runs as plain Python
    while PyPTO traces (not inlined by its parser), so the loop is the kernel's own.
    """
    for e in pypto.loop(entries.shape[0], name=name, idx_name="e"):
        for i in range(pieces):
            move(*[entries[e, stride * i + f] for f in fields])


def _nz_group(planes, out, fractals: int, group: int, chunk: int, block, slot, dst, valid, first):
    """Fractals ``first .. first+group`` of ``chunk`` slots of one block, ``[group, chunk, E]`` -> ``[chunk, group, E]``,
    assembled at ``[dst, first, 0]`` of ``out`` ``[T, C, E]``.

    One vector tile for the view and the transpose: the transpose's tile also tiles the
    copy-in, and any other shape splits it into two DMAs.
    """
    e_dim = planes.shape[2]
    pypto.set_vec_tile_shapes(group, chunk, e_dim)
    part = pypto.view(
        planes, [group, chunk, e_dim], [block * fractals + first, slot, 0], valid_shape=[group, valid, e_dim]
    )
    pypto.assemble(pypto.transpose(part, 0, 1), [dst, first, 0], out)


def _nz_entry(
    key_planes, value_planes, key_out, value_out, tiles: tuple, block, slot, dst, valid, key_first, value_first
):
    """One entry of :func:`gather_nz_kernel`: its key fractal group, then its value fractal group."""
    chunk = tiles[0]
    _nz_group(key_planes, key_out, tiles[5], tiles[1], chunk, block, slot, dst, valid, key_first)
    _nz_group(value_planes, value_out, tiles[6], tiles[3], chunk, block, slot, dst, valid, value_first)


# the fields of an NZ entry each kernel reads: (block, slot, dst, valid, key_first, value_first) and,
# for chunk == 1, the same less ``valid`` (always 1)
_NZ_FIELDS = (0, 1, 2, 3, 4, 5)
_NZ_ROWS_FIELDS = (0, 1, 2, 4, 5)


def gather_nz_kernel(
    key_planes: pypto.Tensor([DYN, STATIC, STATIC]),
    value_planes: pypto.Tensor([DYN, STATIC, STATIC]),
    entries: pypto.Tensor([DYN, NZ_ENTRY_FIELDS], pypto.DT_INT32),
    key_out: pypto.Tensor([DYN, STATIC, STATIC]),
    value_out: pypto.Tensor([DYN, STATIC, STATIC]),
    tiles: tuple,
):
    """PA_NZ gather, ``chunk > 1``; entries ``(block, slot, dst, valid, key_first, value_first)``.

    The caches come as ``[nb*C, bs, E]`` views, the outputs as ``[T, C, E]``. ``tiles`` = (chunk,
    key group, chunk, value group, chunk, key C, value C).
    """
    entry = functools.partial(_nz_entry, key_planes, value_planes, key_out, value_out, tiles)
    each_move(entries, "entry_loop", 1, NZ_ENTRY_FIELDS, _NZ_FIELDS, entry)


def _nz_row_group(rows, out, fractals: int, group: int, block, slot, dst, first):
    """One slot's fractals ``first .. first+group``: ``[group, E]`` rows of ``[nb*C, bs*E]`` to ``[T*C, E]``."""
    e_dim = out.shape[1]
    pypto.set_vec_tile_shapes(group, e_dim)
    part = pypto.view(rows, [group, e_dim], [block * fractals + first, slot * e_dim])
    pypto.assemble(part, [dst * fractals + first, 0], out)


def _nz_rows_entry(key_rows, value_rows, key_out, value_out, tiles: tuple, block, slot, dst, key_first, value_first):
    """One entry of :func:`gather_nz_rows_kernel`: its key fractal rows, then its value fractal rows."""
    _nz_row_group(key_rows, key_out, tiles[5], tiles[1], block, slot, dst, key_first)
    _nz_row_group(value_rows, value_out, tiles[6], tiles[3], block, slot, dst, value_first)


def gather_nz_rows_kernel(
    key_rows: pypto.Tensor([DYN, STATIC]),
    value_rows: pypto.Tensor([DYN, STATIC]),
    entries: pypto.Tensor([DYN, NZ_ENTRY_FIELDS], pypto.DT_INT32),
    key_out: pypto.Tensor([DYN, STATIC]),
    value_out: pypto.Tensor([DYN, STATIC]),
    tiles: tuple,
):
    """PA_NZ gather, ``chunk == 1`` (entries as :func:`gather_nz_kernel`, ``valid`` always 1).

    The caches come as ``[nb*C, bs*E]`` fractal rows, the outputs as ``[T*C, E]``. ``tiles`` as
    :func:`gather_nz_kernel`.
    """
    entry = functools.partial(_nz_rows_entry, key_rows, value_rows, key_out, value_out, tiles)
    each_move(entries, "entry_loop", 1, NZ_ENTRY_FIELDS, _NZ_ROWS_FIELDS, entry)


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


KERNELS = {
    "norm": gather_norm_kernel,
    "nz": gather_nz_kernel,
    "nz_rows": gather_nz_rows_kernel,
    "copy": copy_kernel,
    "seed": seed_kernel,
}
_JIT_CACHE: dict = {}


def compiled(fn, host_tensors: list, cache: dict, *, sim: bool, verify: bool):
    """Kernel function ``fn`` compiled by ``pypto.frontend.jit`` for NPU or SIM, once per (fn, sim, verify) in ``cache``.

    ``host_tensors``: the names of ``fn``'s index tensors read on the host; ``verify`` turns on
    PyPTO's pass-verify interpreter (SIM only).
    """
    key = (fn, sim, verify)
    if key not in cache:
        runtime = dict(_RUNTIME_OPTIONS, run_mode=pypto.RunMode.SIM if sim else pypto.RunMode.NPU)
        if host_tensors:  # an empty list raises std::bad_cast in pypto 0.2.0
            runtime["ready_on_host_tensors"] = list(host_tensors)
        cache[key] = pypto.frontend.jit(
            runtime_options=runtime,
            pass_options=dict(_PASS_OPTIONS),
            verify_options={"enable_pass_verify": True} if verify else None,
        )(fn)
    return cache[key]


def jit_kernel(kind: str, *, sim: bool, verify: bool = False, kernel_fn=None):
    """Kernel ``kind`` (a key of :data:`KERNELS`) compiled by ``pypto.frontend.jit`` for NPU or SIM.

    ``kernel_fn`` replaces the kernel body (tests inject deliberately wrong kernels);
    ``verify`` turns on PyPTO's pass-verify interpreter (SIM only).
    """
    return compiled(kernel_fn or KERNELS[kind], _HOST_TENSORS[kind], _JIT_CACHE, sim=sim, verify=verify)
