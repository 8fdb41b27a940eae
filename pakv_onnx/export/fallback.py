"""A model-local ONNX function for ``pakv::GatherPaKvCache`` built from standard ops.

With it in ``ModelProto.functions``, stock ONNX Runtime (no plugin registered) inlines the
function and runs the model; with the plugin registered, ORT picks the plugin's kernel
(a registered kernel takes precedence over a model-local function of the same op).

The body is the onnxscript function :func:`GatherPaKvCache` below, written to read like
:mod:`pakv_onnx.golden`. Both attributes are read from the node; once ORT inlines the
function they are constants, so ORT folds every ``If`` on them at session creation and runs
only the branch of the node's layout and ``seq_lens`` form.

Gather: token t of sequence q sits at position ``t + base[q]`` of the block table flattened
into token slots (``base[q] = (q * cols + seq_offset[q] // bs) * bs - out_start[q]``, the
FLOOR RULE of :mod:`pakv_onnx.spec`); ``position // bs`` indexes the flattened table and
``position % bs`` is the slot. ``base`` reaches every token through two scatter-adds (at the
sequences' output starts and ends) and one cumsum (O(T + Q), no per-token search). PA_NZ
caches are read as rows of E elements (a Flatten view, no transpose copy): one GatherND
index per (token, fractal).

Speed: ORT spends about 0.25-0.75 us per node whatever its size (Where, Split, Concat and
Slice at the top), so at small T the body's cost is its node count. After ORT inlines the
function and folds the attribute branches, 39 nodes remain for Norm with cumsum ``seq_lens``
(42 with lengths) and 56 for PA_NZ (59); about a third of them are the checks.
``benchmarks/bench_fallback.py`` times the body against the plugin and against a floor
that only runs the final gathers.

Never silently wrong: every rule of :func:`pakv_onnx.validator.plan_gather` that standard ops can
express has a check node, named after the rule (ORT's error names the node, e.g.
``Name:'_inlfunc_GatherPaKvCache_pakv check: seq_offset ...'``), so the run fails with an ORT
error instead of returning rows; see :data:`CHECKS`. Rules it cannot express are listed in
:data:`UNCHECKED_RULES`.

An absent ``seq_offset`` cannot be read inside an ONNX function in ORT (its inliner
turns the missing input into "" and rejects every use, even inside an ``If`` branch
not taken). :func:`attach_fallback` therefore gives such nodes an explicit all-zero
``seq_offset`` (computed from ``block_tables``'s row count), which means the same gather.
"""

from __future__ import annotations

import functools

import onnx
from onnx import TensorProto
from onnx import helper as h
from onnxscript import opset19 as op
from onnxscript import script
from onnxscript.values import Opset

from pakv_onnx.export.fallback_attention import make_attention_function
from pakv_onnx.export.fallback_function import function_for, function_template
from pakv_onnx.export.fallback_scatter import make_scatter_function
from pakv_onnx.spec import (
    ATTENTION,
    ATTR_CACHE_MODE,
    ATTR_IS_SEQ_LENS_CUMSUM,
    DEFAULT_CACHE_MODE,
    DEFAULT_IS_SEQ_LENS_CUMSUM,
    DOMAIN,
    INPUT_NAMES,
    INT64_MAX,
    OP_TYPE,
    OPSET_VERSION,
    OUTPUT_NAMES,
    SCATTER,
    CacheMode,
)

# String Equal (to read cache_mode) exists from opset 19.
MIN_OPSET = 19
_I64 = TensorProto.INT64
_PAKV = Opset(DOMAIN, OPSET_VERSION)
_NORM, _PA_NZ = CacheMode.NORM.value, CacheMode.PA_NZ.value

