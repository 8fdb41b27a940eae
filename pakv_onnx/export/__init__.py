"""Export models that call GatherPaKvCache to ONNX.

* :data:`gather_pa_kv_cache` — ``torch.ops.pakv.gather_pa_kv_cache``, the torch custom op.
* :func:`export` — ``torch.onnx.export(..., dynamo=True)`` with the op's translation, the
  ONNX schema registered and the stock-ONNX fallback function attached.
* :func:`export_legacy` — the TorchScript exporter (``dynamo=False``) path.
* :func:`gather_node` / :func:`make_gather_model` — hand-built graphs without PyTorch.
* :func:`register_schema`, :func:`attach_fallback`, :func:`op_dynamic_shapes`.

Importing this package registers the torch op and the ONNX schema (both idempotent).
"""

from __future__ import annotations

from pakv_onnx.export.builder import gather_node, make_gather_model
from pakv_onnx.export.exporter import DEFAULT_OPSET, export, export_legacy, op_dynamic_shapes
from pakv_onnx.export.fallback import attach_fallback, has_fallback, make_function
from pakv_onnx.export.schema import register_schema
from pakv_onnx.export.torch_op import gather_pa_kv_cache
from pakv_onnx.export.translation import register_legacy_symbolic, translation_table

register_schema()

__all__ = [
    "DEFAULT_OPSET",
    "attach_fallback",
    "export",
    "export_legacy",
    "gather_node",
    "gather_pa_kv_cache",
    "has_fallback",
    "make_function",
    "make_gather_model",
    "op_dynamic_shapes",
    "register_legacy_symbolic",
    "register_schema",
    "translation_table",
]
