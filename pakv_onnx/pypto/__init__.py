"""Everything PyPTO: the GatherPaKvCache and ScatterPaKvCache kernels on an NPU and through PyPTO's CPU toolchain.

Imports neither pypto nor torch_npu until a function needs them.

=============  ==============================================================================
``kernel``     the PyPTO kernels (imports pypto): flat entry loop for Norm and PA_NZ, the
               contiguous-copy floor, the seed's nested-loop kernel for comparison
``host``       support checks, the host-built entries, choosing tiles, one kernel run
``tiles``      chunk/tile shapes, the closed-form rule, the seed's rule, the tuned-tiles cache
``adapter``    hands the real CPU tensors to pypto 0.2.0's pass-verify interpreter; caches
               the interpreter's helper library
``cases``      named cases (seed, t4096, random-N, kernel-N, dtype-/nz-NAME, features, shape:)
``runs``       one subprocess per run, run directories, memory estimate
``worker``     the subprocess body, and the persistent worker of ``pypto-cpu``
``cpu``        the ``pypto-cpu`` backend (registry module: ``pakv_onnx.kernels.pypto_cpu``), and
               the scatter's CPU route through the same worker
``scatter_*``  the ScatterPaKvCache (write) kernel: ``scatter_kernel`` (imports pypto),
               ``scatter_host`` (moves, tiles, ``scatter_in_process``), ``scatter_cases``
=============  ==============================================================================
"""

# Cache dtypes the kernels move natively, by torch name: each compiles and verifies bit-exact through
# the pypto 0.2.0 interpreter (FACTS section 8; uint16/uint32 checked by verify-kernel's list).
# Names, so the CLI offers them without importing torch; host.SUPPORTED_DTYPES holds the dtypes.
SUPPORTED_DTYPE_NAMES: tuple[str, ...] = (
    "bfloat16", "float16", "float32", "int8", "uint8", "int16", "uint16", "int32", "uint32"
)  # fmt: skip
