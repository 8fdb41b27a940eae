"""When a model's writes may take ORT's alias route: the graph check ``make_session`` runs before it opts in.

``pakv::ScatterPaKvCache`` and ``com.microsoft::PagedAttention`` (the writes) update their pools in place. On ORT >= 1.18 (ORT_SEQUENTIAL) an op can declare
each updated cache *to be* its input's buffer (an alias map), which lets a write whose outputs feed later
nodes (a gather, an attention) write the caller's pool without a copy. ORT applies an alias whatever else
reads that buffer, and a kernel sees no graph, so the library declares it only for registrations that opt
in (the session config entry ``pakv_onnx.alias_caches`` = ``1``). ``make_session`` opts in when this check
finds nothing: each write's pool inputs are graph inputs read by that one node alone (``Shape`` and ``Size``,
which read no data, aside), neither initializers nor graph outputs, and no write sits inside a subgraph or a
function. Anything else keeps ONNX's
semantics: the updated caches are the host's bound outputs (in place when bound to the pools) or ORT's
(a copy of each pool first), and no reader sees a write it did not ask for.
"""

from __future__ import annotations

from collections.abc import Iterator

import onnx

from pakv_onnx.spec import DOMAIN, MS_DOMAIN, ORT_ATTENTION, SCATTER

# Each write op, (domain, op type), with the names of its inputs: its pools are key_cache and value_cache.
WRITES = {(DOMAIN, SCATTER.op_type): SCATTER.input_names, (MS_DOMAIN, ORT_ATTENTION.op_type): ORT_ATTENTION.input_names}
POOL_NAMES = ("key_cache", "value_cache")
# Standard ops that read a tensor's shape alone: a write cannot change what they see.
SHAPE_READERS = frozenset({"Shape", "Size"})


def _label(node: onnx.NodeProto, index: int) -> str:
    return f"{node.op_type} node {node.name!r}" if node.name else f"{node.op_type} node #{index} (unnamed)"


def _subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            yield attribute.g
        yield from attribute.graphs


def _names_read_inside(graph: onnx.GraphProto) -> set[str]:
    """Every name a node of ``graph`` (or of its own subgraphs) reads: what a subgraph may take from outside."""
    names = set()
    for node in graph.node:
        names.update(node.input)
        for sub in _subgraphs(node):
            names |= _names_read_inside(sub)
    return names


def _is_write(node: onnx.NodeProto) -> bool:
    return (node.domain, node.op_type) in WRITES


def _writes_inside(graph: onnx.GraphProto) -> bool:
    return any(_is_write(n) or any(_writes_inside(g) for g in _subgraphs(n)) for n in graph.node)


def alias_hazards(model: onnx.ModelProto) -> list[str]:
    """Why the writes of ``model`` must not take the alias route (empty: they may), one line each, naming
    the node and the pool input."""
    graph = model.graph
    constants = {t.name for t in graph.initializer} | {t.values.name for t in graph.sparse_initializer}
    constants |= {o for n in graph.node if n.op_type == "Constant" and n.domain in ("", "ai.onnx") for o in n.output}
    inputs, outputs = {i.name for i in graph.input}, {o.name for o in graph.output}
    readers: dict[str, list[int]] = {}  # name -> the nodes reading it (a subgraph's reads: its node's)
    for index, node in enumerate(graph.node):
        if node.domain in ("", "ai.onnx") and node.op_type in SHAPE_READERS:
            continue
        for name in set(node.input) | set().union(*(_names_read_inside(g) for g in _subgraphs(node))):
            readers.setdefault(name, []).append(index)
    hazards = []
    for index, node in enumerate(graph.node):
        label = _label(node, index)
        hazards += [f"{label} has a write in its subgraph" for g in _subgraphs(node) if _writes_inside(g)]
        if not _is_write(node):
            continue
        names = WRITES[(node.domain, node.op_type)]
        for what in POOL_NAMES:
            position = names.index(what)
            if position >= len(node.input) or not node.input[position]:  # an absent optional pool (LATENT's value)
                continue
            name = node.input[position]
            pool = f"{label}: {what} {name!r}"
            others = [_label(graph.node[i], i) for i in readers.get(name, []) if i != index]
            if name in constants:
                hazards.append(f"{pool} is an initializer (a constant of the model)")
            elif name not in inputs:
                hazards.append(f"{pool} is not a graph input (a node makes it)")
            elif name in outputs:
                hazards.append(f"{pool} is also a graph output")
            elif others or list(node.input).count(name) > 1:
                hazards.append(f"{pool} is also read by {', '.join(others) or 'this node as its other pool'}")
    for function in model.functions:
        if any(_is_write(n) or any(_writes_inside(g) for g in _subgraphs(n)) for n in function.node):
            hazards.append(f"function {function.domain}::{function.name} has a write")
    return hazards


# --------------------------------------------------------------------------------------------- #
# What a node writes in place whatever the route, and what make_session refuses of it
# --------------------------------------------------------------------------------------------- #
def _is_fused(node: onnx.NodeProto) -> bool:
    return (node.domain, node.op_type) == (MS_DOMAIN, ORT_ATTENTION.op_type)


def _pools(node: onnx.NodeProto) -> list[tuple[str, str]]:
    """(pool name in the op's schema, the node's input name) of each pool the node has."""
    names = WRITES[(node.domain, node.op_type)]
    found = []
    for what in POOL_NAMES:
        position = names.index(what)
        if position < len(node.input) and node.input[position]:
            found.append((what, node.input[position]))
    return found


def writes_inputs_in_place(node: onnx.NodeProto) -> bool:
    """A com.microsoft::PagedAttention node without cache outputs: ORT's contract updates its cache inputs
    in place (whatever the route)."""
    return _is_fused(node) and not any(node.output[1:3])


def node_refusals(model: onnx.ModelProto) -> list[str]:
    """What ``make_session`` refuses in ``model``, one line each naming the node: an attribute the
    com.microsoft::PagedAttention schema does not declare (ORT's schema check refuses those for its
    contrib ops; a custom-op kernel is shown no list of its node's attributes), and a node writing its
    pools in place (no cache outputs) whose pool is an initializer (the model's constant would change
    under every later run)."""
    graph = model.graph
    initializers = {t.name for t in graph.initializer} | {t.values.name for t in graph.sparse_initializer}
    refusals = []
    for index, node in enumerate(graph.node):
        if not _is_fused(node):
            continue
        label = _label(node, index)
        unknown = [a.name for a in node.attribute if a.name not in ORT_ATTENTION.attribute_defaults]
        refusals += [f"{label}: unknown attribute {name!r} (PagedAttention has no such attribute)" for name in unknown]
        if writes_inputs_in_place(node):
            refusals += [
                f"{label}: {what} {name!r} is an initializer (a constant of the model), and the node has no cache "
                f"outputs (ORT's contract: then its caches are updated in place): feed the pool as a graph input, "
                f"or give the node its cache outputs"
                for what, name in _pools(node)
                if name in initializers
            ]
    return refusals


def in_place_pools(model: onnx.ModelProto, alias: bool) -> dict[str, str]:
    """The graph inputs a session of ``model`` writes in place (``alias``: registered with the alias
    route, which writes every pool of every write) -> the node and pool that writes each."""
    graph = model.graph
    inputs = {i.name for i in graph.input}
    pools = {}
    for index, node in enumerate(graph.node):
        if not _is_write(node) or not (alias or writes_inputs_in_place(node)):
            continue
        for what, name in _pools(node):
            if name in inputs:
                pools.setdefault(name, f"{_label(node, index)}: {what}")
    return pools
