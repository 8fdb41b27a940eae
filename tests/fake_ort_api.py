"""A fake ``OrtApiBase`` (ctypes) for driving the library's ``RegisterCustomOps`` without ONNX Runtime.

``fake_ort({slot: ctypes function}, api_version=N)`` serves an ``OrtApi`` table up to version N
(``GetApi`` returns NULL above it) and records every version asked for;
:func:`register_custom_ops` calls the library's entry point with it.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Mapping

GET_API = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint32)
VERSION_STRING = ctypes.CFUNCTYPE(ctypes.c_void_p)  # returns a char* we own (no ctypes conversion)


class ApiBase(ctypes.Structure):
    _fields_ = [("GetApi", GET_API), ("GetVersionString", VERSION_STRING)]


@dataclasses.dataclass
class FakeOrt:
    base: ApiBase
    requested: list[int]  # the API versions GetApi was asked for, in order
    keep: list  # every ctypes object the C side may call or read, alive as long as this is


def fake_ort(functions: Mapping[int, object], *, api_version: int, version: bytes | None = None, slots: int = 512):
    """An OrtApiBase whose API table has ``functions`` at their slots; ``version``: GetVersionString's text."""
    table = (ctypes.c_void_p * slots)()
    for slot, fn in functions.items():
        table[slot] = ctypes.cast(fn, ctypes.c_void_p)
    requested: list[int] = []
    text = ctypes.create_string_buffer(version) if version is not None else None

    @GET_API
    def get_api(asked: int):
        requested.append(asked)
        return ctypes.addressof(table) if asked <= api_version else None

    @VERSION_STRING
    def version_string():
        return ctypes.addressof(text) if text is not None else None

    keep = [table, dict(functions), text, get_api, version_string]
    return FakeOrt(ApiBase(get_api, version_string), requested, keep)


def register_custom_ops(lib: ctypes.CDLL, options_address: int | None, fake: FakeOrt) -> int | None:
    """``RegisterCustomOps(options, api_base)``: the returned OrtStatus* (None = success)."""
    register = lib.RegisterCustomOps
    register.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    register.restype = ctypes.c_void_p
    return register(options_address, ctypes.addressof(fake.base))


# --------------------------------------------------------------------------------------------------
# A fake runtime for the kernels' compute (device entries included), no ONNX Runtime involved.
# --------------------------------------------------------------------------------------------------
import re  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

NATIVE_LIB_DIR = Path(__file__).resolve().parents[1] / "pakv_onnx" / "native_lib"
FAKE_DRIVER_SOURCE = Path(__file__).resolve().parent / "native" / "fake_device_driver.c"
# OrtApi slot numbers, read from ort_abi.h (the one place they are written).
SLOTS: dict[str, int] = {
    name: int(number)
    for name, number in re.findall(r"PAKV_SLOT_(\w+) = (\d+)", (NATIVE_LIB_DIR / "ort_abi.h").read_text())
}
EPS = ("CPUExecutionProvider", "CUDAExecutionProvider", "CANNExecutionProvider")  # pakv_ep.h order
DEVICE_CPU, DEVICE_GPU, DEVICE_NPU = 0, 1, 3  # OrtMemoryInfoDeviceType
MEM_CPU_INPUT, MEM_DEFAULT = -2, 0  # OrtMemType
# ONNX element type -> bytes (the contract's cache dtypes and the index types).
ITEMSIZE = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 10: 2, 11: 8, 12: 4, 16: 2, 17: 1, 19: 1}

_V = ctypes.c_void_p
_F = ctypes.CFUNCTYPE


