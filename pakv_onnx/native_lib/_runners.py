"""The plan runners: the validator's calls and the cores' runs, each one function over the library's
exported entry (the hot ones through the front's extension, ``_front`` from pakv_front.c, which calls the
library by address with the GIL released, as ctypes does), with per-thread scratch (a plan copy and an
error buffer). Nothing native loads until a function here is first called."""

from __future__ import annotations

import ctypes
import functools
import importlib
import struct
import threading

from pakv_onnx.native_lib._abi import ERR_TYPE, ERR_VALUE, ERROR_LEN, LibraryABIError, Plan, Tensor
from pakv_onnx.native_lib._loading import function


class _Scratch(threading.local):
    """Per-thread reusable buffers for the hot path: a plan to run and an error buffer."""

    def __init__(self) -> None:
        self.plan = Plan()
        self.plan_address = ctypes.addressof(self.plan)
        self.plan_bytes = memoryview(self.plan).cast("B")
        self.error = ctypes.create_string_buffer(ERROR_LEN)
        self.error_address = ctypes.addressof(self.error)


_scratch = _Scratch()


def _raise(kind: int) -> None:
    """Raise what the library said into this thread's error buffer: ``TypeError`` for
    :data:`ERR_TYPE` (a type the core does not read), else ``ValueError``."""
    raise (TypeError if kind == ERR_TYPE else ValueError)(_scratch.error.value.decode(errors="replace"))


class _Fast:
    """The hot calls without ctypes: the front's extension (``_front``, pakv_front.c) calls the
    library's functions through their addresses, the GIL released as ctypes does. Bound on first use
    (importing the package loads no native code)."""

    def __init__(self) -> None:
        module = front()
        self.call, self.run = module.call, module.run
        address = {name: ctypes.cast(function(name), ctypes.c_void_p).value for name in _FAST_FUNCTIONS}
        self.plan_gather, self.check_gather_outputs, self.plan_scatter, self.gather, self.scatter = (
            address[name] for name in _FAST_FUNCTIONS
        )


_FAST_FUNCTIONS = ("pakv_plan_gather", "pakv_check_gather_outputs", "pakv_plan_scatter", "pakv_gather", "pakv_scatter")
_fast: _Fast | None = None


def fast() -> _Fast:
    """The bound hot calls (see :class:`_Fast`)."""
    global _fast
    if _fast is None:
        _fast = _Fast()
    return _fast


@functools.cache
def front():
    """The front's extension module, checked against the ctypes mirror; ``LibraryABIError`` if it is
    missing or was built against another ``pakv_tensor``."""
    try:  # by its full name: the extension, not this package's __init__ (which imports this module)
        _front = importlib.import_module("pakv_onnx.native_lib._front")
    except ImportError as exc:
        raise LibraryABIError(
            f"pakv_onnx's extension _front cannot be imported ({exc}): rebuild it with `pip install -e .` "
            "(or `python setup.py build_ext --inplace`)"
        ) from None
    if _front.record_size() != ctypes.sizeof(Tensor):
        raise LibraryABIError(
            f"{_front.__file__} writes pakv_tensor records of {_front.record_size()} bytes, this pakv_onnx "
            f"{ctypes.sizeof(Tensor)}: rebuild it with `pip install -e .`"
        )
    return _front


def plan_gather_call(call: int) -> int:
    """``pakv_plan_gather`` on the GatherCall at ``call``: 0, or :data:`ERR_VALUE` / :data:`ERR_TYPE`
    with the message at the call's ``error``."""
    hot = _fast or fast()
    return hot.call(hot.plan_gather, call)


def plan_scatter_call(call: int) -> int:
    """``pakv_plan_scatter`` on the ScatterCall at ``call`` (see :func:`plan_gather_call`)."""
    hot = _fast or fast()
    return hot.call(hot.plan_scatter, call)


def run_scatter(plan_address: int) -> None:
    """Run the validated pakv_scatter_plan at ``plan_address`` (it writes its caches in place)."""
    hot = _fast or fast()
    if hot.run(hot.scatter, plan_address, _scratch.error_address, ERROR_LEN) != 0:
        _raise(ERR_VALUE)


def check_scatter_writable(plan_address: int) -> None:
    """``ValueError`` (nothing written) unless the caches of the validated pakv_scatter_plan at
    ``plan_address`` can be written where it writes (asked of the kernel: a read-only pool is never a
    signal); what a Python backend calls before it writes host caches (the C scatter asks itself)."""
    if function("pakv_scatter_writable")(plan_address, _scratch.error_address, ERROR_LEN) != 0:
        _raise(ERR_VALUE)


def check_buffer_writable(address: int, size: int, name: str) -> None:
    """``ValueError`` naming ``name`` unless the ``size`` bytes at ``address`` can be written (their first
    and last byte, asked of the kernel)."""
    if function("pakv_buffer_writable")(address, size, name.encode(), _scratch.error_address, ERROR_LEN) != 0:
        _raise(ERR_VALUE)


def check_gather_outputs_call(call: int) -> int:
    """``pakv_check_gather_outputs`` on the GatherCall at ``call`` (see :func:`plan_gather_call`)."""
    hot = _fast or fast()
    return hot.call(hot.check_gather_outputs, call)


