"""A model-local ONNX function for ``pakv::GatherPaKvCache`` built from standard ops.

With it in ``ModelProto.functions``, stock ONNX Runtime (no plugin registered) inlines the
function and runs the model; with the plugin registered, ORT picks the plugin's kernel
(a registered kernel takes precedence over a model-local function of the same op).

The body is branch-free index arithmetic (no ``If``), polymorphic in the cache and index
types, and handles both attributes from the node:

* ``is_seq_lens_cumsum`` -> ``c`` (0/1): ``lengths = seq_lens[c:] - c * [0, seq_lens][c:-1]``
  is the per-sequence length in either form; output starts are its exclusive cumsum.
* ``cache_mode`` -> ``m`` (0 Norm, 1 PA_NZ): both layouts are rows of ``E`` elements,
  ``cache [nb, F, bs, E]`` with ``F = 1, E = H*D`` for Norm (``[nb, bs, H, D]``), so the
  fractal ``f`` of token (block, slot) is row ``(block*F + f)*bs + slot`` — the PA_NZ
  "transpose" of the fractal and slot axes is folded into that index.
* per token ``t``: sequence id from a scatter-add of sequence ends plus a cumsum (O(T+Q)),
  then local index, block-table column (``seq_offset // bs`` + local // bs), physical block
  and slot. int32 indices are cast to int64.

Out-of-range block ids or too-short block-table rows are turned into an out-of-range
``Gather`` index, so ORT raises an error instead of reading a wrong row (no silent garbage).
The body does not check the rest of the contract (e.g. non-decreasing cumsum): feed it
valid inputs, as for any backend.

An absent ``seq_offset`` cannot be read inside an ONNX function in ORT (its inliner
turns the missing input into "" and rejects every use, even inside an ``If`` branch
not taken). :func:`attach_fallback` therefore gives such nodes an explicit all-zero
``seq_offset`` (computed from ``block_tables``'s row count), which means the same gather.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto
from onnx import helper as h

from pakv_onnx.spec import (
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
    CacheMode,
)

# String Equal (to read cache_mode) exists from opset 19.
MIN_OPSET = 19


class _Body:
    """Collects the nodes of the function body with short unique names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self._count = 0

    def __call__(self, op_type: str, inputs: list[str], outputs: int = 1, **attrs) -> str | list[str]:
        names = [f"_{op_type.lower()}{self._count}_{i}" for i in range(outputs)]
        self._count += 1
        self.nodes.append(h.make_node(op_type, inputs, names, **attrs))
        return names[0] if outputs == 1 else names

    def const(self, values: list[int] | int) -> str:
        if isinstance(values, list):
            return self("Constant", [], value_ints=values)
        return self("Constant", [], value_int=values)

    def ref_attr(self, attr_name: str, constant_field: str, attr_type: int) -> str:
        """A ``Constant`` whose value is the function attribute ``attr_name``."""
        name = f"_attr_{attr_name}"
        node = h.make_node("Constant", [], [name])
        ref = onnx.AttributeProto(name=constant_field, ref_attr_name=attr_name, type=attr_type)
        node.attribute.append(ref)
        self.nodes.append(node)
        return name


def _gather_one(
    b: _Body, cache: str, out: str, m: str, is_nz: str, block: str, block_ok: str, slot: str, t_len: str
) -> None:
    """Gather one cache into ``out``: rows of E elements, F rows (fractals) per token."""
    shape = b("Shape", [cache])
    s1 = b("Slice", [shape, b.const([1]), b.const([2])])
    s2 = b("Slice", [shape, b.const([2]), b.const([3])])
    s3 = b("Slice", [shape, b.const([3]), b.const([4])])
    bs = b("Squeeze", [b("Where", [is_nz, s2, s1])])
    fractals = b("Squeeze", [b("Where", [is_nz, s1, b.const([1])])])
    row_len = b("Where", [is_nz, s3, b("Mul", [s2, s3])])
    rows = b("Reshape", [cache, b("Concat", [b.const([-1]), row_len], axis=0)])
    num_rows = b("Shape", [rows], start=0, end=1)

    # row = (block*F + f)*bs + slot, shape [T, F]; invalid blocks get an out-of-range row.
    f = b("Range", [b.const(0), fractals, b.const(1)])
    first = b("Unsqueeze", [b("Mul", [block, fractals]), b.const([1])])
    row = b("Add", [b("Mul", [b("Add", [first, f]), bs]), b("Unsqueeze", [slot, b.const([1])])])
    bad_row = b("Neg", [b("Add", [num_rows, b.const([1])])])
    row = b("Where", [b("Unsqueeze", [block_ok, b.const([1])]), row, bad_row])
    gathered = b("Gather", [rows, row], axis=0)  # [T, F, E]
    # Output shape: [T, H, D] (Norm: [s2, s3]) or [T, H*D] (PA_NZ: [s1*s3]).
    tails = b("Concat", [s2, s3, b("Mul", [s1, s3])], axis=0)
    tail = b("Slice", [tails, b("Mul", [m, b.const([2])]), b("Add", [m, b.const([2])])])
    target = b("Concat", [t_len, tail], axis=0)
    b.nodes.append(h.make_node("Reshape", [gathered, target], [out], allowzero=1))


