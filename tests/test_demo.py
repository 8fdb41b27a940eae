"""``pakv-onnx demo``: green end to end, and red when a backend is wrong."""

from __future__ import annotations

import subprocess

import onnx
import pytest
import torch

from pakv_onnx import cli, gather_pa_kv_cache, kernels, scatter_pa_kv_cache
from pakv_onnx.models.paged_model import MODEL_INPUT_NAMES, MODEL_OUTPUT_NAMES
from pakv_onnx.runtime_plugin._tensors import ONNX_TO_TORCH
from pakv_onnx.spec import INPUT_NAMES, bitwise_equal


@pytest.mark.slow  # the demo exports and runs every graph: 20-80 s on a busy machine
def test_demo_passes_end_to_end(tmp_path) -> None:
    result = subprocess.run(
        ["pakv-onnx", "demo", "--tokens", "96", "--repeats", "1", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "PASS"
    for name in ("mla", "gqa", "gqa-bs128"):
        assert (tmp_path / f"{name}.onnx").is_file()
        assert any(line.startswith(f"{name}:") for line in lines)
    for runner in ("torch eager", "plugin:native", "plugin:golden", "stock-ort"):
        assert sum(runner in line and line.rstrip().endswith("PASS") for line in lines) == 3, runner
    assert "exporting mla" in result.stderr  # progress goes to stderr
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left
    for name in ("mla", "gqa", "gqa-bs128"):
        check_saved_sample_data(tmp_path, name)


def _load(path) -> torch.Tensor:
    """A TensorProto file as a torch tensor of its element type (bf16 included)."""
    proto = onnx.load_tensor(str(path))
    dtype = ONNX_TO_TORCH[proto.data_type]
    return torch.frombuffer(bytearray(proto.raw_data), dtype=torch.uint8).view(dtype).reshape(list(proto.dims))


def check_saved_sample_data(out_dir, name: str) -> None:
    """--out keeps the graph's feeds and reference outputs; they are coherent (gather them again)."""
    inputs = {p.stem: _load(p) for p in (out_dir / f"{name}.inputs").glob("*.pb")}
    expected = {p.stem: _load(p) for p in (out_dir / f"{name}.expected").glob("*.pb")}
    assert sorted(inputs) == sorted(MODEL_INPUT_NAMES) and sorted(expected) == sorted(MODEL_OUTPUT_NAMES)
    assert inputs["key_cache"].dtype == torch.bfloat16 and inputs["hidden_states"].dtype == torch.float32
    graph = onnx.load(str(out_dir / f"{name}.onnx"))
    assert [i.name for i in graph.graph.input] == list(MODEL_INPUT_NAMES)
    written = scatter_pa_kv_cache(
        *(inputs[n] for n in ("new_key", "new_value", "key_cache", "value_cache", "slot_mapping")), backend="golden"
    )  # the step's write, then its read
    key, value = gather_pa_kv_cache(*written, *(inputs[n] for n in INPUT_NAMES[2:]), backend="golden")
    assert bitwise_equal(key, expected["key"]) and bitwise_equal(value, expected["value"])
    assert expected["output"].shape == inputs["hidden_states"].shape


@pytest.mark.slow  # the demo exports and runs every graph: 20-80 s on a busy machine
def test_demo_fails_on_a_broken_backend(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(kernels.BACKEND_MODULES, "broken", "broken_backend")
    assert cli.main(["demo", "--model", "gqa", "--tokens", "64", "--repeats", "1", "--backend", "native,broken"]) == 1
    out = capsys.readouterr().out
    broken_rows = [line for line in out.splitlines() if "plugin:broken" in line]
    assert len(broken_rows) == 2 and all(row.split()[1:3] == ["no", "no"] for row in broken_rows), out
    assert all(line.rstrip().endswith("PASS") for line in out.splitlines() if "plugin:native" in line)
    assert out.rstrip().endswith("FAIL")


@pytest.mark.slow  # the demo exports and runs every graph: 20-80 s on a busy machine
def test_demo_skips_a_pypto_cpu_that_refuses_the_graph(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The row the demo adds on its own is asked first (as ``generate`` asks): a refusal is a skip note, not a FAIL."""
    def never_called(plan, tensors) -> None:
        raise AssertionError("a refusing backend must not run")

    # Kernels for both of the step's ops, so the refusal asked of it is the one that decides.
    refusing = kernels.Backend(
        name="pypto-cpu",
        description="test",
        gather=never_called,
        scatter=never_called,
        unsupported_reason=lambda plan, cache: "too big here",
    )
    real = kernels.get_backend
    monkeypatch.setattr(kernels, "get_backend", lambda name: refusing if name == "pypto-cpu" else real(name))
    assert cli.main(["demo", "--model", "gqa", "--tokens", "64", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    skips = [line.split() for line in out.splitlines() if "plugin:pypto-cpu" in line]
    assert skips == [["plugin:pypto-cpu", "skipped:", "too", "big", "here"]] * 2, out
    assert out.rstrip().endswith("PASS")


def test_demo_runs_the_backends_given_and_adds_pypto_cpu_only_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from pakv_onnx import demo

    calls = []
    monkeypatch.setattr(demo, "run_graph", lambda graph, **options: calls.append(options) or [])
    assert cli.main(["demo", "--model", "mla", "--backend", "native,golden"]) == 0
    assert cli.main(["demo", "--model", "mla"]) == 0
    given, default = ((list(c["backends"]), c["add_pypto_cpu"]) for c in calls)
    assert given == (["native", "golden"], False)  # exactly what was asked for: no slow pypto-cpu rows
    assert default == (["native", "golden"], True)


def test_demo_rejects_unknown_backend(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["demo", "--backend", "native,nope"]) == 2
    assert "backend 'nope' is unknown" in capsys.readouterr().err


def test_demo_refuses_tokens_beyond_memory(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["demo", "--tokens", "100000"]) == 2
    err = capsys.readouterr().err
    assert "--tokens 100000 needs about" in err and "memory grows with the longest sequence squared" in err