class CustomOp(ctypes.Structure):
    """The head of ``PakvOrtCustomOp`` (ort_abi.h, the header's OrtCustomOp field order)."""

    _fields_ = [
        ("version", ctypes.c_uint32),
        ("CreateKernel", _V),
        ("GetName", _F(ctypes.c_char_p, _V)),
        ("GetExecutionProviderType", _F(ctypes.c_char_p, _V)),
        ("GetInputType", _F(ctypes.c_int, _V, ctypes.c_size_t)),
        ("GetInputTypeCount", _F(ctypes.c_size_t, _V)),
        ("GetOutputType", _F(ctypes.c_int, _V, ctypes.c_size_t)),
        ("GetOutputTypeCount", _F(ctypes.c_size_t, _V)),
        ("KernelCompute", _V),
        ("KernelDestroy", _F(None, _V)),
        ("GetInputCharacteristic", _F(ctypes.c_int, _V, ctypes.c_size_t)),
        ("GetOutputCharacteristic", _F(ctypes.c_int, _V, ctypes.c_size_t)),
        ("GetInputMemoryType", _F(ctypes.c_int, _V, ctypes.c_size_t)),
        ("GetVariadicInputMinArity", _V),
        ("GetVariadicInputHomogeneity", _V),
        ("GetVariadicOutputMinArity", _V),
        ("GetVariadicOutputHomogeneity", _V),
        ("CreateKernelV2", _F(_V, _V, _V, _V, ctypes.POINTER(_V))),
        ("KernelComputeV2", _F(_V, _V, _V)),
    ]


@dataclasses.dataclass
class FakeTensor:
    """A tensor as the fake hands it to a kernel: an address, an ONNX element type, dims, and where
    its memory is (OrtMemoryInfoDeviceType, device id); the caller keeps the memory alive."""

    address: int
    elem_type: int
    dims: tuple[int, ...]
    device_type: int = DEVICE_CPU
    device_id: int = 0


class FakeOrtError(RuntimeError):
    """The OrtStatus a kernel returned (message kept)."""