# Check nodes: Python variable of the check (its output name) -> the rule, which becomes the
# node's name and so appears in ORT's error. The attribute checks are Cast(Where(ok, "0", ""),
# to=INT64) (the empty string fails to parse wherever ``ok`` is false); the rank and count checks
# are the Splits / Concat that fail on a wrong size; the value checks share one Expand whose size
# is -1 when any of them fails; the block-id checks are the gathers, which reject the ids.
CHECKS: dict[str, str] = {
    "check_cache_mode": f"{ATTR_CACHE_MODE} must be '{_NORM}' or '{_PA_NZ}'",
    "check_cumsum_flag": f"{ATTR_IS_SEQ_LENS_CUMSUM} must be 0 or 1",
    "num_blocks": "key_cache must have rank 4",  # (the Split of key_cache's shape)
    "value_blocks": "value_cache must have rank 4",
    "num_seqs": "block_tables must have rank 2",
    "counted_lens": "seq_lens must have Q+1 entries (cumsum) or Q (lengths)",  # (the Split of seq_lens)
    "offsets": "seq_offset must have Q entries",
    "low": "seq_lens and seq_offset must have rank 1",  # (the Concat fails on mixed ranks)
    "check_inputs": (
        "the inputs break the contract (pakv_onnx.validator.plan_gather says which): value_cache's num_blocks "
        "and block_size must be key_cache's, block_size >= 1; seq_lens must start at 0 and not decrease "
        "(cumsum) or be non-negative and sum within int64 (lengths); seq_offset must be non-negative; "
        "each block_tables row must hold its sequence's blocks from column seq_offset // block_size"
    ),
    "key_rows_read": "block_tables entry used by a sequence is outside [0, num_blocks) (key rows)",
    "value_rows_read": "block_tables entry used by a sequence is outside [0, num_blocks) (value rows)",
}

# Rules of the validator that the function does not check, and why.
UNCHECKED_RULES: dict[str, str] = {
    "cache and index dtypes in the contract": (
        "a function body cannot branch on an input's element type; the graph's declared input "
        "types fix them (float8 caches fail at session creation: no standard Gather takes them)"
    ),
    "PA_NZ last dim = 32 bytes / itemsize": "the element size of a type is not readable with standard ops",
    "output byte size fits int64": "needs the element size; ORT's allocation fails instead",
    "block ids when every row holds zero bytes": (
        "with empty rows the gathers read nothing and so check nothing (the output is empty either way)"
    ),
    "offsets and lengths within block_size of INT64_MAX": (
        "the row-fit check adds seq_offset and the length in int64, which can wrap for such values"
    ),
}


