"""``pakv-onnx cases``: listing, passing, failing and bad arguments."""

from __future__ import annotations

import subprocess

import pytest

from pakv_onnx import cli, kernels


def test_list(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["cases", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 12 and lines[0].startswith("level0") and "heads64_k128_v128" in lines[-1]


def test_pass_prints_precision_pass(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["cases", "heads1_k128_v64", "--random", "3", "--backend", "torch"]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS ") == 4 and out.rstrip().endswith("[PRECISION_PASS]")


def test_broken_backend_fails(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(kernels.BACKEND_MODULES, "broken", "broken_backend")
    assert cli.main(["cases", "heads1_k128_v64", "--backend", "broken"]) == 1
    out = capsys.readouterr().out
    assert "FAIL heads1_k128_v64" in out and "mismatch in key, value" in out
    assert out.rstrip().endswith("[PRECISION_FAIL]")


def test_unknown_case_id_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["cases", "level42"]) == 2
    assert "unknown case id 'level42'" in capsys.readouterr().err


def test_unknown_backend_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["cases", "level0", "--backend", "fastest"]) == 2
    assert "backend 'fastest' is unknown" in capsys.readouterr().err


def test_console_script_help() -> None:
    for argv in (["--help"], ["cases", "--help"]):
        result = subprocess.run(["pakv-onnx", *argv], capture_output=True, text=True, check=True)
        assert "usage: pakv-onnx" in result.stdout
