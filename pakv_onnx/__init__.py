"""pakv-onnx: the paged-KV-cache ops GatherPaKvCache, ScatterPaKvCache and PagedAttention through the whole
ONNX life cycle, and a CPU kernel of ONNX Runtime's own com.microsoft::PagedAttention (``ort_paged_attention``).

- :mod:`pakv_onnx.spec`      the contract, declared (names, tables, shapes)
- :mod:`pakv_onnx.plans`     what the validator returns (one plan per op) and the tensors a kernel takes
- :mod:`pakv_onnx.validator` the one validator (``plan_gather``: the C contract unit, from Python)
- :mod:`pakv_onnx.golden`   the torch reference
- :mod:`pakv_onnx.kernels`  compute backends and their registry
- :mod:`pakv_onnx.cases`    reproducible test cases (the seed sweep, random cases)

The public names below are imported on first use (PEP 562), so ``import pakv_onnx`` and the
CLI's start (``--version``, ``--help``, Ctrl-C during start-up) don't wait for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The one place the version is written (pyproject.toml reads it from here).
__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "BackendUnavailableError": "pakv_onnx.kernels",
    "backend_names": "pakv_onnx.kernels",
    "gather_pa_kv_cache": "pakv_onnx.ops",
    "ort_paged_attention": "pakv_onnx.ops",
    "paged_attention": "pakv_onnx.ops",
    "scatter_pa_kv_cache": "pakv_onnx.ops",
    "AttentionPlan": "pakv_onnx.plans",
    "AttentionTensors": "pakv_onnx.plans",
    "CacheMode": "pakv_onnx.spec",
    "GatherPlan": "pakv_onnx.plans",
    "GatherTensors": "pakv_onnx.plans",
    "OrtAttentionPlan": "pakv_onnx.plans",
    "OrtAttentionTensors": "pakv_onnx.plans",
    "ScatterPlan": "pakv_onnx.plans",
    "ScatterTensors": "pakv_onnx.plans",
    "plan_attention": "pakv_onnx.validator",
    "plan_gather": "pakv_onnx.validator",
    "plan_ort_attention": "pakv_onnx.validator",
    "plan_scatter": "pakv_onnx.validator",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from pakv_onnx.kernels import BackendUnavailableError, backend_names
    from pakv_onnx.ops import gather_pa_kv_cache, ort_paged_attention, paged_attention, scatter_pa_kv_cache
    from pakv_onnx.plans import (
        AttentionPlan,
        AttentionTensors,
        GatherPlan,
        GatherTensors,
        OrtAttentionPlan,
        OrtAttentionTensors,
        ScatterPlan,
        ScatterTensors,
    )
    from pakv_onnx.spec import CacheMode
    from pakv_onnx.validator import plan_attention, plan_gather, plan_ort_attention, plan_scatter


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    try:  # ``pakv_onnx.spec`` etc. after a bare ``import pakv_onnx``
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
