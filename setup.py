"""Build hook: compiles the C library (plain C, no Python API, no ORT header) and the front's extension.

Everything else about the package lives in pyproject.toml. The library is built as
``pakv_onnx/native_lib/libpakv_ort.so``, a plain shared library that ONNX Runtime dlopen's as a
custom-op library and that the ``native`` backend calls through ctypes, both for ``pip install .``
and editable installs (``pip install -e .`` builds it in place).

Sources (pakv_onnx/native_lib/):
    pakv_err.c       errors: a failed check's message and kind (the lowest unit: it stands on none)
    pakv_core.c      the copy core: memory-safety checks, memcpy runs, thread split (no ORT, no Python)
    pakv_writable.c  whether the bytes a write goes to can be written, asked of the kernel (never a signal)
    pakv_attention.c the attention core's run: a checked plan cut into parts, on ORT's pool or this thread
    pakv_attention_check.c  the attention core's plan checks: types, features, every extent it reads
    pakv_attention_part.c   one part of a paged attention: its state, queries, finished rows, merges
    pakv_attention_walk.c, pakv_attention_walk16.c  the hot loop (pakv_attention_walk.h) in 8- and
                     16-float vectors: K transposed per chunk, register-blocked scores and outputs
    pakv_contract_records.c  what every op's validator shares: records, caches, index tensors, output rules
    pakv_contract_gather.c, pakv_contract_scatter.c, pakv_contract_attention.c
                     the contract's validator, one unit per op: every rule and its message, records -> plan
    pakv_ort.c       the ORT kernels: attributes, ORT tensors -> records -> the cores
    pakv_ort_register.c  the ops ORT reads (types, counts, alias map), one domain per backend, RegisterCustomOps
    pakv_bridge.c    the Python bridge: backend names, the callback, exit handling
    pakv_device.c    device copies: the CUDA / CANN driver opened with dlopen on first use (no link-time
                     dependency), async device-to-device copies of a plan on ORT's stream
    pakv_device_cuda.c  a CUDA call's copies in one launch: one cuMemcpyBatchAsync, else one launch of
                     the copy kernel whose PTX pakv_cuda_copy_ptx.h embeds (generated from pakv_cuda_copy.cu;
                     never compiled here: no nvcc needed), else one copy per run
    pakv_ep.c        execution providers: the CPU/CUDA/CANN entries' table, host-resident index inputs,
                     ORT's compute stream and intra-op pool (KernelContext_ParallelFor)

and, apart from the library, ``pakv_onnx/native_lib/_front.abi3.so`` from pakv_front.c: a CPython
extension on the stable ABI (3.10+) that writes the validator's tensor records from torch tensors
and calls the library's validator and copy without ctypes (the Python front's hot path). The
library stays free of Python; the wheel is tagged ``cp310-abi3-<platform>``.
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

LIBRARY = "pakv_onnx.native_lib.libpakv_ort"
FRONT = "pakv_onnx.native_lib._front"
LIBRARY_DIR = os.path.join("pakv_onnx", "native_lib")
SOURCES = ["pakv_err.c", "pakv_core.c", "pakv_writable.c", "pakv_attention.c", "pakv_attention_check.c", "pakv_attention_part.c", "pakv_attention_walk.c", "pakv_attention_walk16.c", "pakv_contract_records.c", "pakv_contract_gather.c", "pakv_contract_scatter.c", "pakv_contract_attention.c", "pakv_contract_fused.c", "pakv_contract_fused_values.c", "pakv_fused.c", "pakv_ort.c", "pakv_ort_fused.c", "pakv_ort_register.c", "pakv_bridge.c", "pakv_device.c", "pakv_device_cuda.c", "pakv_ep.c"]
HEADERS = [
    "ort_abi.h",
    "pakv_core.h",
    "pakv_contract.h",
    "pakv_contract_records.h",
    "pakv_contract_fused_internal.h",
    "pakv_fused.h",
    "pakv_float.h",
    "pakv_vec.h",
    "pakv_attention_core.h",
    "pakv_attention_walk.h",
    "pakv_attention_decode.h",
    "pakv_bridge.h",
    "pakv_dtypes.h",
    "device_abi.h",
    "pakv_cuda_copy_ptx.h",
    "pakv_device_internal.h",
    "pakv_device.h",
    "pakv_ep.h",
    "pakv_ort.h",
]
COMPILE_ARGS = [
    "-std=c11",
    "-O3",
    "-fvisibility=hidden",
    # No float traps are ever enabled: lets the attention's clamps be branch-free (vectorized).
    "-fno-trapping-math",
    # Fused multiply-adds where the CPU has them (the attention's dot products; -std=c11 turns them off).
    "-ffp-contract=fast",
    # Square roots as one instruction (the fused op's RMSNorm, 1 / sqrt(head_size)), never a libm call:
    # no math function sets errno here.
    "-fno-math-errno",
    "-pthread",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
]


class BuildLibrary(build_ext):
    """build_ext that names the library ``libpakv_ort.so`` (not a CPython extension module name)."""

    def get_ext_filename(self, ext_name):
        if ext_name.split(".")[-1] == LIBRARY.split(".")[-1]:  # called with the full or the last name
            suffix = ".dylib" if sys.platform == "darwin" else ".so"
            return os.path.join(*ext_name.split(".")[:-1], "libpakv_ort" + suffix)
        return super().get_ext_filename(ext_name)

    def get_export_symbols(self, ext):
        if ext.name == LIBRARY:
            return ["RegisterCustomOps"]
        return super().get_export_symbols(ext)


library = Extension(
    LIBRARY,
    sources=[os.path.join(LIBRARY_DIR, name) for name in SOURCES],
    depends=[os.path.join(LIBRARY_DIR, name) for name in HEADERS],
    extra_compile_args=COMPILE_ARGS,
    extra_link_args=["-pthread", "-ldl"],  # dlopen (in libc itself on glibc >= 2.34)
    py_limited_api=False,
)


front = Extension(
    FRONT,
    sources=[os.path.join(LIBRARY_DIR, "pakv_front.c")],
    depends=[os.path.join(LIBRARY_DIR, "pakv_contract.h"), os.path.join(LIBRARY_DIR, "pakv_core.h")],
    extra_compile_args=COMPILE_ARGS,
    define_macros=[("Py_LIMITED_API", "0x030A0000")],
    py_limited_api=True,
)


class PlatformWheel(bdist_wheel):
    """Tag the wheel ``cp310-abi3-<platform>``: the plugin is a plain C library with no Python ABI
    and the front's extension uses only the stable ABI of Python 3.10.

    So one wheel serves every supported Python on a platform; the platform tag stays, since both
    are native code.
    """

    def get_tag(self):
        _python, _abi, platform = super().get_tag()
        return "cp310", "abi3", platform


setup(ext_modules=[library, front], cmdclass={"build_ext": BuildLibrary, "bdist_wheel": PlatformWheel})
