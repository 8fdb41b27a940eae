"""The export of a Hugging Face folder reads as one pass (issue 39, item 4).

``export_genai`` goes config -> geometry -> attention replacement -> step -> folder, and each file of
``pakv_onnx/models/hf`` is entered once: following every call from one of its files into another
(the stage walk; the traced model's own forward, which runs the replaced layers inside the step, is
not part of it), no file is entered again after the walk has left it. On the tree before the issue
the walk was 19 stays in 7 files (configs.py, step.py, ort_layer.py, cache.py and generate.py
entered again and again).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import pakv_onnx.models.hf as hf_package
from pakv_onnx.models.hf import configs, genai

HF_DIR = str(Path(hf_package.__file__).parent)


def export_walk(tmp_path: Path, arch: str, **options) -> list[str]:
    """The files of models/hf that ``export_genai`` enters, in order, one entry per stay."""
    folder = configs.save_sample_folder(tmp_path / "hf", arch)
    stays: list[str] = []

    def on_call(frame, event, arg) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(HF_DIR):
            return
        callee = Path(frame.f_code.co_filename).name
        caller = frame.f_back.f_code.co_filename if frame.f_back else ""
        entered = caller != frame.f_code.co_filename and not torch.compiler.is_exporting()
        if entered and (not stays or stays[-1] != callee):
            stays.append(callee)

    sys.setprofile(on_call)
    try:
        genai.export_genai(folder, tmp_path / "out", **options)
    finally:
        sys.setprofile(None)
    return stays


def assert_one_pass(stays: list[str], expected: list[str]) -> None:
    assert stays == expected
    assert len(stays) == len(set(stays)), f"a file entered twice: {stays}"


def test_the_default_export_walks_config_geometry_replacement_step_folder(tmp_path: Path) -> None:
    stays = export_walk(tmp_path, "llama")
    assert_one_pass(stays, ["genai.py", "servable.py", "configs.py", "forms.py", "ort_layer.py", "step.py", "fusion.py"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "attention", "replacement"),
    [
        ("llama", "pakv", ["ort_layer.py", "mla.py", "gqa.py"]),  # ort_layer: the sliding-window check
        ("deepseek", "ort", ["ort_layer.py", "mla.py"]),
        ("deepseek", "pakv", ["ort_layer.py", "mla.py"]),
    ],
)
def test_every_form_walks_one_pass(tmp_path: Path, arch: str, attention: str, replacement: list[str]) -> None:
    stays = export_walk(tmp_path, arch, attention=attention)
    assert_one_pass(stays, ["genai.py", "servable.py", "configs.py", "forms.py", *replacement, "step.py", "fusion.py"])
