"""A model-local ONNX function for ``pakv::ScatterPaKvCache`` built from standard ops.

The write op's stock-ONNX body, beside the gather's (:mod:`pakv_onnx.export.fallback`, which
attaches both): each cache is viewed as rows of one token (Norm ``[nb*bs, H*D]`` by a reshape;
PA_NZ ``[nb, F, bs, E]`` transposed to ``[nb, bs, F, E]`` first), the rows of tokens whose slot is
non-negative are picked with ``Gather`` and written with one ``ScatterND`` at their slots, and
the result is laid back out. It reads like :func:`pakv_onnx.golden.scatter_golden`.

Speed: ``ScatterND`` writes into a copy of its input, so stock ORT copies each whole pool per
call (PA_NZ twice more, for the transposes): correct, and the slow case the plugin avoids (it
writes T rows in place). ``benchmarks/bench_generate.py`` measures it.

Never silently wrong: the rules standard ops can express are check nodes named after the rule
(see :data:`SCATTER_CHECKS`); ``ScatterND`` itself refuses a slot outside the pool.
"""

from __future__ import annotations

import functools

import onnx
from onnx import TensorProto
from onnxscript import opset19 as op
from onnxscript import script
from onnxscript.values import Opset

from pakv_onnx.export.fallback_function import function_for, function_template
from pakv_onnx.spec import ATTR_CACHE_MODE, DEFAULT_CACHE_MODE, DOMAIN, OPSET_VERSION, SCATTER, CacheMode

_I64 = TensorProto.INT64
_PAKV = Opset(DOMAIN, OPSET_VERSION)
_NORM, _PA_NZ = CacheMode.NORM.value, CacheMode.PA_NZ.value

# Check nodes: the Python variable of the check -> the rule (the node's name, so ORT's error shows it).
SCATTER_CHECKS: dict[str, str] = {
    "check_scatter_mode": f"{ATTR_CACHE_MODE} must be '{_NORM}' or '{_PA_NZ}'",
    "num_blocks": "key_cache must have rank 4",
    "value_blocks": "value_cache must have rank 4",
    "tokens": "key must have rank 3",
    "value_tokens": "value must have rank 3",
    "slot_count": "slot_mapping must have rank 1",
    "check_scatter_inputs": (
        "the inputs break the contract (pakv_onnx.validator.plan_scatter says which): value_cache's num_blocks and "
        "block_size must be key_cache's; value and slot_mapping must have key's T; every slot below num_blocks x "
        "block_size, none twice"
    ),
}


