"""Export models that call GatherPaKvCache (ScatterPaKvCache, PagedAttention) to ONNX.

* :data:`gather_pa_kv_cache` — ``torch.ops.pakv.gather_pa_kv_cache``, the torch custom op;
  :data:`scatter_pa_kv_cache` (in place) and :data:`scatter_pa_kv_cache_functional` (what an
  exported graph records) for the write op; :data:`paged_attention` (``torch.ops.pakv.paged_attention``)
  for the attention op; :data:`ort_paged_attention` (in place) and :data:`ort_paged_attention_functional`
  (what an exported graph records) for ONNX Runtime's ``com.microsoft::PagedAttention``
  (:mod:`pakv_onnx.export.ort_attention`).
* :func:`export` — ``torch.onnx.export(..., dynamo=True)`` with the op's translation, the
  ONNX schema registered and the stock-ONNX fallback function attached.
* :func:`export_legacy` — the TorchScript exporter (``dynamo=False``) path.
* :func:`gather_node` / :func:`make_gather_model` / :func:`make_gather_model_for`,
  :func:`scatter_node` / :func:`make_scatter_model_for`, :func:`attention_node` /
  :func:`make_attention_model_for`, :func:`ort_attention_node` / :func:`make_ort_attention_model_for`
  — hand-built graphs without the
  exporter; :data:`PAKV_OPSET` for onnxscript functions.
* :func:`register_schema`, :func:`attach_fallback`, :func:`op_dynamic_shapes`.

Importing this package registers the torch op and the ONNX schema (both idempotent). The
names that need onnxscript (the exporters, the fallback, the translations) are imported on
first use, so the torch op and hand-built graphs work where onnxscript is absent.
"""

from __future__ import annotations

import importlib

from pakv_onnx.export.builder import (
    DEFAULT_OPSET,
    attention_node,
    gather_node,
    make_attention_model_for,
    make_gather_model,
    make_gather_model_for,
    make_scatter_model_for,
    scatter_node,
)
from pakv_onnx.export.ir import cap_ir_version
from pakv_onnx.export.ort_attention import (
    make_ort_attention_model_for,
    ort_attention_node,
    ort_paged_attention,
    ort_paged_attention_functional,
    register_ort_attention_schema,
)
from pakv_onnx.export.schema import register_schema
from pakv_onnx.export.torch_op import (
    gather_pa_kv_cache,
    paged_attention,
    scatter_pa_kv_cache,
    scatter_pa_kv_cache_functional,
)

register_schema()

# name -> submodule that defines it (each of these submodules imports onnxscript).
_ONNXSCRIPT_NAMES = {
    "export": "exporter",
    "export_legacy": "exporter",
    "op_dynamic_shapes": "exporter",
    "attach_fallback": "fallback",
    "has_fallback": "fallback",
    "make_function": "fallback",
    "PAKV_OPSET": "translation",
    "register_legacy_symbolic": "translation",
    "translation_table": "translation",
}


def __getattr__(name: str) -> object:
    """The onnxscript-dependent names, imported on first use (PEP 562)."""
    module = _ONNXSCRIPT_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_ONNXSCRIPT_NAMES})


__all__ = [
    "DEFAULT_OPSET",
    "PAKV_OPSET",
    "attach_fallback",
    "attention_node",
    "cap_ir_version",
    "export",
    "export_legacy",
    "gather_node",
    "gather_pa_kv_cache",
    "has_fallback",
    "make_function",
    "make_gather_model",
    "make_attention_model_for",
    "make_gather_model_for",
    "make_ort_attention_model_for",
    "make_scatter_model_for",
    "op_dynamic_shapes",
    "ort_attention_node",
    "ort_paged_attention",
    "ort_paged_attention_functional",
    "register_ort_attention_schema",
    "paged_attention",
    "register_legacy_symbolic",
    "register_schema",
    "scatter_node",
    "scatter_pa_kv_cache",
    "scatter_pa_kv_cache_functional",
    "translation_table",
]
