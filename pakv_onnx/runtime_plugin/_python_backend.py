"""The Python side of the plugin: the callback ORT kernels call for Python backends.

A kernel registered for a Python backend (golden, torch, pypto, auto) hands the raw input
tensors to :func:`_serve`; it views them as torch tensors (no copy), validates them with
:func:`pakv_onnx.validator.plan_gather`, picks the backend with :func:`pakv_onnx.kernels.resolve_backend`
(exactly what :func:`pakv_onnx.gather_pa_kv_cache` does), asks ORT for the outputs and lets the
backend write into them. Any exception becomes the kernel's ORT error, message kept.

On the library's CUDA / CANN entries the caches and outputs are ORT's device buffers: they become
device tensors through DLPack (:mod:`._device`, no copy), the index inputs stay host tensors, and
the backend runs with ORT's compute stream as torch's current stream.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading
import time

from pakv_onnx import native_lib
from pakv_onnx.ops import attention_with, gather_with, scatter_with
from pakv_onnx.runtime_plugin import _device
from pakv_onnx.runtime_plugin._tensors import ONNX_TO_TORCH, view
from pakv_onnx.spec import ATTENTION, GATHER, SCATTER

_install_lock = threading.Lock()
_callback = None  # the CFUNCTYPE object must live as long as the library may call it
# At exit, calls in flight are waited for (a call killed inside Python aborts the process); a
# note goes to stderr after _SHUTDOWN_NOTICE_MS, and after _SHUTDOWN_WAIT_MS exit goes on anyway.
_SHUTDOWN_WAIT_MS = 600_000
_SHUTDOWN_NOTICE_MS = 2_000
# After the calls in flight are done, how long exit waits for their threads to leave session.run.
_SHUTDOWN_LEAVE_S = 5.0


# (address, shape, dtype) -> the torch view of that memory. A serving loop hands the same ORT
# buffers every call (a prebound IOBinding, or ORT's arena reusing a block), and a view is only
# a description of memory (it owns nothing, like a fresh one): reusing it saves building a ctypes
# buffer and a tensor per input and output. Bounded: emptied when it holds _VIEW_CACHE_SIZE views.
_VIEW_CACHE_SIZE = 256
_views: dict[tuple[int, tuple[int, ...], object, str], object] = {}
_CPU = "cpu"
_SCATTER_OP, _ATTENTION_OP = SCATTER.op_type.encode(), ATTENTION.op_type.encode()


def _view(address: int, shape: tuple[int, ...], dtype, device: str = _CPU):
    key = (address, shape, dtype, device)
    tensor = _views.get(key)
    if tensor is None:
        tensor = view(address, shape, dtype) if device == _CPU else _device.tensor_at(address, shape, dtype, device)
        if len(_views) >= _VIEW_CACHE_SIZE:
            _views.clear()
        _views[key] = tensor
    return tensor


# The five input records are read with one struct unpack (a ctypes field read per value costs more).
_INPUTS_OFFSET = native_lib.Request.inputs.offset
_INPUTS_BYTES = ctypes.sizeof(native_lib.Tensor) * native_lib.NUM_INPUTS
_INPUTS_BLOCK = ctypes.c_char * _INPUTS_BYTES


# A record unpacked: data, host_data, present, elem_type, ndim, reserved, device, dims, strides.
_DEVICE_AT, _DIMS_AT = 6, 7


def _device_of(record: tuple) -> str:
    """A record's device label ("cpu", "cuda:0", "npu:0": the C glue's)."""
    label = record[_DEVICE_AT]
    return _CPU if label.startswith(b"cpu\0") else (label.split(b"\0", 1)[0].decode() or _CPU)


def _input(name: str, record: tuple[int, ...]):
    data, _host, present, elem_type, ndim = record[:5]
    if not present:
        return None
    dtype = ONNX_TO_TORCH.get(elem_type)
    if dtype is None:
        raise TypeError(f"{name} has ONNX element type {elem_type}, which is outside the contract")
    if not 0 <= ndim <= native_lib.MAX_RANK:
        raise ValueError(f"{name} has rank {ndim}, more than {native_lib.MAX_RANK}")
    return _view(data or 0, record[_DIMS_AT : _DIMS_AT + ndim], dtype, _device_of(record))


class _Dims(threading.local):
    def __init__(self) -> None:
        self.dims = (ctypes.c_int64 * native_lib.MAX_RANK)()
        self.address = ctypes.addressof(self.dims)


_dims = _Dims()


def _output(req_ptr, req_address: int, index: int, shape: tuple[int, ...], dtype, device: str):
    scratch = _dims
    dims = scratch.dims
    for i, size in enumerate(shape):  # rank <= 4 (the ops' outputs: gathered rows, updated caches)
        dims[i] = size
    address = native_lib.request_output(req_address, index, scratch.address, len(shape))
    if not address:
        raise RuntimeError(req_ptr.contents.error.decode(errors="replace"))
    return _view(address, shape, dtype, device)


def _serve(req_ptr) -> None:
    req = req_ptr.contents
    req_address = ctypes.addressof(req)
    block = _INPUTS_BLOCK.from_address(req_address + _INPUTS_OFFSET)
    records = tuple(native_lib.TENSOR_RECORD.iter_unpack(block))
    op = req.op
    scatter, attention = op == _SCATTER_OP, op == _ATTENTION_OP
    names = (SCATTER if scatter else ATTENTION if attention else GATHER).input_names
    inputs = tuple(_input(name, record) for name, record in zip(names, records))
    device = _device_of(records[2 if scatter else 0])  # the caches' / query's; ORT allocates the outputs there
    if attention:
        attention_with(
            inputs,
            scale=req.scale,
            backend=req.backend.decode(),
            allocate=lambda plan: _output(req_ptr, req_address, 0, plan.out_shape, plan.dtype, device),
        )
        return

    def caches_from_ort():  # the scatter's updated caches: ORT's outputs, the caches' shapes and dtypes
        key_cache, value_cache = inputs[2], inputs[3]
        return (
            _output(req_ptr, req_address, 0, tuple(key_cache.shape), key_cache.dtype, device),
            _output(req_ptr, req_address, 1, tuple(value_cache.shape), value_cache.dtype, device),
        )

    def allocate_from_ort(plan):
        # Each output takes its own cache's dtype (key and value caches may differ).
        return (
            _output(req_ptr, req_address, 0, plan.key_out_shape, plan.key_dtype, device),
            _output(req_ptr, req_address, 1, plan.value_out_shape, plan.value_dtype, device),
        )

    with _device.stream_context(device, req.stream or 0):
        if scatter:
            scatter_with(inputs, cache_mode=req.cache_mode.decode(), backend=req.backend.decode(), allocate=caches_from_ort)
            return
        gather_with(
            inputs,
            cache_mode=req.cache_mode.decode(),
            is_seq_lens_cumsum=bool(req.is_seq_lens_cumsum),
            backend=req.backend.decode(),
            allocate=allocate_from_ort,
        )


def _entry(req_ptr) -> int:
    try:
        _serve(req_ptr)
        return 0
    except BaseException as exc:  # noqa: BLE001 - every failure must become an ORT status, never unwind into C
        try:
            message = f"{type(exc).__name__}: {exc}"
            native_lib.load().pakv_request_set_error(req_ptr, message.encode(errors="replace"))
        except BaseException:  # noqa: BLE001
            pass
        return 1


_ORT_PYTHON_API = f"onnxruntime{os.sep}capi"  # in any onnxruntime install's path
_RUNTIME_PLUGIN_DIR = os.path.dirname(os.path.abspath(__file__))


def _in_a_run(frame) -> bool:
    """Whether a thread whose innermost Python frame is ``frame`` is inside onnxruntime's Python API or this
    package's runtime_plugin (a session.run, or the run that wraps it: its outputs' torch views, C++ calls
    that drop the GIL), anywhere on its stack."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_RUNTIME_PLUGIN_DIR) or _ORT_PYTHON_API in filename:
            return True
        frame = frame.f_back
    return False