def make_function(opset_version: int) -> onnx.FunctionProto:
    """The fallback ``FunctionProto`` for ``pakv::GatherPaKvCache`` against default-domain ``opset_version``."""
    if opset_version < MIN_OPSET:
        raise ValueError(f"the fallback function needs opset >= {MIN_OPSET}, the model uses {opset_version}")
    key_cache, value_cache, block_tables, seq_lens, seq_offset = INPUT_NAMES
    b = _Body()
    i64 = TensorProto.INT64

    # Attributes -> c (cumsum flag, [1]) and m (PA_NZ flag, [1]).
    c_scalar = b.ref_attr(ATTR_IS_SEQ_LENS_CUMSUM, "value_int", onnx.AttributeProto.INT)
    c = b("Reshape", [c_scalar, b.const([1])])
    mode_str = b.ref_attr(ATTR_CACHE_MODE, "value_string", onnx.AttributeProto.STRING)
    nz_str = b("Constant", [], value_string=CacheMode.PA_NZ.value)
    is_nz = b("Reshape", [b("Equal", [mode_str, nz_str]), b.const([1])])
    m = b("Cast", [is_nz], to=i64)

    # Per-sequence lengths and output starts, either seq_lens form.
    lens_in = b("Cast", [seq_lens], to=i64)
    padded = b("Concat", [b.const([0]), lens_in], axis=0)
    current = b("Slice", [lens_in, c, b.const([INT64_MAX])])
    previous = b("Slice", [padded, c, b.const([-1])])
    lengths = b("Sub", [current, b("Mul", [previous, c])])  # [Q]
    ends = b("CumSum", [lengths, b.const(0)])
    starts = b("Sub", [ends, lengths])
    t_scalar = b("ReduceSum", [lengths], keepdims=0)
    t_len = b("Reshape", [t_scalar, b.const([1])])  # [1]

    # Sequence id of each token: #{q : ends[q] <= t}.
    marks = b(
        "ScatterElements",
        [
            b("ConstantOfShape", [b("Add", [t_len, b.const([1])])], value=h.make_tensor("zero", i64, [1], [0])),
            ends,
            b("ConstantOfShape", [b("Shape", [ends])], value=h.make_tensor("one", i64, [1], [1])),
        ],
        axis=0,
        reduction="add",
    )
    seq = b("Slice", [b("CumSum", [marks, b.const(0)]), b.const([0]), t_len])  # [T]
    token = b("Range", [b.const(0), t_scalar, b.const(1)])
    local = b("Sub", [token, b("Gather", [starts, seq], axis=0)])

    # Block size from key_cache (value_cache shares it): shape[1] Norm, shape[2] PA_NZ.
    key_shape = b("Shape", [key_cache])
    bs = b(
        "Squeeze",
        [
            b(
                "Where",
                [
                    is_nz,
                    b("Slice", [key_shape, b.const([2]), b.const([3])]),
                    b("Slice", [key_shape, b.const([1]), b.const([2])]),
                ],
            )
        ],
    )
    num_blocks = b("Squeeze", [b("Slice", [key_shape, b.const([0]), b.const([1])])])

    col_starts = b("Div", [b("Cast", [seq_offset], to=i64), bs])
    col = b("Add", [b("Gather", [col_starts, seq], axis=0), b("Div", [local, bs])])
    slot = b("Mod", [local, bs])
    tables = b("Cast", [block_tables], to=i64)
    cols = b("Squeeze", [b("Shape", [tables], start=1, end=2)])
    flat_tables = b("Reshape", [tables, b.const([-1])])
    num_entries = b("Shape", [flat_tables])
    # A column past the row's end would read the next row: poison it instead.
    col_ok = b("And", [b("GreaterOrEqual", [col, b.const(0)]), b("Less", [col, cols])])
    entry = b(
        "Where", [col_ok, b("Add", [b("Mul", [seq, cols]), col]), b("Neg", [b("Add", [num_entries, b.const([1])])])]
    )
    block = b("Gather", [flat_tables, entry], axis=0)  # [T]
    # Negative or too large block ids are poisoned per cache row (Gather wraps negatives around).
    block_ok = b("And", [b("GreaterOrEqual", [block, b.const(0)]), b("Less", [block, num_blocks])])

    key_out, value_out = OUTPUT_NAMES
    _gather_one(b, key_cache, key_out, m, is_nz, block, block_ok, slot, t_len)
    _gather_one(b, value_cache, value_out, m, is_nz, block, block_ok, slot, t_len)

    function = h.make_function(
        DOMAIN,
        OP_TYPE,
        list(INPUT_NAMES),
        list(OUTPUT_NAMES),
        b.nodes,
        [h.make_opsetid("", opset_version)],
        doc_string="Stock-ONNX fallback body of pakv::GatherPaKvCache (see pakv_onnx.export.fallback).",
    )
    function.attribute_proto.extend(
        [
            h.make_attribute(ATTR_CACHE_MODE, DEFAULT_CACHE_MODE.value),
            h.make_attribute(ATTR_IS_SEQ_LENS_CUMSUM, int(DEFAULT_IS_SEQ_LENS_CUMSUM)),
        ]
    )
    return function


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
    """Add (or replace) the fallback function in ``model``, in place; return ``model``.

    Also imports the ``pakv`` opset and gives nodes without ``seq_offset`` an all-zero one
    (same result; see the module doc). Needs a default-domain opset >= 19.
    """
    function = make_function(_default_opset(model))
    kept = [f for f in model.functions if not (f.domain == DOMAIN and f.name == OP_TYPE)]
    del model.functions[:]
    model.functions.extend([*kept, function])
    if not any(opset.domain == DOMAIN for opset in model.opset_import):
        model.opset_import.append(h.make_opsetid(DOMAIN, OPSET_VERSION))
    _materialize_seq_offset(model.graph, "")
    return model


def has_fallback(model: onnx.ModelProto) -> bool:
    """True when ``model`` carries the fallback function."""
    return any(f.domain == DOMAIN and f.name == OP_TYPE for f in model.functions)
