"""pakv-onnx: the GatherPaKvCache paged-KV-cache gather through the whole ONNX life cycle.

- :mod:`pakv_onnx.spec`     the contract and its validation (``plan_gather``)
- :mod:`pakv_onnx.golden`   the torch reference
- :mod:`pakv_onnx.kernels`  compute backends and their registry
- :mod:`pakv_onnx.cases`    reproducible test cases (the seed sweep, random cases)
"""

from pakv_onnx.kernels import BackendUnavailableError, backend_names
from pakv_onnx.ops import gather_pa_kv_cache
from pakv_onnx.spec import CacheMode, GatherPlan, plan_gather

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "CacheMode",
    "GatherPlan",
    "backend_names",
    "gather_pa_kv_cache",
    "plan_gather",
]
