"""The Python side of the device entries, on a CPU: ORT buffers as torch tensors through DLPack
(the CPU form of the capsule the CUDA / NPU paths use), the stream context's no-op cases, binding
device tensors, and the pypto backend refusing caches in host memory (it used to copy both whole
caches to the NPU and back on every call). The device entries themselves: test_device_entries.py."""

from __future__ import annotations

import gc

import pytest
import torch

from pakv_onnx import kernels
from pakv_onnx.cases import random_case
from pakv_onnx.kernels import pypto_nd
from pakv_onnx.plans import GatherTensors
from pakv_onnx.runtime_plugin import _device, bind
from pakv_onnx.spec import CACHE_DTYPES
from pakv_onnx.validator import plan_gather


@pytest.mark.parametrize("dtype", [d.torch_dtype for d in CACHE_DTYPES])
def test_a_dlpack_view_is_the_same_memory_in_every_contract_dtype(dtype: torch.dtype) -> None:
    base = torch.arange(2 * 3 * 32, dtype=torch.uint8).view(dtype)
    base = base[: (base.numel() // 6) * 6].reshape(2, 3, -1)
    tensor = _device.tensor_at(base.data_ptr(), tuple(base.shape), dtype, "cpu")
    assert tensor.dtype == dtype and tensor.shape == base.shape and tensor.data_ptr() == base.data_ptr()
    assert torch.equal(tensor.view(torch.uint8), base.view(torch.uint8))
    del tensor
    gc.collect()  # the capsule's block goes to libc free, no Python call back


def test_dlpack_views_of_nothing_and_of_unknown_devices() -> None:
    assert _device.tensor_at(0, (0, 4), torch.bfloat16, "cpu").shape == (0, 4)
    with pytest.raises(ValueError, match="no DLPack device type for 'xla:0'"):
        _device.tensor_at(1, (1,), torch.uint8, "xla:0")
    assert _device.split_device("npu:3") == ("npu", 3) and _device.split_device("cpu") == ("cpu", 0)
    assert _device.DLPACK_DEVICE_TYPES == {"cpu": 1, "cuda": 2, "npu": 12}  # npu: kDLExtDev -> PrivateUse1


def test_stream_context_is_a_no_op_on_the_cpu_or_without_a_stream() -> None:
    with _device.stream_context("cpu", 1234), _device.stream_context("cuda:0", 0):
        pass


def test_bind_refuses_a_device_ort_cannot_bind() -> None:
    class Session:
        def io_binding(self):
            return type("Binding", (), {"bind_input": lambda *a: None})()

    with pytest.raises(ValueError, match="key_cache is on meta: ORT binds cpu, cuda .* or npu"):
        bind(Session(), {"key_cache": torch.empty(2, device="meta")})


def test_pypto_refuses_caches_in_host_memory_saying_to_use_the_cann_ep(monkeypatch) -> None:
    case = random_case(11, dtype=torch.bfloat16)
    plan = plan_gather(*case.inputs(), **case.attributes())
    reason = pypto_nd.unsupported_reason(plan, case.key_cache)
    assert "caches are in host memory (cpu)" in reason and "CANNExecutionProvider" in reason
    assert "enable_cann_graph=False" in reason
    key_out, value_out = (torch.empty_like(t) for t in case.golden())
    with pytest.raises(ValueError, match="does not copy whole caches"):
        pypto_nd.gather_pypto(plan, GatherTensors(case.key_cache, case.value_cache, key_out, value_out))
    # Even where pypto could run, auto never picks it for host caches (it used to copy them to the NPU).
    pypto = kernels.get_backend("pypto")
    monkeypatch.setitem(kernels._availability, id(pypto), (pypto, None))
    assert kernels.resolve_backend("auto", plan, case.key_cache, case.value_cache).name == "native"
    with pytest.raises(kernels.BackendUnavailableError, match="host memory.*backends that can: native"):
        kernels.resolve_backend("pypto", plan, case.key_cache, case.value_cache)