@script(_PAKV, default_opset=op)
def ScatterPaKvCache(key, value, key_cache, value_cache, slot_mapping, cache_mode: str = "Norm"):  # noqa: N802
    """Stock-ONNX body of pakv::ScatterPaKvCache (see pakv_onnx.export.fallback_scatter)."""
    one = op.Constant(value_ints=[1])
    minus_one = op.Constant(value_ints=[-1])
    mode = op.Constant(value_string=cache_mode)
    is_nz = op.Equal(mode, op.Constant(value_string=_PA_NZ))
    mode_ok = op.Or(is_nz, op.Equal(mode, op.Constant(value_string=_NORM)))
    passed, failed = op.Constant(value_string="0"), op.Constant(value_string="")
    check_scatter_mode = op.Cast(op.Where(mode_ok, passed, failed), to=_I64)

    # Split by 1s fails on any other rank: Norm [nb, bs, H, D], PA_NZ [nb, F, bs, E]; key [T, H, D].
    num_blocks, key_d1, key_d2, key_d3 = op.Split(op.Shape(key_cache), op.Constant(value_ints=[1, 1, 1, 1]))
    value_blocks, value_d1, value_d2, value_d3 = op.Split(op.Shape(value_cache), op.Constant(value_ints=[1, 1, 1, 1]))
    tokens, key_heads, key_dim = op.Split(op.Shape(key), op.Constant(value_ints=[1, 1, 1]))
    value_tokens, value_heads, value_dim = op.Split(op.Shape(value), op.Constant(value_ints=[1, 1, 1]))
    slot_count = op.Split(op.Shape(slot_mapping), one)
    if is_nz:
        block_size = op.Identity(key_d2)
        value_block_size = op.Identity(value_d2)
    else:
        block_size = op.Identity(key_d1)
        value_block_size = op.Identity(value_d1)
    capacity = op.Mul(num_blocks, block_size)
    value_capacity = op.Mul(value_blocks, value_block_size)

    slots = op.Cast(slot_mapping, to=_I64)
    written = op.GreaterOrEqual(slots, op.Constant(value_ints=[0]))  # a negative slot is padding
    index = op.Compress(slots, written)  # [N]
    count = op.Shape(index)
    distinct, _first, _inverse, _counts = op.Unique(index, sorted=1)
    # Pairs low <= high, compared once: same geometry, one T, every slot < capacity, none twice.
    low = op.Concat(
        num_blocks, value_blocks, block_size, value_block_size, tokens, value_tokens, slot_count, tokens, count,
        op.ReduceMax(op.Concat(index, minus_one, axis=0), keepdims=1),
        axis=0,
    )
    high = op.Concat(
        value_blocks, num_blocks, value_block_size, block_size, value_tokens, tokens, tokens, slot_count,
        op.Shape(distinct), op.Sub(capacity, one),
        axis=0,
    )
    check_scatter_inputs = op.Expand(one, op.ReduceMin(op.Where(op.LessOrEqual(low, high), one, minus_one), keepdims=1))
    at = op.Unsqueeze(op.Mul(index, check_scatter_inputs), one)  # [N, 1]; the check runs first

    # Rows picked by Gather (ORT's Compress has no bf16/fp8 kernels; Gather moves any type).
    picked = op.Reshape(op.NonZero(written), minus_one)  # the written tokens, in order
    # Shapes spelled out (no -1: it cannot be inferred beside a 0, e.g. T = 0 or an empty pool) and
    # allowzero (a 0 in a shape is that size, not "copy the input's").
    key_rows = op.Gather(
        op.Reshape(key, op.Concat(tokens, op.Mul(key_heads, key_dim), axis=0), allowzero=1), picked, axis=0
    )
    value_rows = op.Gather(
        op.Reshape(value, op.Concat(value_tokens, op.Mul(value_heads, value_dim), axis=0), allowzero=1), picked, axis=0
    )
    if is_nz:
        # [nb, F, bs, E] -> [nb, bs, F, E]: a token's fractals side by side are its row.
        key_row = op.Concat(capacity, op.Mul(key_d1, key_d3), axis=0)
        value_row = op.Concat(value_capacity, op.Mul(value_d1, value_d3), axis=0)
        key_pool = op.Reshape(op.Transpose(key_cache, perm=[0, 2, 1, 3]), key_row, allowzero=1)
        value_pool = op.Reshape(op.Transpose(value_cache, perm=[0, 2, 1, 3]), value_row, allowzero=1)
        key_done = op.Reshape(
            op.ScatterND(key_pool, at, key_rows), op.Concat(num_blocks, block_size, key_d1, key_d3, axis=0), allowzero=1
        )
        value_done = op.Reshape(
            op.ScatterND(value_pool, at, value_rows),
            op.Concat(value_blocks, value_block_size, value_d1, value_d3, axis=0),
            allowzero=1,
        )
        key_cache_out = op.Transpose(key_done, perm=[0, 2, 1, 3])
        value_cache_out = op.Transpose(value_done, perm=[0, 2, 1, 3])
    else:
        key_pool = op.Reshape(key_cache, op.Concat(capacity, op.Mul(key_d2, key_d3), axis=0), allowzero=1)
        value_pool = op.Reshape(value_cache, op.Concat(value_capacity, op.Mul(value_d2, value_d3), axis=0), allowzero=1)
        key_cache_out = op.Reshape(op.ScatterND(key_pool, at, key_rows), op.Shape(key_cache), allowzero=1)
        value_cache_out = op.Reshape(op.ScatterND(value_pool, at, value_rows), op.Shape(value_cache), allowzero=1)
    return key_cache_out, value_cache_out


@functools.cache
def _template() -> bytes:
    return function_template(ScatterPaKvCache, op_type=SCATTER.op_type, inputs=SCATTER.input_names, outputs=SCATTER.output_names,
                             defaults={ATTR_CACHE_MODE: DEFAULT_CACHE_MODE.value.encode()}, checks=SCATTER_CHECKS, module=__name__)  # fmt: skip


def make_scatter_function(opset_version: int) -> onnx.FunctionProto:
    """The fallback ``FunctionProto`` for ``pakv::ScatterPaKvCache`` against default-domain ``opset_version``."""
    return function_for(_template(), opset_version)
