"""One-node ONNX models of ``pakv::GatherPaKvCache`` (the contract's names), for tests, benchmarks
and hosts that want the op without an exporter."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pakv_onnx.runtime_plugin._tensors import onnx_type_of
from pakv_onnx.spec import (
    ATTR_CACHE_MODE,
    ATTR_IS_SEQ_LENS_CUMSUM,
    DOMAIN,
    INPUT_NAMES,
    OP_TYPE,
    OPSET_VERSION,
    OUTPUT_NAMES,
    CacheMode,
)


def one_node_model(
    input_dtypes: Sequence[torch.dtype | None],
    *,
    cache_mode: str | CacheMode = CacheMode.NORM,
    is_seq_lens_cumsum: bool | int = True,
    num_nodes: int = 1,
    opset: int = 17,
):
    """A model with ``num_nodes`` independent GatherPaKvCache nodes.

    Args:
        input_dtypes: torch dtypes of (key_cache, value_cache, block_tables, seq_lens, seq_offset);
            ``None`` for seq_offset leaves the optional input out.
        cache_mode, is_seq_lens_cumsum: the node attributes (written as given, so invalid values
            can be tested).
        num_nodes: with more than one, node ``i`` reads inputs ``<name>_<i>`` and writes
            ``key_<i>`` / ``value_<i>`` (independent branches, for ORT_PARALLEL).
    """
    from onnx import helper

    mode = cache_mode.value if isinstance(cache_mode, CacheMode) else cache_mode
    output_types = (onnx_type_of(input_dtypes[0]), onnx_type_of(input_dtypes[1]))  # each output: its cache's
    inputs, outputs, nodes = [], [], []
    for i in range(num_nodes):
        suffix = "" if num_nodes == 1 else f"_{i}"
        names = []
        for name, dtype in zip(INPUT_NAMES, input_dtypes):
            if dtype is None:
                names.append("")
                continue
            names.append(name + suffix)
            inputs.append(helper.make_tensor_value_info(name + suffix, onnx_type_of(dtype), None))
        while names and names[-1] == "":
            names.pop()
        outs = [name + suffix for name in OUTPUT_NAMES]
        outputs += [helper.make_tensor_value_info(name, t, None) for name, t in zip(outs, output_types)]
        nodes.append(
            helper.make_node(
                OP_TYPE,
                names,
                outs,
                domain=DOMAIN,
                name=f"gather{suffix}",
                **{ATTR_CACHE_MODE: mode, ATTR_IS_SEQ_LENS_CUMSUM: int(is_seq_lens_cumsum)},
            )
        )
    graph = helper.make_graph(nodes, "gather_pa_kv_cache", inputs, outputs)
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, OPSET_VERSION)]
    )


def model_for_case(case, num_nodes: int = 1):
    """:func:`one_node_model` for a :class:`~pakv_onnx.cases.GatherCase` (its dtypes and attributes)."""
    dtypes = [None if t is None else t.dtype for t in case.inputs()]
    return one_node_model(
        dtypes, cache_mode=case.cache_mode, is_seq_lens_cumsum=case.is_seq_lens_cumsum, num_nodes=num_nodes
    )


def feeds_for_case(case, suffix: str = "") -> dict[str, torch.Tensor]:
    """The case's inputs keyed by the model's input names (absent optional inputs left out)."""
    return {name + suffix: t for name, t in zip(INPUT_NAMES, case.inputs()) if t is not None}
