"""tests/device/gpu_check.py, the GPU check (never run on real hardware: no machine here has a GPU),
exercised where it can be: --dry-run builds the dtype/layout matrix, runs it through the same
sessions, IOBindings and golden comparison on the CPU execution provider, and runs the benchmark
and goal code on small CPU shapes; without --dry-run on a CPU-only onnxruntime it refuses, saying
why; the one-command shell wrapper parses."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import run_python

SCRIPT = Path(__file__).parent / "device" / "gpu_check.py"
WRAPPER = Path(__file__).parent / "device" / "gpu_check.sh"


def test_dry_run_builds_the_matrix_and_the_benchmarks_on_the_cpu(tmp_path) -> None:
    out = tmp_path / "results.json"
    result = run_python(
        "import runpy, sys; sys.argv = [sys.argv[1], *sys.argv[2:]]; runpy.run_path(sys.argv[0], run_name='__main__')",
        args=[str(SCRIPT), "--dry-run", "--quick", "--large-blocks", "16", "--repeats", "6", "--json", str(out)],
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "DRY RUN on the CPU" in result.stdout and "matrix: 13/13 bit-exact" in result.stdout, result.stdout
    data = json.loads(out.read_text())
    assert [row["case"] for row in data["bench"]][:3] == ["level0", "level8", "heads64_k128_v128"]
    assert len(data["goals"]) == 4 and all("met" in goal for goal in data["goals"])
    assert "goal stated at 262144 tokens" in data["goals"][-1]["goal"]


def test_without_a_gpu_it_refuses_saying_why() -> None:
    result = run_python(
        "import runpy, sys; sys.argv = [sys.argv[1], '--quick']; runpy.run_path(sys.argv[0], run_name='__main__')",
        args=[str(SCRIPT)],
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "has no CUDAExecutionProvider" in result.stderr or "torch sees no CUDA device" in result.stderr


def test_the_script_says_it_was_never_run_on_real_hardware_and_the_wrapper_parses() -> None:
    assert "NEVER RUN ON REAL HARDWARE" in SCRIPT.read_text() and "NEVER RUN ON REAL HARDWARE" in WRAPPER.read_text()
    bash = shutil.which("bash")
    assert bash
    assert subprocess.run([bash, "-n", str(WRAPPER)], capture_output=True).returncode == 0
    assert 'onnxruntime-gpu[cuda,cudnn]' in WRAPPER.read_text() and "--no-deps" in WRAPPER.read_text()
    assert sys.executable  # the wrapper makes its own venv; nothing here installs anything