@script(_PAKV, default_opset=op)
def GatherPaKvCache(  # noqa: N802 (the ONNX op name)
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    seq_offset,
    cache_mode: str = "Norm",
    is_seq_lens_cumsum: int = 1,
):
    """Stock-ONNX body of pakv::GatherPaKvCache (see pakv_onnx.export.fallback)."""
    # Every node costs ORT 0.25-0.75 us whatever its size, so the body is written for few nodes
    # (see the module doc): checks share one compare, index values are kept [T, 1].
    zero = op.Constant(value_ints=[0])
    one = op.Constant(value_ints=[1])
    minus_one = op.Constant(value_ints=[-1])
    passed = op.Constant(value_string="0")
    failed = op.Constant(value_string="")

    # Attributes: constants once ORT inlines the function; it folds them and every If on them.
    mode = op.Constant(value_string=cache_mode)
    is_nz = op.Equal(mode, op.Constant(value_string=_PA_NZ))
    check_cache_mode = op.Cast(op.Where(op.Or(is_nz, op.Equal(mode, op.Constant(value_string=_NORM))), passed, failed), to=_I64)
    cumsum_flag = op.Constant(value_int=is_seq_lens_cumsum)
    is_cumsum = op.Equal(cumsum_flag, op.Constant(value_int=1))
    flag_ok = op.Or(is_cumsum, op.Equal(cumsum_flag, op.Constant(value_int=0)))
    check_cumsum_flag = op.Cast(op.Where(flag_ok, passed, failed), to=_I64)

    # Cache geometry, [1]-shaped dims (Split by 1s fails on any rank but 4):
    # Norm [nb, bs, H, D], PA_NZ [nb, F, bs, E].
    num_blocks, key_d1, key_d2, key_d3 = op.Split(op.Shape(key_cache), op.Constant(value_ints=[1, 1, 1, 1]))
    value_blocks, value_d1, value_d2, value_d3 = op.Split(op.Shape(value_cache), op.Constant(value_ints=[1, 1, 1, 1]))
    if is_nz:
        key_block_size = op.Identity(key_d2)
        value_block_size = op.Identity(value_d2)
    else:
        key_block_size = op.Identity(key_d1)
        value_block_size = op.Identity(value_d1)
    block_size = op.Max(key_block_size, one)  # never 0 (a divisor), even before its check fails

    num_seqs, cols = op.Split(op.Shape(block_tables), op.Constant(value_ints=[1, 1]))

    # Per sequence: output starts, ends and lengths from either seq_lens form. One Split checks
    # the entry count (Q+1 cumsum, Q lengths); a rank other than 1 fails the checks' Concat below.
    lens = op.Cast(seq_lens, to=_I64)
    counted_lens, last_len = op.Split(lens, op.Concat(num_seqs, op.Reshape(cumsum_flag, one), axis=0))
    offsets = op.Split(op.Cast(seq_offset, to=_I64), num_seqs)
    # Checks are pairs low <= high, gathered in two vectors and compared once (cheaper in ORT
    # than one compare per rule). Each branch gives the same pieces; the vectors are
    #   low  = [geometry, low_a,  low_b,  low_c,          offset_remainder]
    #   high = [geometry, high_a, high_b, high_c, room, offsets]
    # where [low_a, low_b] lines up with [high_a, high_b] and low_c with [high_c, room] (room:
    # see the row-fit check below), entry by entry.
    if is_cumsum:
        starts = op.Identity(counted_lens)
        ends = op.Slice(lens, one, op.Constant(value_ints=[INT64_MAX]))
        num_tokens = op.Identity(last_len)
        # Pieces of seq_lens itself shifted by one (no node to cut out the first entry), compared,
        # not subtracted (no wrap-around): [0, lens] <= [lens, T] is seq_lens[0] >= 0 and
        # non-decreasing; lens <= [0, room] is seq_lens[0] <= 0 and the row fit of each end.
        low_a, low_b, low_c = op.Identity(zero), op.Identity(lens), op.Identity(lens)
        high_a, high_b, high_c = op.Identity(lens), op.Identity(last_len), op.Identity(zero)
    else:
        ends = op.CumSum(counted_lens, op.Constant(value_int=0))
        starts = op.Sub(ends, counted_lens)
        num_tokens = op.ReduceSum(counted_lens, keepdims=1)
        # Lengths non-negative; partial sums of non-negative lengths turn negative at the first
        # int64 overflow, so the ends must be non-negative too; ends <= room is the row fit.
        low_a = op.Mul(counted_lens, zero)
        low_b, low_c = op.Identity(low_a), op.Identity(ends)
        high_a, high_b, high_c = op.Identity(counted_lens), op.Identity(ends), op.Constant(value_ints=[])

    # FLOOR RULE: sequence q starts at slot 0 of block-table column seq_offset[q] // bs.
    offset_remainder = op.Mod(offsets, block_size)  # in [0, bs): <= seq_offset iff seq_offset >= 0
    first_column_token = op.Sub(offsets, offset_remainder)
    row_tokens = op.Mul(cols, block_size)
    # Token t of sequence q sits at position t + base[q] of the table flattened into token
    # slots, base[q] = q*row_tokens + local_base[q].
    local_base = op.Sub(first_column_token, starts)
    # room[q] = row_tokens - local_base[q]: the row holds the sequence from its first column iff
    # its end <= room[q] (first + end <= row + start, as spec: ceil(length / bs) <= cols - first
    # column; an empty sequence's first column must exist or be the end).
    room = op.Sub(row_tokens, local_base)

    low = op.Concat(
        num_blocks, value_blocks, key_block_size, value_block_size, one, low_a, low_b, low_c, offset_remainder,
        axis=0,
    )
    high = op.Concat(
        value_blocks, num_blocks, value_block_size, key_block_size, key_block_size,
        high_a, high_b, high_c, room, offsets,
        axis=0,
    )
    # The array below has T ones when every pair holds and -1 entries (which Expand rejects)
    # when one fails, so the check runs before anything a broken input could make fail less clearly.
    size = op.ReduceMin(op.Where(op.LessOrEqual(low, high), num_tokens, minus_one), keepdims=1)
    check_inputs = op.Expand(one, size)
    # Every position from one cumsum over [0, 1, ..., 1] (T + 1 entries: which adds t at
    # output row t) with local_base[q] added at each sequence's start and room[q] at its end:
    # row t of sequence q sums to t + local_base[q] + sum over q' < q of
    # (local_base[q'] + room[q']) = t + local_base[q] + q*row_tokens = t + base[q].
    # (O(T + Q), no per-token search; an end at T lands on the extra last entry.)
    marks = op.ScatterElements(
        op.ScatterElements(op.Concat(zero, check_inputs, axis=0), starts, local_base, axis=0, reduction="add"),
        ends,
        room,
        axis=0,
        reduction="add",
    )
    position = op.Unsqueeze(op.Slice(op.CumSum(marks, op.Constant(value_int=0)), zero, num_tokens), one)  # [T, 1]
    slot = op.Mod(position, block_size)
    # Clearing the sign bit turns a negative id (which the gathers would wrap around) into one
    # of at least 2**62, which they reject with the rest of the out-of-range ids.
    sign_off = op.Constant(value_ints=[INT64_MAX])
    tables = op.BitwiseAnd(op.Reshape(op.Cast(block_tables, to=_I64), minus_one), sign_off)
    block = op.Gather(tables, op.Div(position, block_size))  # [T, 1]

    if is_nz:
        # [nb, F, bs, E] as rows of E elements: fractal f of (block, slot) is row
        # block*F*bs + slot + f*bs. Out-of-range ids become num_blocks first, so the row
        # arithmetic cannot wrap into range.
        block_rows = op.Mul(op.Min(block, num_blocks), block_size)  # block*bs, [T, 1]
        # f*bs for f < F: an exclusive cumsum of F copies of bs (no scalar Range inputs).
        key_fractals = op.CumSum(op.Expand(block_size, key_d1), op.Constant(value_int=0), exclusive=1)  # [F]
        last_axis = op.Constant(value_ints=[2])
        key_index = op.Unsqueeze(op.Add(op.Add(op.Mul(block_rows, key_d1), slot), key_fractals), last_axis)
        value_fractals = op.CumSum(op.Expand(block_size, value_d1), op.Constant(value_int=0), exclusive=1)
        value_index = op.Unsqueeze(op.Add(op.Add(op.Mul(block_rows, value_d1), slot), value_fractals), last_axis)
        key_source = op.Flatten(key_cache, axis=3)  # [nb*F*bs, E]; index [T, F, 1]
        value_source = op.Flatten(value_cache, axis=3)
    else:
        # [nb, bs, H, D]: one (block, slot) index per token reads its [H, D] row.
        key_source = op.Identity(key_cache)
        value_source = op.Identity(value_cache)
        key_index = op.Concat(block, slot, axis=1)  # [T, 2]
        value_index = op.Identity(key_index)
    # Outside the If, so ORT's error names this node (ORT renames nodes of a folded If):
    # GatherND rejects the out-of-range ids.
    key_rows_read = op.GatherND(key_source, key_index)
    value_rows_read = op.GatherND(value_source, value_index)
    if is_nz:
        key = op.Flatten(key_rows_read, axis=1)  # [T, F, E] -> [T, F*E]
        value = op.Flatten(value_rows_read, axis=1)
    else:
        key = op.Identity(key_rows_read)
        value = op.Identity(value_rows_read)
    return key, value


