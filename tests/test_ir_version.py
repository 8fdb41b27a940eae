"""Every ONNX model the package writes states an IR version the oldest supported ONNX Runtime reads
(spec.MAX_IR_VERSION), whatever onnx is installed: under the installed onnx, under the newest onnx on
PyPI (a venv over this one with ``pip install --upgrade onnx``: CI reaches PyPI, and an unreachable
registry fails the test rather than skipping it), and every module that makes, exports or saves a model
goes through export.cap_ir_version."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

import ir_models
from pakv_onnx.spec import MAX_IR_VERSION

ROOT = Path(__file__).resolve().parents[1]
# Calls that make, export or save an ONNX model (a module holding one must call cap_ir_version).
MODEL_WRITERS = {"make_model", "save_model", "save", "export"}
PIP_SECONDS = 300


def test_max_ir_version_is_what_onnxruntime_1_20_reads():
    # ORT 1.20 (pyproject's floor) reads IR <= 10; onnx 1.16 (its release's onnx) writes 10.
    assert MAX_IR_VERSION == 10


def test_every_one_node_model_and_export_states_a_readable_ir_version():
    versions = {name: model.ir_version for name, model in ir_models.one_node_models().items()}
    assert versions and all(0 < v <= MAX_IR_VERSION for v in versions.values()), versions


@pytest.mark.slow
def test_exported_decoders_state_a_readable_ir_version(tmp_path):
    versions = {name: model.ir_version for name, model in ir_models.decoder_models(tmp_path).items()}
    assert set(versions) == {"export_step", "export_genai"}
    assert all(0 < v <= MAX_IR_VERSION for v in versions.values()), versions


def _writer_calls(tree: ast.AST) -> list[str]:
    """Names of the calls in ``tree`` that make, export or save an ONNX model (``x.make_model(...)``,
    ``onnx.save(...)``, ``torch.onnx.export(...)``; plain ``export(...)`` calls of the package's own
    exporter go through it already)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MODEL_WRITERS:
            owner = ast.unparse(node.func.value)
            if node.func.attr == "make_model" or owner in ("onnx", "torch.onnx"):
                found.append(f"{owner}.{node.func.attr}")
    return found


def test_every_module_that_writes_a_model_caps_its_ir_version():
    missing = {}
    for path in sorted((ROOT / "pakv_onnx").rglob("*.py")):
        source = path.read_text()
        calls = _writer_calls(ast.parse(source))
        if calls and "cap_ir_version" not in source:
            missing[str(path.relative_to(ROOT))] = calls
    assert not missing, f"these modules make or save ONNX models without cap_ir_version: {missing}"


@pytest.mark.slow
def test_newest_onnx_on_pypi_writes_readable_ir_versions(tmp_path):
    """A venv seeing this interpreter's packages, onnx upgraded to the newest release on PyPI, builds every
    kind of model the package writes (decoders included)."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    pip = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--upgrade", "--timeout", "30", "--retries", "2", "onnx"],
        capture_output=True, text=True, timeout=PIP_SECONDS,
    )  # fmt: skip
    assert pip.returncode == 0, f"pip install --upgrade onnx failed (is PyPI reachable?): {pip.stderr[-2000:]}"
    newest = subprocess.run(
        [str(python), "-m", "pip", "index", "versions", "onnx"], capture_output=True, text=True, timeout=120
    ).stdout.split("(")[1].split(")")[0]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    run = subprocess.run(
        [str(python), str(ROOT / "tests" / "ir_models.py"), "--decoders", str(tmp_path / "decoders")],
        capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["onnx"] == newest, (report["onnx"], newest)
    versions = report["models"]
    assert len(versions) == 9 and all(0 < v <= MAX_IR_VERSION for v in versions.values()), versions
    print(f"onnx {report['onnx']} (newest on PyPI; python {sys.version.split()[0]}): {versions}")