class FakeRuntime:
    """Enough of ONNX Runtime, as an OrtApi table of ctypes callbacks, to register the library's ops
    and run their kernels: attributes, inputs, ORT-allocated outputs (zeroed host buffers labelled
    with ``out_device``), memory infos, a compute stream, from API 17 ``KernelContext_ParallelFor``
    (parts run in reverse order on the calling thread, each call recorded) and from API 24
    ``GetTensorElementTypeAndShapeDataReference`` (the tensor's own dims array). ``shape_reads`` counts the
    values whose shape was read by reference (``"reference"``) and through a type-and-shape info (``"info"``)."""

    def __init__(self, *, api_version: int = 17, stream: int = 0x5EED0, version: bytes | None = None) -> None:
        self.api_version = api_version
        self.stream = stream
        self.parallel_calls: list[tuple[int, int]] = []  # (total, num_batch) of each ParallelFor
        self.shape_reads = {"reference": 0, "info": 0}
        self._dims: dict[int, ctypes.Array] = {}  # handle -> the dims array handed out by reference
        self.ops: list[int] = []
        self.op_domains: dict[int, str] = {}  # op address -> the domain it was added to
        self._objects: dict[int, object] = {}
        self._next = 0x1000
        self._lock = threading.Lock()
        self._call = threading.local()
        functions = {SLOTS[name]: fn for name, fn in self._callbacks().items()}
        if api_version < 17:
            functions.pop(SLOTS["KernelContext_ParallelFor"])
        if api_version < 24:
            functions.pop(SLOTS["GetTensorElementTypeAndShapeDataReference"])
        version = version or f"1.{api_version}.0-fake".encode()
        self.fake = fake_ort(functions, api_version=api_version, version=version)
        self.api = self.fake.keep[0]  # the table itself
        self.options = (ctypes.c_char * 64)()

    # --- handles ------------------------------------------------------------------------------
    def _handle(self, obj: object) -> int:
        with self._lock:
            self._next += 16
            self._objects[self._next] = obj
            return self._next

    def _get(self, handle: int):
        return self._objects[handle]

    def _status(self, message: str, code: int = 2) -> int:
        buffer = ctypes.create_string_buffer(message.encode())
        return self._handle(("status", code, buffer))

    # --- the table ----------------------------------------------------------------------------
    def _callbacks(self) -> dict:
        P, C, S, I64 = ctypes.POINTER, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int64
        fns = {}

        def slot(name, *types):
            def wrap(fn):
                fns[name] = _F(*types)(fn)
                return fn

            return wrap

        @slot("CreateStatus", _V, ctypes.c_int, C)
        def create_status(code, msg):
            return self._status(msg.decode(errors="replace"), code)

        @slot("GetErrorMessage", _V, _V)
        def get_error_message(status):
            return ctypes.addressof(self._get(status)[2])

        @slot("ReleaseStatus", None, _V)
        def release_status(status):
            with self._lock:
                self._objects.pop(status, None)

        @slot("CreateCustomOpDomain", _V, C, P(_V))
        def create_domain(name, out):
            out[0] = self._handle(("domain", name))
            return None

        @slot("CustomOpDomain_Add", _V, _V, _V)
        def domain_add(domain, op):
            self.ops.append(op)
            self.op_domains[op] = self._get(domain)[1].decode()
            return None

        @slot("AddCustomOpDomain", _V, _V, _V)
        def add_domain(options, domain):
            return None

        config: dict[bytes, bytes] = {}

        @slot("AddSessionConfigEntry", _V, _V, C, C)
        def add_config(options, key, value):
            config[key] = value
            return None

        @slot("HasSessionConfigEntry", _V, _V, C, P(ctypes.c_int))
        def has_config(options, key, out):
            out[0] = int(key in config)
            return None

        @slot("GetSessionConfigEntry", _V, _V, C, _V, P(S))
        def get_config(options, key, value, size):
            text = config.get(key, b"") + b"\0"
            if value and size[0] >= len(text):
                ctypes.memmove(value, text, len(text))
            size[0] = len(text)
            return None

        def copy_string(text: bytes, out, size):  # ORT's rule: the size asked for first (out NULL), then the text
            if out:
                if size[0] < len(text):
                    size[0] = len(text)
                    return self._status("buffer too small", 1)
                ctypes.memmove(out, text, len(text))
            size[0] = len(text)
            return None

        def attribute(info, name, kinds):
            attrs = self._get(info)
            key = name.decode()
            if key not in attrs:
                return None, self._status(f"No attribute with name:'{key}'is defined.", 1)
            if not isinstance(attrs[key], kinds):
                return None, self._status("Attribute name and type don't match", 1)
            return attrs[key], None

        @slot("KernelInfoGetAttribute_int64", _V, _V, C, P(I64))
        def attr_int(info, name, out):
            value, status = attribute(info, name, int)
            if status is None:
                out[0] = value
            return status

        @slot("KernelInfoGetAttribute_float", _V, _V, C, P(ctypes.c_float))
        def attr_float(info, name, out):
            value, status = attribute(info, name, float)
            if status is None:
                out[0] = value
            return status

        @slot("KernelInfoGetAttribute_string", _V, _V, C, _V, P(S))
        def attr_string(info, name, out, size):
            value, status = attribute(info, name, str)
            return status if status is not None else copy_string(value.encode() + b"\0", out, size)

        for array in ("KernelInfoGetAttributeArray_float", "KernelInfoGetAttributeArray_int64"):

            @slot(array, _V, _V, C, _V, P(S))
            def attr_array(info, name, out, size):
                value, status = attribute(info, name, list)
                if status is None:
                    size[0] = 0
                return status

        def node_outputs(info):  # the node's output names ("" for an absent optional one)
            return self._get(info).get("(outputs)", ("output", "key_cache_out", "value_cache_out"))

        @slot("KernelInfo_GetOutputCount", _V, _V, P(S))
        def info_output_count(info, out):
            out[0] = len(node_outputs(info))
            return None

        @slot("KernelInfo_GetOutputName", _V, _V, S, _V, P(S))
        def info_output_name(info, index, out, size):
            return copy_string(node_outputs(info)[index].encode() + b"\0", out, size)

        @slot("KernelInfo_GetInputName", _V, _V, S, _V, P(S))
        def info_input_name(info, index, out, size):
            return copy_string(f"input_{index}".encode() + b"\0", out, size)

        @slot("KernelInfo_GetNodeName", _V, _V, _V, P(S))
        def info_node_name(info, out, size):
            return copy_string(b"node\0", out, size)

        @slot("KernelInfoGetConstantInput_tensor", _V, _V, S, P(ctypes.c_int), P(_V))
        def constant_input(info, index, is_constant, out):  # "(constants)": the input indices that are initializers
            is_constant[0] = int(index in self._get(info).get("(constants)", ()))
            out[0] = None
            return None

        @slot("KernelContext_GetInputCount", _V, _V, P(S))
        def input_count(ctx, out):
            out[0] = len(self._get(ctx)["inputs"])
            return None

        @slot("KernelContext_GetOutputCount", _V, _V, P(S))
        def output_count(ctx, out):
            out[0] = 2
            return None

        @slot("KernelContext_GetInput", _V, _V, S, P(_V))
        def get_input(ctx, index, out):
            call = self._get(ctx)
            tensor = call["inputs"][index] if index < len(call["inputs"]) else None
            out[0] = call["handles"].setdefault(("in", index), self._handle(tensor)) if tensor else None
            return None

        @slot("KernelContext_GetOutput", _V, _V, S, P(I64), S, P(_V))
        def get_output(ctx, index, dims, rank, out):
            call = self._get(ctx)
            shape = tuple(dims[i] for i in range(rank))
            count = 1
            for d in shape:
                count *= d
            elem = call["output_types"][index]
            buffer = (ctypes.c_char * max(1, count * ITEMSIZE[elem]))()
            tensor = FakeTensor(ctypes.addressof(buffer), elem, shape, *call["out_device"])
            call["outputs"][index] = (tensor, buffer)
            out[0] = self._handle(tensor)
            return None

        @slot("GetTensorTypeAndShape", _V, _V, P(_V))
        def type_and_shape(value, out):
            self.shape_reads["info"] += 1
            out[0] = value  # the tensor is its own type-and-shape info
            return None

        @slot("GetTensorElementTypeAndShapeDataReference", _V, _V, P(ctypes.c_int), P(P(I64)), P(S))
        def type_and_shape_reference(value, elem_type, dims, count):
            self.shape_reads["reference"] += 1
            tensor = self._get(value)
            with self._lock:
                own = self._dims.setdefault(value, (I64 * max(1, len(tensor.dims)))(*tensor.dims))
            elem_type[0] = tensor.elem_type
            dims[0] = ctypes.cast(own, P(I64)) if tensor.dims else None  # a scalar: no dims (ORT's NULL)
            count[0] = len(tensor.dims)
            return None

        @slot("ReleaseTensorTypeAndShapeInfo", None, _V)
        def release_info(info):
            pass

        @slot("GetTensorElementType", _V, _V, P(ctypes.c_int))
        def element_type(info, out):
            out[0] = self._get(info).elem_type
            return None

        @slot("GetDimensionsCount", _V, _V, P(S))
        def dims_count(info, out):
            out[0] = len(self._get(info).dims)
            return None

        @slot("GetDimensions", _V, _V, P(I64), S)
        def get_dims(info, dims, n):
            for i, d in enumerate(self._get(info).dims[:n]):
                dims[i] = d
            return None

        @slot("GetTensorMutableData", _V, _V, P(_V))
        def mutable_data(value, out):
            out[0] = self._get(value).address
            return None

        @slot("GetTensorMemoryInfo", _V, _V, P(_V))
        def memory_info(value, out):
            out[0] = value  # the tensor is its own memory info
            return None

        @slot("MemoryInfoGetDeviceType", None, _V, P(ctypes.c_int))
        def device_type(info, out):
            out[0] = self._get(info).device_type

        @slot("MemoryInfoGetId", _V, _V, P(ctypes.c_int))
        def device_id(info, out):
            out[0] = self._get(info).device_id
            return None

        @slot("KernelContext_GetGPUComputeStream", _V, _V, P(_V))
        def compute_stream(ctx, out):
            out[0] = self.stream or None
            return None

        part_fn = _F(None, _V, S)

        @slot("KernelContext_ParallelFor", _V, _V, _V, S, S, _V)
        def parallel_for(ctx, fn, total, num_batch, data):
            self.parallel_calls.append((total, num_batch))
            run = part_fn(fn)
            for i in reversed(range(total)):  # any order must do
                run(data, i)
            return None

        return fns

    # --- driving the library ------------------------------------------------------------------
    def register(self, lib: ctypes.CDLL) -> list[int]:
        """RegisterCustomOps with this runtime; the registered ops' addresses, in order."""
        self.ops.clear()
        status = register_custom_ops(lib, ctypes.addressof(self.options), self.fake)
        if status:
            raise FakeOrtError(self.message(status))
        return list(self.ops)

    def message(self, status: int) -> str:
        return self._get(status)[2].value.decode(errors="replace")

    @staticmethod
    def op(address: int) -> CustomOp:
        return CustomOp.from_address(address)

    def find_op(self, ep: str, key_type: int, value_type: int, name: str = "GatherPaKvCache") -> int:
        for address in self.ops:
            op = self.op(address)
            if (
                op.GetExecutionProviderType(address).decode() == ep
                and op.GetName(address).decode() == name
                and op.GetInputType(address, 0) == key_type
                and op.GetInputType(address, 1) == value_type
            ):
                return address
        raise KeyError((ep, name, key_type, value_type))

    def create_kernel(self, op_address: int, attributes: dict) -> int:
        op = self.op(op_address)
        kernel = _V()
        info = self._handle(dict(attributes))
        status = op.CreateKernelV2(op_address, ctypes.addressof(self.api), info, ctypes.byref(kernel))
        if status:
            raise FakeOrtError(self.message(status))
        return kernel.value

    def compute(self, op_address: int, kernel: int, inputs, out_device=(DEVICE_CPU, 0)):
        """Run the kernel on ``inputs`` (FakeTensor or None per input, trailing ones may be left out).
        Returns ``[(FakeTensor, buffer), ...]`` for the outputs ORT allocated (``None`` where none was),
        or raises :class:`FakeOrtError` with the kernel's message."""
        op = self.op(op_address)
        call = {
            "inputs": list(inputs),
            "handles": {},
            "outputs": [None, None],
            "out_device": out_device,
            "output_types": [op.GetOutputType(op_address, 0), op.GetOutputType(op_address, 1)],
        }
        ctx = self._handle(call)
        status = op.KernelComputeV2(kernel, ctx)
        self.last_outputs = call["outputs"]
        if status:
            raise FakeOrtError(self.message(status))
        return call["outputs"]

    def destroy_kernel(self, op_address: int, kernel: int) -> None:
        self.op(op_address).KernelDestroy(kernel)