def request_output(request_address: int, index: int, dims_address: int, rank: int) -> int:
    """``pakv_request_output``: ORT's buffer for output ``index`` of the shape at ``dims_address``
    (``rank`` int64s), or 0 with the request's error set."""
    return function("pakv_request_output")(request_address, index, dims_address, rank) or 0


_OUT_OFFSETS = (Plan.key_out.offset, Plan.value_out.offset)


def run_gather(plan_address: int, key_out: int, value_out: int) -> None:
    """Run the plan at ``plan_address`` (a validated pakv_plan) in the copy core, writing to the two
    output addresses; ``ValueError`` with the core's message if it refuses. The plan is copied
    into this thread's scratch first, so one plan may run on several threads at once."""
    scratch = _scratch
    ctypes.memmove(scratch.plan_address, plan_address, ctypes.sizeof(Plan))
    struct.pack_into("@PP", scratch.plan_bytes, _OUT_OFFSETS[0], key_out, value_out)
    run_plan(scratch.plan_address)


def run_plan(plan_address: int) -> None:
    """Run the validated pakv_plan at ``plan_address`` as it is (its own output addresses)."""
    hot = _fast or fast()
    if hot.run(hot.gather, plan_address, _scratch.error_address, ERROR_LEN) != 0:
        _raise(ERR_VALUE)


def plan_attention_call(call: int) -> int:
    """``pakv_plan_attention`` on the AttentionCall at ``call`` (see :func:`plan_gather_call`)."""
    return function("pakv_plan_attention")(call)


def check_attention_output_call(call: int) -> int:
    """``pakv_check_attention_output`` on the AttentionCall at ``call`` (see :func:`plan_gather_call`)."""
    return function("pakv_check_attention_output")(call)


def run_attention(plan_address: int, threads: int = 1) -> None:
    """Run the validated pakv_attention_plan at ``plan_address`` (it writes its output) on this thread,
    or split over ``threads`` of the library's threads (the same answer, bit for bit)."""
    error = _scratch.error_address
    if threads == 1:
        kind = function("pakv_attention")(plan_address, error, ERROR_LEN)
    else:
        kind = function("pakv_attention_threads")(plan_address, threads, error, ERROR_LEN)
    if kind != 0:
        _raise(kind)


def plan_fused_call(call: int) -> int:
    """``pakv_plan_fused`` on the FusedCall at ``call`` (see :func:`plan_gather_call`)."""
    return function("pakv_plan_fused")(call)


def check_fused_outputs_call(call: int) -> int:
    """``pakv_check_fused_outputs`` on the FusedCall at ``call`` (see :func:`plan_gather_call`)."""
    return function("pakv_check_fused_outputs")(call)


def fused_scratch_needed(call: int) -> int:
    """int64 scratch entries the FusedCall at ``call`` needs (its records written), or -1."""
    return function("pakv_fused_scratch_needed")(call)


def fused_defaults(attributes: int) -> None:
    """Fill the pakv_fused_attributes at ``attributes`` with ORT's schema defaults."""
    function("pakv_fused_defaults")(attributes)


def fused_string_attribute(field: int, text: bytes) -> None:
    """A string attribute's bytes into the pakv_fused_attributes field at ``field`` as the C rules see it
    (cut past FUSED_STRING_LEN - 1 bytes; with a NUL byte inside, described, so the rule refuses it by name)."""
    function("pakv_fused_string_attribute")(field, text, len(text))


def check_fused_writable(plan_address: int) -> None:
    """``ValueError`` (nothing written) unless the caches of the validated pakv_fused_plan at ``plan_address``
    can be written where its prologue writes (asked of the kernel): what a Python backend calls first."""
    if function("pakv_fused_writable")(plan_address, _scratch.error_address, ERROR_LEN) != 0:
        _raise(ERR_VALUE)


def run_fused(plan_address: int, out: int, query_rows: int, key_cache: int, value_cache: int) -> None:
    """Bind the validated pakv_fused_plan at ``plan_address`` to its buffers and run it on this thread
    (the prologue writes the caches in place, then the attention writes ``out``)."""
    function("pakv_fused_bind_plan")(plan_address, out, query_rows, key_cache, value_cache)
    if function("pakv_fused_attention")(plan_address, _scratch.error_address, ERROR_LEN) != 0:
        _raise(ERR_VALUE)


# How the CUDA entries issued a call's copies (pakv_device.c), in the order the C counters are kept.
CUDA_COPY_PATHS = ("runs", "batch", "kernel")


def cuda_copy_paths() -> dict[str, int]:
    """Calls of the CUDA device entries since the library loaded, per copy path: ``runs`` (one
    cuMemcpyDtoDAsync per run: an old driver, a single copy, or ``PAKV_ONNX_CUDA_COPY=runs``),
    ``batch`` (one cuMemcpyBatchAsync) and ``kernel`` (one launch of the embedded copy kernel).
    What ORT loaded is this same library file, so its counters are these."""
    counts = (ctypes.c_longlong * len(CUDA_COPY_PATHS))()
    function("pakv_cuda_copy_paths")(ctypes.addressof(counts))
    return dict(zip(CUDA_COPY_PATHS, counts))
