"""Backend ``pypto-cpu``: the PyPTO kernel through SIM + pass-verify, through the API and through ONNX Runtime."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from onnx_graphs import feeds_for_case

from pakv_onnx import gather_pa_kv_cache, kernels, runtime_plugin
from pakv_onnx.export.builder import make_gather_model
from pakv_onnx.pypto import cases, cpu, runs
from pakv_onnx.spec import bitwise_equal

pytestmark = pytest.mark.usefixtures("temp_cache")


def _assert_golden(key, value, case):
    golden_key, golden_value = case.golden()
    assert bitwise_equal(key, golden_key), case.case_id
    assert bitwise_equal(value, golden_value), case.case_id


def test_is_registered_but_not_in_auto():
    assert "pypto-cpu" in kernels.backend_names()
    assert "pypto-cpu" not in kernels.AUTO_PREFERENCE
    assert kernels.get_backend("pypto-cpu").unavailable_reason() is None


def test_api_calls_are_bit_exact_and_reuse_one_worker():
    pids = set()
    for case_id in ("kernel-1", "nz-bfloat16", "dtype-int8"):
        case = cases.build_case(case_id)
        key, value = gather_pa_kv_cache(*case.inputs(), **case.attributes(), backend="pypto-cpu")
        _assert_golden(key, value, case)
        pids.add(cpu.worker_pid())
    assert len(pids) == 1 and None not in pids


def test_a_failed_call_restarts_the_worker_and_names_the_log(monkeypatch):
    case = cases.build_case("kernel-1")
    gather_pa_kv_cache(*case.inputs(), **case.attributes(), backend="pypto-cpu")
    first = cpu.worker_pid()
    # A request the worker cannot load: the call fails with its detail and the log path.
    monkeypatch.setattr(cpu, "_replan_inputs", lambda plan, k, v: {"tensors": (), "attributes": {}})
    with pytest.raises(cpu.PyptoCpuError, match=r"log kept: .*run.log") as failure:
        gather_pa_kv_cache(*case.inputs(), **case.attributes(), backend="pypto-cpu")
    assert cpu.worker_pid() is None
    kept_log = Path(str(failure.value).rsplit("log kept: ", 1)[1].rstrip(")"))
    assert kept_log.is_file() and kept_log.parent.parent == runs.runs_dir()  # with the failed runs, bounded
    monkeypatch.undo()
    key, value = gather_pa_kv_cache(*case.inputs(), **case.attributes(), backend="pypto-cpu")
    _assert_golden(key, value, case)
    assert cpu.worker_pid() not in (None, first)


@pytest.mark.parametrize("case_id", ["nz-int8", "kernel-2"])
def test_ort_session_runs_the_kernel_bit_exact(case_id):
    case = cases.build_case(case_id)
    model = make_gather_model(
        case.key_cache.dtype,
        cache_mode=case.cache_mode,
        is_seq_lens_cumsum=case.is_seq_lens_cumsum,
        index_dtypes=(case.block_tables.dtype, case.seq_lens.dtype, case.seq_offset.dtype),
    )
    session = runtime_plugin.make_session(model.SerializeToString(), backend="pypto-cpu")
    outputs = runtime_plugin.run(session, feeds_for_case(case))
    _assert_golden(outputs["key"], outputs["value"], case)


def test_unsupported_calls_are_refused_by_name():
    case = cases.build_case("level0")
    key, value = (c.view(torch.uint8).view(torch.float8_e5m2) for c in (case.key_cache, case.value_cache))
    with pytest.raises(kernels.BackendUnavailableError, match=r"pypto-cpu.*float8_e5m2.*pass-verify"):
        gather_pa_kv_cache(key, value, case.block_tables, case.seq_lens, case.seq_offset, backend="pypto-cpu")