# The fake CUDA driver's generations: which copy calls it has (fake_device_driver.c's FAKE_NO_* flags).
FAKE_DRIVER_VARIANTS = {
    "cuda13": (),  # cuMemcpyBatchAsync_v2, the 12.8 symbol, and the copy kernel's calls
    "cuda12.8": ("-DFAKE_NO_BATCH_V2",),  # the first batched copy, with failIdx
    "cuda12.0": ("-DFAKE_NO_BATCH_V2", "-DFAKE_NO_BATCH_V1"),  # no batched copy: the copy kernel
    "cuda11.0": ("-DFAKE_NO_BATCH_V2", "-DFAKE_NO_BATCH_V1", "-DFAKE_NO_KERNEL"),  # one copy per run
}


def build_fake_driver(directory: Path, variant: str = "cuda13") -> Path:
    """Compile tests/native/fake_device_driver.c (the fake CUDA/CANN driver, as ``variant`` of
    FAKE_DRIVER_VARIANTS) into ``directory``."""
    out = Path(directory) / f"libfake_device_driver_{variant}.so"
    subprocess.run(
        ["gcc", "-std=c11", "-O1", "-g", "-shared", "-fPIC", "-Wall", "-Werror", f"-I{NATIVE_LIB_DIR}",
         *FAKE_DRIVER_VARIANTS[variant], "-o", str(out), str(FAKE_DRIVER_SOURCE), "-pthread"],  # fmt: skip
        check=True,
    )
    return out


class FakeDriver:
    """The fake driver library (as the plugin dlopen's it: same path, same instance)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.lib = ctypes.CDLL(self.path)
        self.lib.fake_driver_reset.argtypes = [_V, ctypes.c_int]
        self.lib.fake_driver_fail_at.argtypes = [ctypes.c_long, ctypes.c_int]
        self.lib.fake_driver_count.argtypes = [ctypes.c_char_p]
        self.lib.fake_driver_count.restype = ctypes.c_long

    def reset(self, stream: int, has_context: bool = True) -> None:
        self.lib.fake_driver_reset(stream or None, int(has_context))

    def fail_at(self, call: int, code: int) -> None:
        self.lib.fake_driver_fail_at(call, code)

    def count(self, name: str) -> int:
        return self.lib.fake_driver_count(name.encode())
