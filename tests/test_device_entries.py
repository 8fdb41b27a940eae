"""The CUDA and CANN entries of the library, with no device: the fake ORT runtime
(tests/fake_ort_api.py) drives RegisterCustomOps and the kernels, and a fake driver library
(tests/native/fake_device_driver.c: the CUDA driver's and AscendCL's few copy calls done with host
memcpy, each recorded) stands in for libcuda.so.1 / libascendcl.so. Each scenario of
tests/native/device_session.py runs in its own process (the library keeps its first registration
and its first opened driver). What this proves and what it cannot: docs/plugin-hosts.md."""

from __future__ import annotations

import pytest
from conftest import run_python
from fake_ort_api import FAKE_DRIVER_VARIANTS, build_fake_driver

from pakv_onnx import native_lib

SESSION = "import runpy, sys; sys.argv = ['device_session.py', *sys.argv[1:]]; runpy.run_path({path!r}, run_name='__main__')"


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory) -> str:
    return str(build_fake_driver(tmp_path_factory.mktemp("fake_driver")))


def _session(*args: str, env: dict[str, str]) -> str:
    from pathlib import Path

    path = Path(__file__).parent / "native" / "device_session.py"
    result = run_python(SESSION.format(path=str(path)), args=args, env=env, timeout=240)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    assert f"ok {args[0]}" in result.stdout, result.stdout
    return result.stdout


def _driver_env(path: str) -> dict[str, str]:
    return {"PAKV_ONNX_CUDA_DRIVER": path, "PAKV_ONNX_CANN_DRIVER": path, "FAKE_DRIVER": path}


@pytest.mark.parametrize("variant", list(FAKE_DRIVER_VARIANTS))
def test_cuda_copies_go_in_one_launch_where_the_driver_allows(variant: str, tmp_path) -> None:
    """The CUDA entries' Norm copies of one call: one cuMemcpyBatchAsync on a CUDA 13 driver (_v2) and
    on 12.8 (its first symbol, with failIdx), one launch of the embedded PTX copy kernel on a driver
    without the batched copy (12.0), one cuMemcpyDtoDAsync per run on one without either (11.0); gathers
    and scatters bit-exact on every one; PAKV_ONNX_CUDA_COPY forcing a path or naming what is missing."""
    path = str(build_fake_driver(tmp_path, variant))
    out = _session("paths", env={**_driver_env(path), "FAKE_VARIANT": variant})
    assert f"ok paths {variant}:" in out


def test_every_op_has_cpu_cuda_and_cann_entries_with_host_resident_index_inputs(fake_driver) -> None:
    # 121 pairs x 2 ops x 3 EPs, then PagedAttention's CPU entries (3 dtypes)
    assert "726 cache-op entries, 3 attention entries" in _session("entries", env=_driver_env(fake_driver))


def test_device_entries_are_bit_exact_over_every_dtype_and_layout_on_orts_stream(fake_driver) -> None:
    """Every cache dtype x layout x seq_lens form x index dtype x seq_offset, and mixed key/value
    dtypes, through both device entries: outputs equal the golden bit for bit, every driver call
    got ORT's compute stream and nothing the real driver refuses, Norm used only 1-D copies and
    PA_NZ only 2-D ones; a table of consecutive blocks is one copy per cache."""
    out = _session("matrix", env=_driver_env(fake_driver))
    assert "368 device runs" in out  # (11 dtypes x 2 x 2 x 2 x 2 + 8 mixed) x 2 EPs
    assert "shape reads 0 by reference" in out  # API 17: through OrtTensorTypeAndShapeInfo


def test_from_api_24_the_entries_read_each_inputs_dims_by_reference(fake_driver) -> None:
    """On a runtime of API >= 24 every kernel reads an input's element type and dims in one call that
    allocates nothing (GetTensorElementTypeAndShapeDataReference, the value's own dims): the same matrix,
    bit-exact on every entry, and not one OrtTensorTypeAndShapeInfo made."""
    out = _session("matrix", "24", env=_driver_env(fake_driver))
    assert "368 device runs" in out
    reads = out.split("shape reads ")[1].split()
    assert int(reads[0]) > 1000 and reads[3:5] == ["0", "by"], out[-300:]


def test_scatter_device_entries_are_bit_exact_on_orts_stream(fake_driver) -> None:
    """ScatterPaKvCache's CUDA and CANN entries, every dtype and layout: the pool copied to ORT's
    output and the rows written there with device copies on ORT's stream, bit-exact vs the per-token reference."""
    out = _session("scatter", env=_driver_env(fake_driver))
    assert "44 scatter device runs" in out  # 11 dtypes x 2 layouts x 2 EPs


def test_device_errors_are_ort_errors_and_refused_calls_write_nothing(fake_driver) -> None:
    _session("errors", env=_driver_env(fake_driver))


def test_a_missing_driver_is_an_ort_error_naming_the_library(tmp_path) -> None:
    missing = str(tmp_path / "libcuda-not-here.so.1")
    out = _session("missing", env={"PAKV_ONNX_CUDA_DRIVER": missing, "PAKV_ONNX_CANN_DRIVER": missing + "-cann"})
    assert missing in out


@pytest.mark.parametrize("api", ["17", "16"])
def test_large_copies_use_orts_parallel_for_small_ones_never(api: str) -> None:
    """Above the size threshold the CPU entry hands its parts to KernelContext_ParallelFor (API >= 17),
    below it there is no parallel region; on API 16 (ORT 1.16) it uses its own threads."""
    _session("parallel", api, env={"PAKV_ONNX_PARALLEL_MIN_BYTES": "4096"})


def test_python_backends_get_device_buffers_and_orts_stream_on_device_entries() -> None:
    _session("bridge", env={})


def test_request_mirror_has_the_stream() -> None:
    assert [name for name, _ in native_lib.Request._fields_][-2:] == ["stream", "error"]
