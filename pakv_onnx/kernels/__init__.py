"""Compute backends for GatherPaKvCache and the registry that picks one.

Every backend takes the same validated :class:`~pakv_onnx.spec.GatherPlan` and writes the
same bytes into caller-allocated outputs. A new backend is one module here that defines a
module-level ``BACKEND`` (a :class:`Backend`) plus one line in :data:`BACKEND_MODULES`.
Modules are imported lazily, so optional dependencies (pypto, torch_npu) are only touched
when that backend is asked for.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

import torch

from pakv_onnx.spec import GatherPlan

GatherFn = Callable[[GatherPlan, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class BackendUnavailableError(RuntimeError):
    """A backend cannot run here (missing package or device) or cannot run this plan."""


@dataclasses.dataclass(frozen=True)
class Backend:
    """One way to compute the gather.

    Attributes:
        name: registry key (``backend=`` argument).
        description: one line for ``--help`` and error messages.
        gather: ``gather(plan, key_cache, value_cache, key_out, value_out)``, writes outputs in place.
        unavailable_reason: returns ``None`` when the backend can run in this process,
            otherwise why not (e.g. "pypto is not installed").
        unsupported_reason: returns ``None`` when the backend handles this plan and these
            tensors, otherwise which option it cannot do.
    """

    name: str
    description: str
    gather: GatherFn
    unavailable_reason: Callable[[], str | None] = lambda: None
    unsupported_reason: Callable[[GatherPlan, torch.Tensor], str | None] = lambda plan, cache: None


# name -> module defining BACKEND. Order is the "auto" preference (fastest first).
BACKEND_MODULES: dict[str, str] = {
    "pypto": "pakv_onnx.kernels.pypto_nd",
    "native": "pakv_onnx.kernels.native",
    "torch": "pakv_onnx.kernels.torch_cpu",
    "golden": "pakv_onnx.kernels.golden",
    "pypto-cpu": "pakv_onnx.kernels.pypto_cpu",
}
AUTO_PREFERENCE: tuple[str, ...] = ("pypto", "native", "torch")
AUTO = "auto"


def backend_names() -> tuple[str, ...]:
    """Every registered backend name (available here or not)."""
    return tuple(BACKEND_MODULES)


def get_backend(name: str) -> Backend:
    """The registered backend called ``name``; ``ValueError`` naming the choices otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be a string, got {type(name).__name__}")
    try:
        module_name = BACKEND_MODULES[name]
    except KeyError:
        choices = ", ".join((AUTO, *BACKEND_MODULES))
        raise ValueError(f"backend {name!r} is unknown (choices: {choices})") from None
    return importlib.import_module(module_name).BACKEND


def resolve_backend(name: str, plan: GatherPlan, cache: torch.Tensor) -> Backend:
    """Pick the backend for one call; ``"auto"`` takes the first that can run this plan.

    Raises:
        ValueError: unknown name.
        BackendUnavailableError: the named backend cannot run here or cannot run this plan;
            the message says why and which backends can.
    """
    if name == AUTO:
        reasons = []
        for candidate in AUTO_PREFERENCE:
            if candidate not in BACKEND_MODULES:
                continue
            backend = get_backend(candidate)
            reason = backend.unavailable_reason() or backend.unsupported_reason(plan, cache)
            if reason is None:
                return backend
            reasons.append(f"{candidate}: {reason}")
        raise BackendUnavailableError("no backend can run this call: " + "; ".join(reasons))
    backend = get_backend(name)
    reason = backend.unavailable_reason() or backend.unsupported_reason(plan, cache)
    if reason is not None:
        able = [
            other
            for other in BACKEND_MODULES
            if other != name
            and get_backend(other).unavailable_reason() is None
            and get_backend(other).unsupported_reason(plan, cache) is None
        ]
        hint = f"; backends that can: {', '.join(able)}" if able else ""
        raise BackendUnavailableError(f"backend {name!r} cannot run this call: {reason}{hint}")
    return backend
