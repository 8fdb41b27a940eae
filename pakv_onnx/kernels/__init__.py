"""Compute backends for GatherPaKvCache (ScatterPaKvCache, PagedAttention) and the registry that picks one.

Every backend takes the same validated :class:`~pakv_onnx.plans.GatherPlan` and writes the
same bytes into caller-allocated outputs. A new backend is one module here that defines a
module-level ``BACKEND`` (a :class:`Backend`) plus one line in :data:`BACKEND_MODULES`.
Modules are imported lazily, so optional dependencies (pypto, torch_npu) are only touched
when that backend is asked for.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the registry imports without torch (the CLI's --help lists it)
    import torch

    from pakv_onnx import plans

    # gather(plan, tensors): reads tensors.key_cache / value_cache, writes tensors.key_out / value_out.
    GatherFn = Callable[[plans.GatherPlan, plans.GatherTensors], None]
    # scatter(plan, tensors): reads tensors.key / value, writes their rows into tensors.key_cache / value_cache.
    ScatterFn = Callable[[plans.ScatterPlan, plans.ScatterTensors], None]
    # attention(plan, tensors): reads tensors.query and the caches, writes tensors.out.
    AttentionFn = Callable[[plans.AttentionPlan, plans.AttentionTensors], None]
    # ort_attention(plan, tensors): writes the new rows into tensors.key_cache / value_cache, then tensors.out.
    OrtAttentionFn = Callable[[plans.OrtAttentionPlan, plans.OrtAttentionTensors], None]


def _handles_every_call(plan: plans.GatherPlan, cache: torch.Tensor) -> str | None:
    """The default ``unsupported_reason``: the backend takes every valid call."""
    return None


class BackendUnavailableError(RuntimeError):
    """A backend cannot run here (missing package or device) or cannot run this plan."""


@dataclasses.dataclass(frozen=True)
class Backend:
    """One way to compute the gather.

    Attributes:
        name: registry key (``backend=`` argument).
        description: one line for ``--help`` and error messages.
        gather: ``gather(plan, tensors)`` (a :class:`~pakv_onnx.plans.GatherTensors`), writes the outputs in place.
        unavailable_reason: returns ``None`` when the backend can run in this process,
            otherwise why not (e.g. "pypto is not installed").
        unsupported_reason: returns ``None`` when the backend handles this plan and these
            tensors, otherwise which option it cannot do.
        reads_pool_views: the backend reads caches strided on dim 0 (views of a larger pool,
            see :mod:`pakv_onnx.spec`) in place; a backend without it is refused such caches
            by name (so ``auto`` skips it) instead of being handed a copy of the pool.
        mixed_dtypes: the backend takes each cache's element size from its own dtype
            (``plan.key_dtype`` / ``plan.value_dtype``); a backend without it is refused key and
            value caches of different dtypes by name.
        scatter: ``scatter(plan, tensors)`` (a :class:`~pakv_onnx.plans.ScatterTensors`) for
            ScatterPaKvCache, writing the caches in place; ``None``: the backend has no write op
            (refused by name for a :class:`~pakv_onnx.plans.ScatterPlan`). Its
            ``unsupported_reason`` is asked about every plan kind.
        attention: ``attention(plan, tensors)`` (a :class:`~pakv_onnx.plans.AttentionTensors`) for
            PagedAttention, writing ``tensors.out``; ``None``: the backend has none (refused by
            name for an :class:`~pakv_onnx.plans.AttentionPlan`).
        ort_attention: ``ort_attention(plan, tensors)`` (a :class:`~pakv_onnx.plans.OrtAttentionTensors`)
            for com.microsoft::PagedAttention, writing the caches in place and ``tensors.out``; ``None``:
            the backend has none (refused by name for an :class:`~pakv_onnx.plans.OrtAttentionPlan`).
    """

    name: str
    description: str
    gather: GatherFn
    unavailable_reason: Callable[[], str | None] = lambda: None
    unsupported_reason: Callable[[plans.GatherPlan, torch.Tensor], str | None] = _handles_every_call
    reads_pool_views: bool = False
    mixed_dtypes: bool = False
    scatter: ScatterFn | None = None
    attention: AttentionFn | None = None
    ort_attention: OrtAttentionFn | None = None

    def unavailable(self) -> str | None:
        """:attr:`unavailable_reason`, asked once per process (packages and devices don't come and go)."""
        known = _availability.get(id(self))
        if known is None:
            known = _availability[id(self)] = (self, self.unavailable_reason())
        return known[1]

    def refusal(
        self, plan: plans.GatherPlan | plans.ScatterPlan | plans.AttentionPlan | plans.OrtAttentionPlan, caches: tuple[torch.Tensor, ...]
    ) -> str | None:
        """Why this backend cannot run this call here (``None``: it can)."""
        plans = sys.modules["pakv_onnx.plans"]  # loaded: it made `plan`
        if self.scatter is None and type(plan) is plans.ScatterPlan:
            return "it has no ScatterPaKvCache kernel"
        if self.attention is None and type(plan) is plans.AttentionPlan:
            return "it has no PagedAttention kernel"
        if self.ort_attention is None and type(plan) is plans.OrtAttentionPlan:
            return "it has no com.microsoft::PagedAttention kernel"
        reason = self.unavailable() or self.unsupported_reason(plan, caches[0])
        if reason is None and not self.mixed_dtypes and plan.key_dtype != plan.value_dtype:
            return (
                f"it takes one element type for both caches, and key_cache is {plan.key_dtype} "
                f"while value_cache is {plan.value_dtype}"
            )
        if reason is None and not self.reads_pool_views:
            for name, cache in zip(("key_cache", "value_cache"), caches):
                if not cache.is_contiguous():
                    return (
                        f"it reads contiguous caches only, and {name} is a pool view (block stride "
                        f"{cache.stride(0)} elements for shape {tuple(cache.shape)})"
                    )
        return reason


# Backend name -> module defining BACKEND. The order here is only the listing order
# (backend_names(), --help, error hints); "auto" follows AUTO_PREFERENCE alone.
BACKEND_MODULES: dict[str, str] = {
    "pypto": "pakv_onnx.kernels.pypto_nd",
    "native": "pakv_onnx.kernels.native",
    "torch": "pakv_onnx.kernels.torch_index",
    "golden": "pakv_onnx.kernels.reference",
    "pypto-cpu": "pakv_onnx.kernels.pypto_cpu",
}
# The backends "auto" tries, in this order (fastest first); the first that is available and
# supports the call wins. golden is never picked by auto (it is the slow verifier).
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
    module = sys.modules.get(module_name)  # already imported: skip import_module's lock and lookup
    if module is None:
        module = importlib.import_module(module_name)
    return module.BACKEND


def resolve_backend(
    name: str,
    plan: plans.GatherPlan | plans.ScatterPlan | plans.AttentionPlan,
    cache: torch.Tensor,
    value_cache: torch.Tensor | None = None,
) -> Backend:
    """Pick the backend for one call; ``"auto"`` takes the first of :data:`AUTO_PREFERENCE` that can run it.

    Args:
        name: a registered name or ``"auto"``.
        plan: the validated call (a gather's, a scatter's or an attention's: a backend without a
            scatter or attention kernel is refused such a plan by name).
        cache, value_cache: the key and value caches (``value_cache`` defaults to ``cache``).

    Raises:
        ValueError: unknown name.
        BackendUnavailableError: the named backend cannot run here or cannot run this plan;
            the message says why and which backends can.
    """
    caches = (cache, cache if value_cache is None else value_cache)
    if name == AUTO:
        return _resolve_auto(plan, caches)
    backend = get_backend(name)
    reason = backend.refusal(plan, caches)
    if reason is not None:
        able = [other for other in BACKEND_MODULES if other != name and get_backend(other).refusal(plan, caches) is None]
        hint = f"; backends that can: {', '.join(able)}" if able else ""
        raise BackendUnavailableError(f"backend {name!r} cannot run this call: {reason}{hint}")
    return backend


# id(backend) -> (backend, its unavailable_reason()): see Backend.unavailable.
_availability: dict[int, tuple[Backend, str | None]] = {}


def clear_availability_cache() -> None:
    """Ask every backend again whether it can run in this process (after installing a package, say)."""
    _availability.clear()


def _resolve_auto(plan: plans.GatherPlan | plans.ScatterPlan | plans.AttentionPlan, caches: tuple[torch.Tensor, torch.Tensor]) -> Backend:
    """The first backend of AUTO_PREFERENCE that can run the call."""
    reasons = []
    for candidate in AUTO_PREFERENCE:
        if candidate not in BACKEND_MODULES:
            continue
        reason = get_backend(candidate).refusal(plan, caches)
        if reason is None:
            return get_backend(candidate)
        reasons.append(f"{candidate}: {reason}")
    raise BackendUnavailableError("no backend can run this call: " + "; ".join(reasons))
