"""The ONNX Runtime plugin for ``pakv::GatherPaKvCache``: a C custom-op library and its Python bridge.

The library (``libpakv_ort.so`` of :mod:`pakv_onnx.native_lib`, built by the package build)
stands alone: any ONNX Runtime host can load it with its custom-op-library option and gets the
native C kernel. From Python::

    from pakv_onnx import runtime_plugin
    session = runtime_plugin.make_session(model)                  # native C kernel
    session = runtime_plugin.make_session(model, backend="golden")  # torch reference via a callback
    outputs = runtime_plugin.run(session, {"key_cache": kc, ...})   # torch in, torch out, zero-copy

Backends are per session: ``native`` (C, default), any name of :mod:`pakv_onnx.kernels`
(``golden``, ``torch``, ``pypto`` ...), or ``auto``. Python backends are reached through a
callback that views ORT's buffers as torch tensors and runs the same validation and backend
registry as :func:`pakv_onnx.gather_pa_kv_cache`, so they refuse the same inputs with the same
messages.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pakv_onnx import kernels, native_lib
from pakv_onnx.native_lib import LibraryNotBuiltError, library_path
from pakv_onnx.runtime_plugin import _device
from pakv_onnx.runtime_plugin._alias import alias_hazards, in_place_pools, node_refusals
from pakv_onnx.runtime_plugin._tensors import ORT_TYPE_TO_TORCH, onnx_type_of, view

__all__ = [
    "NATIVE",
    "LibraryNotBuiltError",
    "alias_hazards",
    "bind",
    "library_path",
    "make_session",
    "node_refusals",
    "register",
    "registered_alias",
    "registered_backend",
    "run",
    "session_backend",
]

NATIVE = "native"


def session_backend(backend: str = NATIVE) -> str:
    """The backend a session registered with ``backend`` runs: ``native`` or a Python backend name.

    ``auto`` stays in C (``native``) unless a backend preferred over it (e.g. ``pypto``) is
    available in this process, in which case each call is resolved by the registry.
    """
    if backend == NATIVE:
        return NATIVE
    if backend == kernels.AUTO:
        for candidate in kernels.AUTO_PREFERENCE:
            if candidate == NATIVE:
                return NATIVE
            if candidate in kernels.BACKEND_MODULES and kernels.get_backend(candidate).unavailable_reason() is None:
                return kernels.AUTO
        return NATIVE
    kernels.get_backend(backend)  # ValueError naming the choices for an unknown name
    return backend


def registered_backend(session_options: Any) -> str | None:
    """The backend ``session_options`` were registered for by this library, or ``None``."""
    try:
        return session_options.get_session_config_entry(native_lib.CONFIG_KEY_BACKEND)
    except (RuntimeError, AttributeError):  # ORT raises RuntimeError for an absent key
        return None


def registered_alias(session_options: Any) -> bool | None:
    """Whether ``session_options`` were registered with the write op's alias route, or ``None`` if not
    registered by this library."""
    try:
        return session_options.get_session_config_entry(native_lib.CONFIG_KEY_ALIAS) == "1"
    except (RuntimeError, AttributeError):
        return None


def register(session_options: Any, backend: str = NATIVE, *, alias: bool = False) -> None:
    """Register the custom-op library on ``session_options`` for ``backend``.

    One registration serves every session made from ``session_options``: registering again for
    the same backend does nothing, for another backend is a ``ValueError`` (use new options).
    The backend is bound to this registration only (a thread-local choice the library reads while
    ORT registers it on this thread), so a raw ``register_custom_ops_library`` running on another
    thread at the same time gets ``native`` and never takes this backend, nor this one its.

    Args:
        session_options: an ``onnxruntime.SessionOptions``.
        backend: ``native`` (C kernel), ``auto``, or a backend of :mod:`pakv_onnx.kernels`.
        alias: declare the write op's updated caches aliased to its pool inputs (ORT >= 1.18,
            ORT_SEQUENTIAL): a write that feeds later nodes then updates the caller's pools in place,
            with no copy. Only for models where each write's pools are graph inputs nothing else reads
            (:func:`alias_hazards` says why not; :func:`make_session` decides it from the model). Also
            what a host's session config entry ``pakv_onnx.alias_caches`` = ``1`` asks for.
    """
    chosen = session_backend(backend)
    previous = registered_backend(session_options)
    if previous is not None:
        if previous == chosen:
            return
        raise ValueError(
            f"these SessionOptions are already registered for backend {previous!r}; a SessionOptions can be "
            f"registered once (every session made from it shares that backend): use a new "
            f"onnxruntime.SessionOptions() for backend {chosen!r}"
        )
    path = library_path()
    lib = native_lib.load()
    if chosen != NATIVE:
        from pakv_onnx.runtime_plugin import _python_backend

        _python_backend.install()
    if lib.pakv_bind_next_registration(chosen.encode()) < 0:
        raise ValueError(f"backend {chosen!r}: too many distinct backends registered in this process")
    lib.pakv_bind_next_alias(1 if alias else 0)
    try:
        session_options.register_custom_ops_library(path)
    finally:
        lib.pakv_bind_next_registration(NATIVE.encode())
        lib.pakv_bind_next_alias(0)
    if registered_backend(session_options) is None:
        # Runtimes whose Python binding registers through a temporary SessionOptions: mark these.
        session_options.add_session_config_entry(native_lib.CONFIG_KEY_BACKEND, chosen)
        session_options.add_session_config_entry(native_lib.CONFIG_KEY_ALIAS, "1" if alias else "0")


def make_session(model: Any, backend: str = NATIVE, **ort_kwargs: Any):
    """An ``onnxruntime.InferenceSession`` for ``model`` with the plugin registered for ``backend``.

    The write op takes the alias route (its pools updated in place when its outputs feed later nodes,
    ORT >= 1.18) when :func:`alias_hazards` finds nothing in ``model``; otherwise ONNX's semantics (the
    host's bound outputs, or a copy of each pool). Given options already registered with the alias
    route, a model it is not safe for is a ``ValueError`` naming the node and the pool.

    Refused too (``ValueError`` naming the node; :func:`node_refusals`): a com.microsoft::PagedAttention
    attribute the schema does not declare, and an initializer pool of a node that writes it in place (no
    cache outputs). The session returned refuses, naming the input, a numpy feed with ``writeable=False``
    for a pool it writes in place (docs/reliability.md).

    Args:
        model: an ``onnx.ModelProto``, serialized model bytes, or a path.
        backend: see :func:`register`.
        **ort_kwargs: passed to ``InferenceSession`` (``sess_options`` is used and registered on
            if given, so one options object can make several sessions of the same backend;
            ``providers`` defaults to the CPU execution provider).
    """
    import onnxruntime as ort

    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    proto = check_pakv_opset(model)
    refusals = node_refusals(proto)
    if refusals:
        raise ValueError(refusals[0])
    hazards = alias_hazards(proto)
    options = ort_kwargs.pop("sess_options", None) or ort.SessionOptions()
    if hazards and registered_alias(options):
        raise ValueError(
            f"these SessionOptions are registered with the write op's alias route, which this model must not "
            f"take: {hazards[0]} (a write in place would show there); use a new onnxruntime.SessionOptions()"
        )
    register(options, backend, alias=not hazards)
    ort_kwargs.setdefault("providers", ["CPUExecutionProvider"])
    if hasattr(model, "SerializeToString"):
        model = model.SerializeToString()
    pools = in_place_pools(proto, alias=not hazards)
    if not pools:
        return ort.InferenceSession(model, sess_options=options, **ort_kwargs)
    return _pool_guarded_session_type()(pools, model, sess_options=options, **ort_kwargs)


_POOL_GUARDED = None


def _pool_guarded_session_type() -> type:
    """``onnxruntime.InferenceSession`` whose ``run`` refuses, by name, a numpy feed with
    ``writeable=False`` for a pool the session writes in place (the kernel sees an address, not numpy's
    flag): made once, onnxruntime imported lazily."""
    global _POOL_GUARDED
    if _POOL_GUARDED is None:
        import onnxruntime as ort

        class PoolGuardedSession(ort.InferenceSession):
            def __init__(self, pools: dict[str, str], *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                self.pakv_in_place_pools = pools

            def run(self, output_names, input_feed, run_options=None):
                for name, writer in self.pakv_in_place_pools.items():
                    flags = getattr(input_feed.get(name), "flags", None)
                    if flags is not None and not flags.writeable:
                        raise ValueError(
                            f"{name} is a read-only numpy array (writeable=False), and {writer} writes it in "
                            f"place: pass a writable array (or a copy)"
                        )
                return super().run(output_names, input_feed, run_options)

        _POOL_GUARDED = PoolGuardedSession
    return _POOL_GUARDED


def check_pakv_opset(model: Any):
    """``ValueError`` if ``model`` imports the ``pakv`` opset at a version the library does not implement;
    returns the model as an ``onnx.ModelProto`` (a path is read without its external data).

    ORT matches a custom op by name whatever the model's opset version, and its C API shows a
    kernel no opset version, so the library cannot refuse ``pakv`` opset 2 itself; this check
    does it for sessions made here (raw hosts get the version-1 kernel).
    """
    from onnx import ModelProto, load_model

    from pakv_onnx.spec import DOMAIN, OPSET_VERSION

    if isinstance(model, ModelProto):
        proto = model
    elif isinstance(model, (bytes, bytearray)):
        proto = ModelProto.FromString(bytes(model))
    else:
        proto = load_model(model, load_external_data=False)
    for opset in proto.opset_import:
        if opset.domain == DOMAIN and opset.version != OPSET_VERSION:
            raise ValueError(
                f"the model imports opset {DOMAIN!r} version {opset.version}; the GatherPaKvCache library "
                f"implements only version {OPSET_VERSION}"
            )
    return proto


def bind(
    session: Any,
    feeds: Mapping[str, torch.Tensor | None],
    output_names: Sequence[str] | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
) -> Any:
    """An ``IOBinding`` of ``session`` over torch tensors, for serving loops that run it many times.

    Inputs are bound in place (every contract dtype, BF16 and FP8 included; no copy), CPU tensors
    or, for a session on the CUDA / CANN execution provider, CUDA / NPU tensors (bind the caches
    there; the index inputs stay on the host, where the device entries read them). Outputs are
    bound to the given ``out`` tensors (contiguous tensors of the exact output shape and dtype,
    which ORT then writes into: no allocation, no page faults on reuse) or left to ORT, on the
    device of the first feed in device memory (the caches), else on the host.
    ``None`` feeds (an absent optional input) are skipped. The binding holds references to the
    bound tensors (ORT only keeps their addresses); don't resize them while it is in use. Run it
    with ``session.run_with_iobinding(binding)``.
    """
    binding = session.io_binding()
    binding.pakv_bound_tensors = (dict(feeds), dict(out or {}))
    for name, tensor in feeds.items():
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous (ORT tensors are dense row-major): pass {name}.contiguous()")
        kind, index = _ort_device(name, tensor)
        binding.bind_input(name, kind, index, onnx_type_of(tensor.dtype), list(tensor.shape), _address(tensor))
    names = list(output_names) if output_names is not None else [o.name for o in session.get_outputs()]
    out = out or {}
    on_device = _device_feed(feeds)
    default_device = _ort_device("a feed", on_device) if on_device is not None else ("cpu", 0)
    for name in names:
        given = out.get(name)
        if given is None:
            binding.bind_output(name, *default_device)
            continue
        if not given.is_contiguous():
            raise ValueError(f"out[{name!r}] must be a contiguous tensor")
        kind, index = _ort_device(f"out[{name!r}]", given)
        binding.bind_output(name, kind, index, onnx_type_of(given.dtype), list(given.shape), _address(given))
    return binding


def _device_feed(feeds: Mapping[str, torch.Tensor | None]) -> torch.Tensor | None:
    """The first feed in device memory (the caches, for the plugin's models), or None."""
    return next((t for t in feeds.values() if isinstance(t, torch.Tensor) and t.device.type != "cpu"), None)


# torch device type -> ORT's IOBinding device name.
_ORT_DEVICES = {"cpu": "cpu", "cuda": "cuda", "npu": "cann"}


def _ort_device(name: str, tensor: torch.Tensor) -> tuple[str, int]:
    kind = _ORT_DEVICES.get(tensor.device.type)
    if kind is None:
        raise ValueError(f"{name} is on {tensor.device}: ORT binds cpu, cuda (CUDA EP) or npu (CANN EP) tensors")
    return kind, tensor.device.index or 0


def _address(tensor: torch.Tensor) -> int:
    # ORT wants a real address even for a tensor with no elements (whose data_ptr may be 0).
    return tensor.data_ptr() or _EMPTY.data_ptr()


_EMPTY = torch.empty(8, dtype=torch.uint8)


def run(
    session: Any,
    feeds: Mapping[str, torch.Tensor | None],
    output_names: Sequence[str] | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Run ``session`` (plugin or stock) on torch tensors through IOBinding (see :func:`bind`).

    Returns every output as a torch tensor of the right dtype (ORT's Python API cannot return
    BF16 as numpy): the ``out`` tensor where one was given, else a view sharing ORT's output
    memory (kept alive by the tensor).
    """
    binding = bind(session, feeds, output_names, out)
    names = list(output_names) if output_names is not None else [o.name for o in session.get_outputs()]
    out = out or {}
    session.run_with_iobinding(binding)
    result = {}
    for name, value in zip(names, binding.get_outputs()):
        if out.get(name) is not None and value.data_ptr() == out[name].data_ptr():
            result[name] = out[name]
            continue
        try:
            dtype = ORT_TYPE_TO_TORCH[value.data_type()]
        except KeyError:
            raise TypeError(f"output {name} has type {value.data_type()}, which has no torch dtype here") from None
        if value.device_name().lower() == "cpu":
            result[name] = view(value.data_ptr(), tuple(value.shape()), dtype, owner=value)
        else:  # ORT's buffer on the feeds' device: a DLPack view; the OrtValue lives with the tensor object
            on_device = _device_feed(feeds)
            label = str(on_device.device) if on_device is not None else "cuda:0"
            tensor = _device.tensor_at(value.data_ptr(), tuple(value.shape()), dtype, label)
            tensor.pakv_owner = value  # (a view taken from it does not keep the buffer: keep this tensor)
            result[name] = tensor
    return result