@functools.cache
def _function_template() -> bytes:
    defaults = {ATTR_CACHE_MODE: DEFAULT_CACHE_MODE.value.encode(), ATTR_IS_SEQ_LENS_CUMSUM: int(DEFAULT_IS_SEQ_LENS_CUMSUM)}
    return function_template(GatherPaKvCache, op_type=OP_TYPE, inputs=INPUT_NAMES, outputs=OUTPUT_NAMES,
                             defaults=defaults, checks=CHECKS, module=__name__)  # fmt: skip


def make_function(opset_version: int) -> onnx.FunctionProto:
    """The fallback ``FunctionProto`` for ``pakv::GatherPaKvCache`` against default-domain ``opset_version``.

    The body uses only ops unchanged from opset 19 on, so it is declared against the model's
    own default-domain version (ONNX Runtime wants a function's opsets to match the model's).
    """
    if opset_version < MIN_OPSET:
        raise ValueError(f"the fallback function needs opset >= {MIN_OPSET}, the model uses {opset_version}")
    return function_for(_function_template(), opset_version)


# --------------------------------------------------------------------------- #
# Attaching the function to a model
# --------------------------------------------------------------------------- #
def _default_opset(model: onnx.ModelProto) -> int:
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            return opset.version
    raise ValueError("the model imports no default-domain opset")


