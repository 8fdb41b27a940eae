"""What the stock-ONNX fallback functions share (:mod:`~pakv_onnx.export.fallback` for
``GatherPaKvCache``, :mod:`~pakv_onnx.export.fallback_scatter`, :mod:`~pakv_onnx.export.fallback_attention`):
an onnxscript body turned into the op's ``FunctionProto`` once (signature checked against the
contract, check nodes named after their rules, outputs named as the contract names them) and that
function declared against a model's opsets. Each body's module imports this one; none imports another.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import onnx
from onnx import helper as h

from pakv_onnx.spec import DOMAIN, OPSET_VERSION

# A check node's name: ORT's error names the failing node, so the message says which rule broke.
CHECK_PREFIX = "pakv check: "


def _base_name(value_name: str) -> str:
    """onnxscript renames values assigned in If branches (``key_rows_read_12``): the Python name."""
    return re.sub(r"_\d+$", "", value_name)


def name_checks(graph_nodes, checks: Mapping[str, str]) -> None:
    """Name every check node after its rule (recursively into If branches): a node is a check
    when its first output is a key of ``checks`` (value name -> rule text)."""
    for node in graph_nodes:
        output = node.output[0] if node.output else ""
        rule = checks.get(output) or checks.get(_base_name(output))
        if rule is not None:
            node.name = CHECK_PREFIX + rule
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                name_checks(attr.g.node, checks)


def function_template(
    body,
    *,
    op_type: str,
    inputs: Sequence[str],
    outputs: Sequence[str],
    defaults: Mapping[str, object],
    checks: Mapping[str, str],
    module: str,
) -> bytes:
    """The serialized ``FunctionProto`` of the onnxscript ``body``: ``pakv::<op_type>``.

    Its domain, name, inputs and attribute defaults must be the contract's (``inputs``, ``defaults``:
    else ``AssertionError``); check nodes are named after ``checks``; outputs are renamed to
    ``outputs`` (onnxscript numbers If outputs); the doc string names ``module``.
    """
    function = body.to_function_proto()
    found = {a.name: onnx.helper.get_attribute_value(a) for a in function.attribute_proto}
    if (function.domain, function.name, list(function.input)) != (DOMAIN, op_type, list(inputs)):
        raise AssertionError(f"fallback signature {function.domain}::{function.name}{list(function.input)} is not the contract's")
    if found != dict(defaults):
        raise AssertionError(f"fallback attribute defaults {found} are not the contract's {dict(defaults)}")
    name_checks(function.node, checks)
    renames = dict(zip(function.output, outputs))
    for node in function.node:
        node.output[:] = [renames.get(o, o) for o in node.output]
    function.output[:] = list(outputs)
    function.doc_string = f"Stock-ONNX fallback body of {DOMAIN}::{function.name} (see {module})."
    return function.SerializeToString()


def function_for(template: bytes, opset_version: int, *, calls_pakv: bool = False) -> onnx.FunctionProto:
    """The function of ``template`` declared against default-domain ``opset_version`` (ORT wants a
    function's opsets to match the model's), and the ``pakv`` opset when its body calls a pakv op."""
    function = onnx.FunctionProto()
    function.ParseFromString(template)
    del function.opset_import[:]
    function.opset_import.append(h.make_opsetid("", opset_version))
    if calls_pakv:
        function.opset_import.append(h.make_opsetid(DOMAIN, OPSET_VERSION))
    return function
