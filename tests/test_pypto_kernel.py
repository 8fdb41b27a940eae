"""The PyPTO kernel through PyPTO's CPU toolchain: bit-exact via the interpreter, a wrong kernel caught, tiles vs floor.

Runs PyPTO in subprocesses (:mod:`pakv_onnx.pypto.runs`) with a temporary cache directory;
the interpreter's helper library is shared (built once per machine, about a minute).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from pakv_onnx import cli
from pakv_onnx.pypto import runs

pytestmark = pytest.mark.usefixtures("temp_cache")


@pytest.mark.slow  # 18 interpreter runs
def test_verify_kernel_passes_each_layout_dtype_and_index_form(capsys):
    # Norm bf16 seed cases (64 heads x 128 included), PA_NZ int8 and fp32, Norm uint16, lengths mode,
    # random kernel cases (PA_NZ uint16, Norm fp32)
    ids = ["level0", "heads64_k128_v128", "nz-int8", "nz-float32", "dtype-uint16", "lengths", "kernel-0", "kernel-1"]
    code = cli.main(["verify-kernel", "--cases", *ids, "random-3"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count(" PASS ") == len(ids), out
    assert "SKIP random-3" in out and "32 bytes" in out  # the kernel refuses it, by name
    assert f"{len(ids)} passed, 0 failed" in out
    assert not any(runs.runs_dir().iterdir())  # passing runs leave nothing behind


@pytest.mark.slow
def test_verify_kernel_t4096(capsys):
    code = cli.main(["verify-kernel", "--cases", "t4096"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count(" PASS ") == 1, out


# The deliberate bug: the product kernel, mutated to read one cache row too far.
KERNEL_LINE = "src = entries[e, 0]"


def off_by_one_kernel_script() -> str:
    """The kernel module's own source with one line mutated, run as a verify worker."""
    source = Path(importlib.util.find_spec("pakv_onnx.pypto.kernel").origin).read_text()
    assert source.count(KERNEL_LINE) == 1, "the kernel changed: update the mutation"
    mutated = source.replace(KERNEL_LINE, KERNEL_LINE + " + 1")
    worker = (
        "\nimport sys\nfrom pakv_onnx.pypto import worker\n"
        "sys.exit(worker.worker_main(sys.argv[1], kernel_fn=gather_norm_kernel))\n"
    )
    return mutated + worker


def test_a_wrong_kernel_is_caught(tmp_path):
    script = tmp_path / "wrong_kernel.py"
    script.write_text(off_by_one_kernel_script())
    result = runs.run_in_subprocess({"mode": "verify", "case": "level0"}, worker=[sys.executable, str(script)])
    assert not result.ok
    assert "NOT bit-exact" in result.detail, result.detail  # a real mismatch, not a crash
    assert Path(result.run_dir).is_dir() and Path(result.run_dir).parent == runs.runs_dir()  # kept, in the temp cache


def _tune_json(capsys, *args: str) -> dict:
    code = cli.main(["tune", *args, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def test_tune_reports_the_floor_and_beats_the_seed_on_the_issue_shape(capsys):
    # fp16, 8 heads x 128, 64-row blocks, Q=2, T=300: the seed's 8/8 rows once beat the chosen 16/128
    result = _tune_json(
        capsys,
        *("--dtype", "float16", "--key-heads", "8", "--key-dim", "128", "--value-heads", "8", "--value-dim", "128"),
        *("--block-size", "64", "--q", "2", "--tokens", "300", "--chunks", "8", "16"),
    )
    assert result["floor_us"] > 0
    assert result["chosen_us"] <= result["seed_us"], result
    assert result["chosen_us"] <= 1.3 * result["floor_us"], result
    assert result["saved"]
    assert sum(row["chosen"] for row in result["rows"]) == 1


@pytest.mark.parametrize("case_id,chunks", [("level8", ["16", "32"]), ("t4096", ["128"]), ("heads64_k128_v128", ["2"])])
def test_chosen_tiles_are_within_1_3x_of_the_floor(capsys, case_id, chunks):
    result = _tune_json(capsys, "--case", case_id, "--chunks", *chunks, "--no-save")
    assert result["chosen_us"] <= 1.3 * result["floor_us"], result
    assert result["chosen_us"] <= result["seed_us"], result


@pytest.mark.parametrize(
    "case_id,chunks",
    [("nz-bfloat16", ["16"]), ("shape:bfloat16:1,8192:1,8192:128:1:6:PA_NZ", ["1", "8"])],  # few tokens x wide rows
)
def test_pa_nz_tiles_are_within_1_3x_of_the_floor(capsys, case_id, chunks):
    result = _tune_json(capsys, "--case", case_id, "--chunks", *chunks, "--no-save")
    assert result["seed_us"] is None  # the seed's kernel is Norm only
    assert result["chosen_us"] <= 1.3 * result["floor_us"], result
    assert result["rule_us"] is not None and result["rule_us"] <= 1.3 * result["floor_us"], result
