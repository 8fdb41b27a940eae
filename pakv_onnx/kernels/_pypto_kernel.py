"""The PyPTO GatherPaKvCache kernel (Norm/ND). Imports pypto: load only through :mod:`.pypto_nd`.

The kernel sees every token as one row of ``heads * head_dim`` elements: the caches are
``[num_blocks, block_size, H, D]`` reshaped in place to ``[num_blocks * block_size, H*D]``,
the outputs are handed in as ``[T, H*D]`` views. Head and dim axes are static (one
specialisation per shape), token axes are dynamic. The host hands in three int32 index
tensors read on the host by the runtime:

* ``block_tables [Q, cols]``: physical block ids;
* ``seq_starts [Q+1]``: cumulative token counts (lengths-mode ``seq_lens`` is converted on
  the host), so sequence q owns output rows ``seq_starts[q] .. seq_starts[q+1]``;
* ``table_cols [Q]``: first block-table column of each sequence (``seq_offset // block_size``).

For every (sequence, used block) the kernel views one block of the cache, marks only its
valid rows (the tail block of a sequence is partial) and assembles it into the outputs.

Note: this module must not use ``from __future__ import annotations``; PyPTO reads the
tensor annotations as objects.
"""

import pypto

DYN = pypto.DYNAMIC
STATIC = pypto.STATIC

# Runtime options shared by NPU and SIM runs (SIM then models what NPU runs).
RUNTIME_OPTIONS = {
    "device_sched_mode": 1,
    "stitch_function_max_num": 128,
    # Index tensors are read on the host (scalars drive the loops and offsets).
    "ready_on_host_tensors": ["block_tables", "seq_starts", "table_cols"],
    "valid_shape_optimize": 1,
}
# Buffer counts per vector stage, as in the seed kernel.
PASS_OPTIONS = {"vec_nbuffer_setting": {-2: 1, -1: 8}}


def gather_nd_kernel(
    key_cache: pypto.Tensor([DYN, STATIC, STATIC, STATIC]),
    value_cache: pypto.Tensor([DYN, STATIC, STATIC, STATIC]),
    block_tables: pypto.Tensor([DYN, DYN], pypto.DT_INT32),
    seq_starts: pypto.Tensor([DYN], pypto.DT_INT32),
    table_cols: pypto.Tensor([DYN], pypto.DT_INT32),
    key_out: pypto.Tensor([DYN, STATIC]),
    value_out: pypto.Tensor([DYN, STATIC]),
    tiles: tuple,
):
    """Gather: ``tiles`` = (key rows, key cols, value rows, value cols) of the vector tiles."""
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


_JIT_CACHE: dict = {}


def jit_kernel(kernel_fn=gather_nd_kernel, *, sim: bool, verify: bool = False):
    """``kernel_fn`` compiled by ``pypto.frontend.jit`` for NPU (``sim=False``) or SIM mode.

    ``verify`` turns on PyPTO's pass-verify interpreter (SIM only; see
    :mod:`._pypto_verify_adapter` for how it gets the real inputs).
    """
    key = (kernel_fn, sim, verify)
    if key not in _JIT_CACHE:
        runtime = dict(RUNTIME_OPTIONS, run_mode=pypto.RunMode.SIM if sim else pypto.RunMode.NPU)
        _JIT_CACHE[key] = pypto.frontend.jit(
            runtime_options=runtime,
            pass_options=dict(PASS_OPTIONS),
            verify_options={"enable_pass_verify": True} if verify else None,
        )(kernel_fn)
    return _JIT_CACHE[key]
