"""The C library (``libpakv_ort.so``): where it is, how to load it, its ABI as ctypes types, and the
plan runners over it.

One shared library serves two callers, neither of which imports the other:

* :mod:`pakv_onnx.validator` hands calls to the C validator, :mod:`pakv_onnx.kernels.native` runs
  its plans in the copy core (:func:`run_plan`, :func:`run_scatter`) and the attention core
  (:func:`run_attention`);
* :mod:`pakv_onnx.runtime_plugin` hands the file to ONNX Runtime (``register_custom_ops_library``)
  and installs the Python callback for Python backends (:class:`Request`).

ORT dlopen's the same real path, so it gets the same loaded library (and the same callback).

This package's Python side, one job per module (this file only gathers their names):

* ``_abi.py``: the ABI, each part written once: the struct mirrors (a field table per struct, from
  which ``struct`` formats and field positions derive) and one prototype table of every export;
* ``_loading.py``: the library's path and its loading: prototypes declared, ABI version and struct
  sizes checked against the mirrors (a stale build is refused with a message saying how to rebuild);
* ``_runners.py``: the validator's calls and the cores' runs (the hot ones through the ``_front``
  extension, pakv_front.c).

The C sources (this directory; docs/architecture.md names every unit and what it stands on):
``pakv_err.c`` errors, ``pakv_core.[ch]`` the copy core and ``pakv_writable.c`` the writability probe
(no ORT, no Python), ``pakv_attention*.c`` the attention core of both paged-attention ops,
``pakv_contract_*.c`` the contract's validator (every rule and its message), ``pakv_fused.c``
com.microsoft::PagedAttention's prologue, ``pakv_ort.[ch]`` / ``pakv_ort_fused.c`` the ORT kernels and
``pakv_ort_register.c`` the ops ORT reads, ``pakv_bridge.[ch]`` the Python bridge, ``pakv_ep.[ch]`` the
execution providers, ``pakv_device.[ch]`` the device copies through the CUDA / CANN driver (opened with
dlopen; ``device_abi.h``), ``pakv_dtypes.h`` the cache dtype table (checked against
:data:`pakv_onnx.spec.CACHE_DTYPES` by a test), ``ort_abi.h`` the ORT ABI subset.
"""

from __future__ import annotations

from pakv_onnx.native_lib._abi import (
    ABI_VERSION,
    ATTENTION_PLAN_FIELD_AT,
    ATTENTION_PLAN_FORMAT,
    CALLBACK,
    DEVICE_LEN,
    ERR_TYPE,
    ERR_VALUE,
    ERROR_LEN,
    FUSED_RECORDS,
    FUSED_STRING_LEN,
    LAYOUT_NORM,
    LAYOUT_NZ,
    MAX_RANK,
    NUM_INPUTS,
    PLAN_FIELD_AT,
    PLAN_FORMAT,
    PROTOTYPES,
    SCATTER_PLAN_FIELD_AT,
    SCATTER_PLAN_FORMAT,
    SIGNATURES,
    TENSOR_RECORD,
    AttentionCall,
    AttentionPlan,
    FusedAttributes,
    FusedCall,
    FusedPlan,
    GatherCall,
    LibraryABIError,
    Plan,
    Request,
    ScatterCall,
    ScatterPlan,
    Tensor,
    records_packing,
)
from pakv_onnx.native_lib._loading import LIBRARY_NAME, LibraryNotBuiltError, check_abi, declare, library_path, load
from pakv_onnx.native_lib._runners import (
    CUDA_COPY_PATHS,
    check_attention_output_call,
    check_buffer_writable,
    check_fused_outputs_call,
    check_fused_writable,
    check_gather_outputs_call,
    check_scatter_writable,
    cuda_copy_paths,
    fast,
    front,
    fused_defaults,
    fused_scratch_needed,
    fused_string_attribute,
    plan_attention_call,
    plan_fused_call,
    plan_gather_call,
    plan_scatter_call,
    request_output,
    run_attention,
    run_fused,
    run_gather,
    run_plan,
    run_scatter,
)

# Session config entry the library writes on the SessionOptions it is registered on (pakv_ort.c).
CONFIG_KEY_BACKEND = "pakv_onnx.backend"
# Session config entry opting a registration into the write op's alias route ("1"; the library writes "0" or
# "1" when it registers: pakv_ort_register.c).
CONFIG_KEY_ALIAS = "pakv_onnx.alias_caches"
