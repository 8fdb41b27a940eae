"""A model-local ONNX function for ``pakv::PagedAttention`` built from standard ops (and the gather).

The attention's stock-ONNX body, beside the gather's and the scatter's (:mod:`pakv_onnx.export.fallback`
attaches it when a model has a PagedAttention node): every context a sequence with new tokens
reads is gathered with ``pakv::GatherPaKvCache`` (whose own fallback function stock ORT inlines
too), then one dense attention over the packed batch: scores ``[Hk, Hq / Hk, N, rows]`` in fp32
(each kv head once, for its query heads), masked so each query sees only its own sequence's
positions up to its own, softmax, the weighted values back to ``[N, Hq, Dv]`` in query's type. It
reads like the ``torch`` backend's :func:`~pakv_onnx.kernels.torch_index.attention_torch`.

Speed and memory: the plugin's kernel streams each sequence's context through the block table;
this body copies the contexts and holds ``N x rows`` scores per head (a decode step: B x the sum
of the contexts; a long prefill: quadratic in its length). Correct everywhere, the slow case.

Never silently wrong: the rules standard ops can express are check nodes named after the rule
(:data:`ATTENTION_CHECKS`); the gather's checks refuse block ids and table rows; a head count that is
not a multiple, or a head_dim unlike the keys', fails the Reshape / MatMul.
"""

from __future__ import annotations

import functools

import onnx
from onnx import TensorProto
from onnxscript import opset19 as op
from onnxscript import script
from onnxscript.values import Opset

from pakv_onnx.export.fallback_function import function_for, function_template
from pakv_onnx.spec import ATTENTION, ATTR_SCALE, DOMAIN, INT64_MAX, OP_TYPE, OPSET_VERSION

_I64, _F32 = TensorProto.INT64, TensorProto.FLOAT
_PAKV = Opset(DOMAIN, OPSET_VERSION)

ATTENTION_CHECKS: dict[str, str] = {
    "num_seqs": "block_table must have rank 2",
    "check_attention_inputs": (
        "the inputs break the contract (pakv_onnx.validator.plan_attention says which): cumulative_sequence_lengths "
        "must start at 0, not decrease and end at query's N; past_sequence_lengths must have B entries, each >= 0"
    ),
}


