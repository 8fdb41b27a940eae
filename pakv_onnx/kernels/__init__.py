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
import sys
from collections.abc import Callable

import torch

from pakv_onnx.spec import GatherPlan, GatherTensors

# gather(plan, tensors): reads tensors.key_cache / value_cache, writes tensors.key_out / value_out.
GatherFn = Callable[[GatherPlan, GatherTensors], None]


def _handles_every_call(plan: GatherPlan, cache: torch.Tensor) -> str | None:
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
        gather: ``gather(plan, tensors)`` (a :class:`~pakv_onnx.spec.GatherTensors`), writes the outputs in place.
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
        gather_raw: optional fast path for a call with caller outputs, before any plan:
            ``gather_raw(key_cache, value_cache, block_tables, seq_lens, seq_offset, mode,
            is_cumsum, key_out, value_out) -> bool``. It must run every check of the contract
            (or decline) before writing; ``False`` means declined, nothing written, and the caller
            takes the full path (spec's checks, which word any error).
        support_by_layout: for contiguous caches, its ``unsupported_reason`` depends only on the
            caches' device, dtypes and the cache mode (never on sizes or index values), so ``auto``
            may cache its verdict per such key (a backend with the default ``unsupported_reason`` is
            treated so too).
    """

    name: str
    description: str
    gather: GatherFn
    unavailable_reason: Callable[[], str | None] = lambda: None
    unsupported_reason: Callable[[GatherPlan, torch.Tensor], str | None] = _handles_every_call
    reads_pool_views: bool = False
    mixed_dtypes: bool = False
    support_by_layout: bool = False
    gather_raw: Callable[..., bool] | None = None

    @property
    def verdict_is_cacheable(self) -> bool:
        """Whether :meth:`refusal` depends only on the key of :func:`resolve_backend`'s cache."""
        return self.support_by_layout or self.unsupported_reason is _handles_every_call

    def refusal(self, plan: GatherPlan, caches: tuple[torch.Tensor, ...]) -> str | None:
        """Why this backend cannot run this call here (``None``: it can)."""
        reason = self.unavailable_reason() or self.unsupported_reason(plan, caches[0])
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
    name: str, plan: GatherPlan, cache: torch.Tensor, value_cache: torch.Tensor | None = None
) -> Backend:
    """Pick the backend for one call; ``"auto"`` takes the first of :data:`AUTO_PREFERENCE` that can run it.

    Args:
        name: a registered name or ``"auto"``.
        plan: the validated call.
        cache, value_cache: the key and value caches (``value_cache`` defaults to ``cache``).

    Raises:
        ValueError: unknown name.
        BackendUnavailableError: the named backend cannot run here or cannot run this plan;
            the message says why and which backends can.
    """
    caches = (cache, cache if value_cache is None else value_cache)
    # Pool views are resolved every time (whether a backend can read one depends on its strides).
    dense = caches[0].is_contiguous() and caches[1].is_contiguous()
    key = _cache_key(name, caches[0].device, plan.key_dtype, plan.value_dtype, plan.cache_mode) if dense else None
    hit = _cached(key)
    if hit is not None:
        return hit
    if name == AUTO:
        backend, cacheable = _resolve_auto(plan, caches)
    else:
        backend = get_backend(name)
        reason = backend.refusal(plan, caches)
        if reason is not None:  # a refusal is worked out (and worded) each time, never cached
            able = [
                other for other in BACKEND_MODULES if other != name and get_backend(other).refusal(plan, caches) is None
            ]
            hint = f"; backends that can: {', '.join(able)}" if able else ""
            raise BackendUnavailableError(f"backend {name!r} cannot run this call: {reason}{hint}")
        cacheable = backend.verdict_is_cacheable and backend.unavailable_reason() is None
    if cacheable and key is not None:
        _auto_cache[key] = (AUTO_PREFERENCE, dict(BACKEND_MODULES), backend)
    return backend


# "auto"'s pick per (device, key dtype, value dtype, cache mode) for contiguous caches, kept with
# the AUTO_PREFERENCE and BACKEND_MODULES it was made under (a change to either is a miss). Only
# picks that depend on nothing else are kept: every backend tried before the winner was refused
# for being unavailable in this process or by a layout-only verdict, and the winner's own
# verdict is layout-only (see Backend.verdict_is_cacheable).
_auto_cache: dict[tuple, tuple[tuple[str, ...], dict[str, str], Backend]] = {}


def cached_backend(
    name: str, device: torch.device, key_dtype: torch.dtype, value_dtype: torch.dtype, mode: object
) -> Backend | None:
    """The backend :func:`resolve_backend` picked before for ``name`` and contiguous caches of this
    device, dtypes and cache mode, or ``None`` (not resolved yet, or not cacheable)."""
    return _cached(_cache_key(name, device, key_dtype, value_dtype, mode))


def _cache_key(
    name: object, device: torch.device, key_dtype: torch.dtype, value_dtype: torch.dtype, mode: object
) -> tuple | None:
    """The resolution cache's key for this call (``auto`` and each backend name apart); ``None`` for
    a name that is not a string (never cached: :func:`get_backend` words its error)."""
    if type(name) is not str:
        return None
    return (device, key_dtype, value_dtype, mode) if name == AUTO else (name, device, key_dtype, value_dtype, mode)


def _cached(key: tuple | None) -> Backend | None:
    """The cached pick for ``key`` if it was made under today's AUTO_PREFERENCE and BACKEND_MODULES."""
    hit = _auto_cache.get(key) if key is not None else None
    if hit is not None and hit[0] == AUTO_PREFERENCE and hit[1] == BACKEND_MODULES:
        return hit[2]
    return None


def clear_resolution_cache() -> None:
    """Forget every cached ``auto`` pick (after a backend's availability changed in this process)."""
    _auto_cache.clear()


def _resolve_auto(plan: GatherPlan, caches: tuple[torch.Tensor, torch.Tensor]) -> tuple[Backend, bool]:
    """The first backend of AUTO_PREFERENCE that can run the call, and whether the pick may be cached."""
    cacheable = True
    reasons = []
    for candidate in AUTO_PREFERENCE:
        if candidate not in BACKEND_MODULES:
            continue
        backend = get_backend(candidate)
        unavailable = backend.unavailable_reason()
        reason = unavailable or backend.refusal(plan, caches)
        if unavailable is None and not backend.verdict_is_cacheable:
            cacheable = False  # refused or picked for this plan's sizes/values: decide again next call
        if reason is None:
            return backend, cacheable
        reasons.append(f"{candidate}: {reason}")
    raise BackendUnavailableError("no backend can run this call: " + "; ".join(reasons))
