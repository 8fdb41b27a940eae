"""tests/device/gpu_check.py, the GPU check (run on a GPU once before issue 36; this version not yet),
exercised where it can be: --dry-run builds the gather and scatter matrices, runs them through the
same sessions, IOBindings and golden comparisons on the CPU execution provider, runs the benchmark and
goal code on small CPU shapes, the PagedAttention comparison (the plugin standing in for ORT's CUDA
kernel) and the decoder part (or its skip message); without --dry-run on a CPU-only onnxruntime it
refuses, saying why; the sessions it would make on a GPU are the ones ORT 1.31 accepts; the one-command
shell wrapper parses and has its offline mode."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_python

SCRIPT = Path(__file__).parent / "device" / "gpu_check.py"
WRAPPER = Path(__file__).parent / "device" / "gpu_check.sh"


@pytest.fixture(scope="module")
def gpu_check():
    """The script's module (its parts' folder on sys.path, as the script puts it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # ~16 s: every part's code on the CPU
def test_dry_run_runs_every_part_on_the_cpu(tmp_path) -> None:
    out = tmp_path / "results.json"
    result = run_python(
        "import runpy, sys; sys.argv = [sys.argv[1], *sys.argv[2:]]; runpy.run_path(sys.argv[0], run_name='__main__')",
        args=[str(SCRIPT), "--dry-run", "--quick", "--large-blocks", "16", "--repeats", "6", "--json", str(out)],
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    stdout = result.stdout
    assert "DRY RUN on the CPU" in stdout and "gather matrix: 13/13 bit-exact" in stdout, stdout
    assert "scatter matrix: 22/22 bit-exact" in stdout, stdout
    assert "paged attention (ORT's CUDA kernel vs the plugin): 27/27 agree" in stdout, stdout
    assert "decoders:" in stdout or "| decoder |" in stdout, stdout
    data = json.loads(out.read_text())
    assert [row["case"] for row in data["bench"]][:3] == ["level0", "level8", "heads64_k128_v128"]
    goals = [goal for goal in data["goals"] if not goal.get("reported")]
    assert len(goals) == 4 and all("met" in goal for goal in goals)
    # ORT's own Gather beside each seed row: the per-run floor of a session, timed, never a goal
    assert sum(1 for goal in data["goals"] if goal.get("reported") and "ORT's Gather" in goal["goal"]) == 3
    assert "goal stated at 262144 tokens" in data["goals"][-1]["goal"]
    assert len(data["attention"]["rows"]) == 27 and not data["attention"]["refused_by_ort"]
    assert all(row["caches_equal"] for row in data["attention"]["rows"])
    decoders = data["decoders"]
    if not decoders["skipped"]:  # onnxruntime_genai installed: one CPU folder against itself, teacher-forced once
        (row,) = decoders["rows"]
        assert row["identical"], row
        (forced,) = row["teacher_forced"]
        assert forced["cpu_argmax_is_its_token"] and forced["max_logit_difference"] == 0.0, forced


def test_without_a_gpu_it_refuses_saying_why() -> None:
    result = run_python(
        "import runpy, sys; sys.argv = [sys.argv[1], '--quick']; runpy.run_path(sys.argv[0], run_name='__main__')",
        args=[str(SCRIPT)],
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "has no CUDAExecutionProvider" in result.stderr or "torch sees no CUDA device" in result.stderr


def test_gpu_sessions_are_ones_ort_1_31_accepts(gpu_check) -> None:
    """FACTS §14's two failures: CPUExecutionProvider listed with disable_cpu_ep_fallback (ORT 1.31
    refuses the session) and a model of IR version 14 (ORT 1.31 reads at most 13)."""
    import gpu_copies

    from pakv_onnx.cases import random_case
    from pakv_onnx.export import make_gather_model_for

    target = gpu_check.Target(dry_run=False, device_id=0)
    assert [p if isinstance(p, str) else p[0] for p in target.providers] == ["CUDAExecutionProvider"]
    case = random_case(1)
    model = make_gather_model_for(*case.inputs(), **case.attributes(), fallback=False, shapes=None)
    model.ir_version = 14  # what onnx 1.23 writes
    assert gpu_copies.ort_readable(model).ir_version == 10
    with pytest.raises(AssertionError, match="IR version 14"):
        gpu_check.Target(dry_run=True, device_id=0).session(model.__class__(ir_version=14))


def test_a_disagreeing_part_fails_the_run(gpu_check) -> None:
    ok = {"matrix": {"exact": 3, "cases": 3}, "scatter": {"exact": 2, "cases": 2}, "attention": {"agree": 4, "cases": 4},
          "decoders": {"rows": [{"case": "llama fp16", "identical": True}]}, "goals": [{"met": False}]}  # fmt: skip
    assert not gpu_check.failed(ok, strict=False) and gpu_check.failed(ok, strict=True)
    tie = {"request": 1, "at": 7, "near_tie": True}
    assert not gpu_check.failed({**ok, "decoders": {"rows": [{"case": "deepseek fp16", "identical": False,
                                                             "teacher_forced": [tie]}]}}, strict=False)  # fmt: skip
    for broken in ({"attention": {"agree": 3, "cases": 4}}, {"scatter": {"exact": 1, "cases": 2}},
                   {"decoders": {"rows": [{"case": "qwen3 bf16", "identical": False}]}},
                   {"decoders": {"rows": [{"case": "qwen3 bf16", "identical": False,
                                           "teacher_forced": [{"request": 0, "at": 3, "near_tie": False}]}]}},
                   {"decoders": {"rows": [{"case": "llama fp16", "error": "export failed"}]}}):  # fmt: skip
        assert gpu_check.failed({**ok, **broken}, strict=False), broken


def test_the_wrapper_parses_and_installs_offline_from_carried_wheels() -> None:
    text = WRAPPER.read_text()
    bash = shutil.which("bash")
    assert bash
    assert subprocess.run([bash, "-n", str(WRAPPER)], capture_output=True).returncode == 0
    assert 'onnxruntime-gpu[cuda,cudnn]' in text and "--no-deps" in text
    assert "PAKV_GPU_WHEELS" in text and "--no-index" in text and "--target" in text
    help_text = SCRIPT.read_text()
    assert "split -b 50M" in help_text and "PAKV_GPU_WHEELS=/tmp/wheels" in help_text
    assert sys.executable  # the wrapper makes its own venv or uses the machine's python; nothing here installs
