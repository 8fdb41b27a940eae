"""``pakv-onnx demo``: green end to end, and red when a backend is wrong."""

from __future__ import annotations

import subprocess

import pytest

from pakv_onnx import cli, kernels


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


def test_demo_fails_on_a_broken_backend(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(kernels.BACKEND_MODULES, "broken", "broken_backend")
    assert cli.main(["demo", "--model", "gqa", "--tokens", "64", "--repeats", "1", "--backend", "native,broken"]) == 1
    out = capsys.readouterr().out
    broken_rows = [line for line in out.splitlines() if "plugin:broken" in line]
    assert len(broken_rows) == 2 and all(row.split()[1:3] == ["no", "no"] for row in broken_rows), out
    assert all(line.rstrip().endswith("PASS") for line in out.splitlines() if "plugin:native" in line)
    assert out.rstrip().endswith("FAIL")


def test_demo_rejects_unknown_backend(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["demo", "--backend", "native,nope"]) == 2
    assert "backend 'nope' is unknown" in capsys.readouterr().err


def test_demo_refuses_tokens_beyond_memory(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["demo", "--tokens", "100000"]) == 2
    err = capsys.readouterr().err
    assert "--tokens 100000 needs about" in err and "memory grows with T^2" in err