def _threads_inside_a_run() -> int:
    """Other threads inside a run (:func:`_in_a_run`)."""
    me = threading.get_ident()
    return sum(
        1
        for ident, frame in sys._current_frames().items()  # noqa: SLF001 - the documented way to see other threads
        if ident != me and _in_a_run(frame)
    )


def _shutdown() -> None:
    """At interpreter exit: stop new callbacks, wait (GIL released) for those in flight, then let
    their threads leave onnxruntime.

    A call that has just returned to ORT is still unwinding out of session.run and must take the
    GIL once more. If finalization has started by then, CPython ends a daemon thread with
    pthread_exit, whose forced unwind through ORT's C++ frames aborts the process ("terminate
    called without an active exception"). So the exit also waits, sleeping with the GIL free,
    until no other thread is inside a run, onnxruntime's Python API or runtime_plugin's around it, at any
    depth of its stack (bounded by _SHUTDOWN_LEAVE_S): its innermost frame alone let the exit go on while
    the thread was still turning the outputs into torch tensors (a CI run under load aborted so).
    """
    native_lib.load().pakv_python_shutdown(_SHUTDOWN_WAIT_MS, _SHUTDOWN_NOTICE_MS)
    deadline = time.monotonic() + _SHUTDOWN_LEAVE_S
    while _threads_inside_a_run() and time.monotonic() < deadline:
        time.sleep(0.005)


def install() -> None:
    """Install the callback in the library (idempotent, thread-safe)."""
    global _callback
    with _install_lock:
        if _callback is not None:
            return
        _callback = native_lib.CALLBACK(_entry)
        native_lib.load().pakv_set_python_callback(_callback)
        atexit.register(_shutdown)