@script(_PAKV, default_opset=op)
def PagedAttention(  # noqa: N802 (the ONNX op name)
    query, key_cache, value_cache, block_table, cumulative_sequence_lengths, past_sequence_lengths, scale: float = 0.0
):
    """Stock-ONNX body of pakv::PagedAttention (see pakv_onnx.export.fallback_attention)."""
    zero = op.Constant(value_ints=[0])
    one = op.Constant(value_ints=[1])
    minus_one = op.Constant(value_ints=[-1])
    num_seqs, _cols = op.Split(op.Shape(block_table), op.Constant(value_ints=[1, 1]))
    tokens, num_heads, head_dim = op.Split(op.Shape(query), op.Constant(value_ints=[1, 1, 1]))

    cu = op.Cast(cumulative_sequence_lengths, to=_I64)  # [B+1]
    past = op.Cast(past_sequence_lengths, to=_I64)  # [B]
    starts = op.Slice(cu, zero, minus_one)
    ends = op.Slice(cu, one, op.Constant(value_ints=[INT64_MAX]))
    last = op.Slice(cu, minus_one, op.Constant(value_ints=[INT64_MAX]))
    # Pairs low <= high, compared once: cu[0] == 0, non-decreasing, ends at N; past >= 0, B entries.
    zeros = op.Mul(past, zero)
    low = op.Concat(op.Slice(cu, zero, one), zero, starts, tokens, last, zeros, op.Shape(past), num_seqs, axis=0)
    high = op.Concat(zero, op.Slice(cu, zero, one), ends, last, tokens, past, num_seqs, op.Shape(past), axis=0)
    check_attention_inputs = op.Expand(one, op.ReduceMin(op.Where(op.LessOrEqual(low, high), one, minus_one), keepdims=1))

    # The contexts the op reads: past + new of each sequence with new tokens (0 for the others: the
    # op reads nothing of theirs, so neither does the gather).
    counts = op.Sub(ends, starts)
    contexts = op.Where(op.Greater(counts, zero), op.Add(past, counts), zeros)
    kv_ends = op.CumSum(contexts, op.Constant(value_int=0))
    kv_cu = op.Mul(op.Concat(zero, kv_ends, axis=0), check_attention_inputs)  # the check runs first
    keys, values = _PAKV.GatherPaKvCache(key_cache, value_cache, block_table, kv_cu, zeros)  # [rows, Hk, D|Dv]

    # Sequence and position of every query row and every context row: row i belongs to the sequence
    # whose range holds it (the count of ends at or before i).
    rows = op.Shape(keys, start=0, end=1)
    query_row = op.Unsqueeze(op.Sub(op.CumSum(op.Expand(one, tokens), op.Constant(value_int=0)), one), one)  # [N, 1]
    query_seq = op.ReduceSum(op.Cast(op.GreaterOrEqual(query_row, ends), to=_I64), one, keepdims=0)  # [N]
    query_pos = op.Add(op.Gather(past, query_seq), op.Sub(op.Squeeze(query_row, one), op.Gather(starts, query_seq)))
    context_row = op.Unsqueeze(op.Sub(op.CumSum(op.Expand(one, rows), op.Constant(value_int=0)), one), one)  # [rows, 1]
    context_seq = op.ReduceSum(op.Cast(op.GreaterOrEqual(context_row, kv_ends), to=_I64), one, keepdims=0)
    context_pos = op.Sub(op.Squeeze(context_row, one), op.Gather(op.Sub(kv_ends, contexts), context_seq))
    visible = op.And(
        op.Equal(op.Unsqueeze(query_seq, one), op.Unsqueeze(context_seq, zero)),
        op.LessOrEqual(op.Unsqueeze(context_pos, zero), op.Unsqueeze(query_pos, one)),
    )  # [N, rows]

    # GQA: query [N, Hq, D] as [Hk, G, N, D] against keys [Hk, 1, D, rows]: each kv head read once.
    kv_heads = op.Shape(keys, start=1, end=2)
    group = op.Div(num_heads, kv_heads)
    # allowzero: a 0 in a shape (no token, head_dim 0) is that size, not "copy the input's".
    q_shape = op.Concat(tokens, kv_heads, group, head_dim, axis=0)
    q = op.Transpose(op.Reshape(op.Cast(query, to=_F32), q_shape, allowzero=1), perm=[1, 2, 0, 3])
    k = op.Unsqueeze(op.Transpose(op.Cast(keys, to=_F32), perm=[1, 2, 0]), one)
    v = op.Unsqueeze(op.Transpose(op.Cast(values, to=_F32), perm=[1, 0, 2]), one)  # [Hk, 1, rows, Dv]
    given = op.Constant(value_float=scale)
    resolved = op.Reciprocal(op.Sqrt(op.Cast(op.Max(head_dim, one), to=_F32)))  # 1 / sqrt(D) (1 for D = 0)
    factor = op.Where(op.Equal(given, op.Constant(value_float=0.0)), op.Squeeze(resolved, zero), given)
    scores = op.Mul(op.MatMul(q, k), factor)  # [Hk, G, N, rows]
    minus_inf = op.Constant(value_float=float("-inf"))
    masked = op.Where(visible, scores, minus_inf)
    probs = op.Softmax(masked, axis=-1)  # a NaN row for a NaN or +inf score, or every score -inf
    nonfinite = op.Or(op.IsNaN(v), op.IsInf(v))
    if op.Greater(op.ReduceSum(op.Cast(nonfinite, to=_F32), keepdims=0), op.Constant(value_float=0.0)):
        # The non-finite rules (docs/reliability.md): a position not visible or of score -inf is absent
        # (its value row never read: 0 x NaN must not poison); every present one counts as weight > 0.
        finite_part = op.MatMul(probs, op.Where(nonfinite, op.Constant(value_float=0.0), v))
        present = op.Cast(op.Greater(masked, minus_inf), to=_F32)  # [Hk, G, N, rows]
        none = op.Constant(value_float=0.0)
        nan_hit = op.Greater(op.MatMul(present, op.Cast(op.IsNaN(v), to=_F32)), none)
        plus = op.Greater(op.MatMul(present, op.Cast(op.IsInf(v, detect_negative=0), to=_F32)), none)
        minus = op.Greater(op.MatMul(present, op.Cast(op.IsInf(v, detect_positive=0), to=_F32)), none)
        row_nan = op.IsNaN(op.ReduceSum(probs, op.Constant(value_ints=[-1]), keepdims=1))
        signed = op.Where(plus, op.Constant(value_float=float("inf")), op.Where(minus, minus_inf, finite_part))
        poisoned = op.Or(op.Or(nan_hit, op.And(plus, minus)), row_nan)
        attended = op.Where(poisoned, op.Constant(value_float=float("nan")), signed)
    else:
        attended = op.MatMul(probs, v)  # [Hk, G, N, Dv]
    value_dim = op.Shape(values, start=2, end=3)
    merged = op.Reshape(
        op.Transpose(attended, perm=[2, 0, 1, 3]), op.Concat(tokens, num_heads, value_dim, axis=0), allowzero=1
    )
    output = op.CastLike(merged, query)
    return output


@functools.cache
def _template() -> bytes:
    return function_template(PagedAttention, op_type=ATTENTION.op_type, inputs=ATTENTION.input_names, outputs=ATTENTION.output_names,
                             defaults={ATTR_SCALE: ATTENTION.attribute_defaults[ATTR_SCALE]}, checks=ATTENTION_CHECKS, module=__name__)  # fmt: skip


def make_attention_function(opset_version: int) -> onnx.FunctionProto:
    """The fallback ``FunctionProto`` for ``pakv::PagedAttention`` against default-domain ``opset_version``
    (it calls ``pakv::GatherPaKvCache``, whose function :func:`~pakv_onnx.export.fallback.attach_fallback` adds too)."""
    return function_for(_template(), opset_version, calls_pakv=True)


assert OP_TYPE == "GatherPaKvCache"  # the body's gather call names it literally (onnxscript needs the attribute)
