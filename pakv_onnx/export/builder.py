"""Hand-built graphs: add ``pakv::GatherPaKvCache`` to an ONNX graph without PyTorch.

* :func:`gather_node` — one ``NodeProto`` (for ``onnx.helper`` graphs).
* :func:`make_gather_model` — a whole model whose inputs are the op's inputs.
* onnxscript users call ``PAKV_OPSET.GatherPaKvCache(...)`` (``_outputs=2``) inside
  ``@onnxscript.script()`` functions; the schema is registered on import.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx
import torch
from onnx import helper as h

from pakv_onnx.export.exporter import DEFAULT_OPSET
from pakv_onnx.export.fallback import attach_fallback
from pakv_onnx.export.schema import register_schema
from pakv_onnx.export.translation import PAKV_OPSET
from pakv_onnx.spec import (
    ATTR_CACHE_MODE,
    ATTR_IS_SEQ_LENS_CUMSUM,
    DEFAULT_CACHE_MODE,
    DEFAULT_IS_SEQ_LENS_CUMSUM,
    DOMAIN,
    INPUT_NAMES,
    OP_TYPE,
    OPSET_VERSION,
    OPTIONAL_INPUTS,
    OUTPUT_NAMES,
    CacheMode,
    cache_dtype,
    index_dtype,
)

__all__ = ["PAKV_OPSET", "gather_node", "make_gather_model"]


def gather_node(
    key_cache: str,
    value_cache: str,
    block_tables: str,
    seq_lens: str,
    seq_offset: str | None = None,
    *,
    outputs: Sequence[str] = OUTPUT_NAMES,
    cache_mode: str | CacheMode = DEFAULT_CACHE_MODE,
    is_seq_lens_cumsum: bool = DEFAULT_IS_SEQ_LENS_CUMSUM,
    name: str | None = None,
) -> onnx.NodeProto:
    """A ``pakv::GatherPaKvCache`` node reading the named values (``seq_offset`` optional)."""
    mode = CacheMode(cache_mode)
    if len(outputs) != len(OUTPUT_NAMES):
        raise ValueError(f"outputs must name {len(OUTPUT_NAMES)} values {OUTPUT_NAMES}, got {list(outputs)}")
    inputs = [key_cache, value_cache, block_tables, seq_lens]
    if seq_offset:
        inputs.append(seq_offset)
    return h.make_node(
        OP_TYPE,
        inputs,
        list(outputs),
        name=name,
        domain=DOMAIN,
        **{ATTR_CACHE_MODE: mode.value, ATTR_IS_SEQ_LENS_CUMSUM: int(bool(is_seq_lens_cumsum))},
    )


def make_gather_model(
    dtype: torch.dtype,
    *,
    value_dtype: torch.dtype | None = None,
    cache_mode: str | CacheMode = DEFAULT_CACHE_MODE,
    is_seq_lens_cumsum: bool = DEFAULT_IS_SEQ_LENS_CUMSUM,
    with_seq_offset: bool = True,
    index_dtypes: tuple[torch.dtype, torch.dtype, torch.dtype] = (torch.int32, torch.int32, torch.int32),
    fallback: bool = True,
    opset_version: int = DEFAULT_OPSET,
) -> onnx.ModelProto:
    """A model with one GatherPaKvCache node; every input dim symbolic, outputs typed.

    Inputs are named as in the contract (``key_cache`` ...), outputs ``key`` and ``value``.
    ``dtype`` is key_cache's element type, ``value_dtype`` value_cache's (default: ``dtype``).
    """
    register_schema()
    mode = CacheMode(cache_mode)
    key_elem = cache_dtype(dtype).onnx_type
    value_elem = cache_dtype(value_dtype if value_dtype is not None else dtype).onnx_type
    index_names = INPUT_NAMES[2:]  # block_tables, seq_lens, seq_offset
    index_types = {name: index_dtype(d).onnx_type for name, d in zip(index_names, index_dtypes)}
    if mode is CacheMode.NORM:
        key_shape, value_shape = ["num_blocks", "block_size", "Hk", "Dk"], ["num_blocks", "block_size", "Hv", "Dv"]
    else:
        key_shape, value_shape = ["num_blocks", "Fk", "block_size", "E"], ["num_blocks", "Fv", "block_size", "E"]
    seq_lens_dim = "num_seqs_plus_1" if is_seq_lens_cumsum else "num_seqs"
    key_cache, value_cache, block_tables, seq_lens, seq_offset = INPUT_NAMES
    shapes = {
        key_cache: (key_elem, key_shape),
        value_cache: (value_elem, value_shape),
        block_tables: (index_types[block_tables], ["num_seqs", "table_cols"]),
        seq_lens: (index_types[seq_lens], [seq_lens_dim]),
        seq_offset: (index_types[seq_offset], ["num_seqs"]),
    }
    names = [n for n in INPUT_NAMES if with_seq_offset or n not in OPTIONAL_INPUTS]
    inputs = [h.make_tensor_value_info(n, *shapes[n]) for n in names]
    node = gather_node(*names, cache_mode=mode, is_seq_lens_cumsum=is_seq_lens_cumsum, name="gather")
    graph = h.make_graph([node], "gather_pa_kv_cache", inputs, [])
    model = h.make_model(
        graph, opset_imports=[h.make_opsetid("", opset_version), h.make_opsetid(DOMAIN, OPSET_VERSION)]
    )
    # Output types from the schema's inference (T becomes a per-node symbol).
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    by_name = {v.name: v for v in inferred.graph.value_info}
    model.graph.output.extend(by_name[o] for o in OUTPUT_NAMES)
    if fallback:
        attach_fallback(model)
    return model