def _is_gather(node: onnx.NodeProto) -> bool:
    return node.domain == DOMAIN and node.op_type == OP_TYPE


def _materialize_seq_offset(graph: onnx.GraphProto, prefix: str) -> int:
    """Give every GatherPaKvCache node of ``graph`` (and its subgraphs) a seq_offset input."""
    offset_index = INPUT_NAMES.index("seq_offset")
    table_index = INPUT_NAMES.index("block_tables")
    nodes: list[onnx.NodeProto] = []
    changed = 0
    for index, node in enumerate(graph.node):
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                changed += _materialize_seq_offset(attr.g, f"{prefix}{index}_")
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    changed += _materialize_seq_offset(sub, f"{prefix}{index}_")
        if _is_gather(node) and (len(node.input) <= offset_index or not node.input[offset_index]):
            base = f"_pakv_zero_seq_offset_{prefix}{index}"
            rows = h.make_node(
                "Shape", [node.input[table_index]], [f"{base}_rows"], start=0, end=1, name=f"{base}_shape"
            )
            zeros = h.make_node(
                "ConstantOfShape",
                [f"{base}_rows"],
                [base],
                value=h.make_tensor("zero", TensorProto.INT64, [1], [0]),
                name=f"{base}_zeros",
            )
            nodes.extend((rows, zeros))
            while len(node.input) < offset_index:
                node.input.append("")
            if len(node.input) == offset_index:
                node.input.append(base)
            else:
                node.input[offset_index] = base
            changed += 1
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    return changed


def attach_fallback(model: onnx.ModelProto) -> onnx.ModelProto:
    """Add (or replace) the fallback functions in ``model``, in place; return ``model``: the gather's,
    the scatter's (:mod:`pakv_onnx.export.fallback_scatter`) when the model has a scatter node, and
    the attention's (:mod:`pakv_onnx.export.fallback_attention`) when it has a PagedAttention node.

    Also imports the ``pakv`` opset and gives nodes without ``seq_offset`` an all-zero one
    (same result; see the module doc). Needs a default-domain opset >= 19.
    """

    opset = _default_opset(model)
    functions = [make_function(opset)]
    if _has_node(model.graph, SCATTER.op_type):
        functions.append(make_scatter_function(opset))
    if _has_node(model.graph, ATTENTION.op_type):
        functions.append(make_attention_function(opset))  # it calls the gather (whose function is above)
    names = {f.name for f in functions}
    kept = [f for f in model.functions if not (f.domain == DOMAIN and f.name in names)]
    del model.functions[:]
    model.functions.extend([*kept, *functions])
    if not any(opset.domain == DOMAIN for opset in model.opset_import):
        model.opset_import.append(h.make_opsetid(DOMAIN, OPSET_VERSION))
    _materialize_seq_offset(model.graph, "")
    return model


def _has_node(graph: onnx.GraphProto, op_type: str) -> bool:
    """Whether ``graph`` (or a subgraph) has a ``pakv::op_type`` node."""
    for node in graph.node:
        if node.domain == DOMAIN and node.op_type == op_type:
            return True
        for attr in node.attribute:
            subgraphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            if any(_has_node(sub, op_type) for sub in subgraphs):
                return True
    return False


def has_fallback(model: onnx.ModelProto) -> bool:
    """True when ``model`` carries the fallback function."""
    return any(f.domain == DOMAIN and f.name == OP_TYPE for f in model.functions)
