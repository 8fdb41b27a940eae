"""The ``pypto-cpu`` backend: the PyPTO kernel on a CPU through PyPTO's SIM compile + interpreter.

Slow by design (about a second or more per call: pypto's SIM mode recompiles every call);
not part of ``auto``. Implementation: :mod:`pakv_onnx.pypto.cpu`.
"""

from __future__ import annotations

from pakv_onnx.kernels import Backend
from pakv_onnx.plans import GatherPlan, GatherTensors, ScatterPlan, ScatterTensors


def _unavailable_reason() -> str | None:
    from pakv_onnx.pypto import adapter

    return adapter.unavailable_reason()


def _gather(plan: GatherPlan, tensors: GatherTensors) -> None:
    from pakv_onnx.pypto import cpu

    cpu.gather_pypto_cpu(plan, tensors)


def _scatter(plan: ScatterPlan, tensors: ScatterTensors) -> None:
    from pakv_onnx.pypto import cpu

    cpu.scatter_pypto_cpu(plan, tensors)


def _unsupported_reason(plan, cache) -> str | None:
    if type(plan) is ScatterPlan:
        from pakv_onnx.pypto import scatter_host

        return scatter_host.unsupported_reason(scatter_host.from_validated(plan))
    from pakv_onnx.pypto import cpu

    return cpu.unsupported_reason(plan, cache)


BACKEND = Backend(
    name="pypto-cpu",
    description="the PyPTO kernel on a CPU via PyPTO's SIM compile + pass-verify interpreter (slow: ~1 s or more per call)",
    gather=_gather,
    unavailable_reason=_unavailable_reason,
    unsupported_reason=_unsupported_reason,
    mixed_dtypes=True,
    scatter=_scatter,
)
