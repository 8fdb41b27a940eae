"""Every ```python block of README.md runs as written, each in a fresh empty directory.

A block whose first line says ``no torch`` runs in a process where ``import torch`` fails, so
the onnxruntime-only example really needs nothing but onnxruntime, numpy and onnx.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)
NO_TORCH_PRELUDE = "import sys\nsys.modules['torch'] = None  # README block says: no torch\n"


def python_blocks() -> list[tuple[int, str]]:
    """(line number, source) of each ```python block."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in BLOCK.finditer(text)]


def test_readme_has_the_documented_python_blocks() -> None:
    sources = [source for _, source in python_blocks()]
    assert len(sources) >= 4
    assert any("no torch" in s.splitlines()[0] for s in sources)  # the onnxruntime-only example


@pytest.mark.parametrize(("line", "source"), python_blocks(), ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_readme_python_block_runs(line: int, source: str, tmp_path: Path) -> None:
    prelude = NO_TORCH_PRELUDE if "no torch" in source.splitlines()[0] else ""
    script = tmp_path / f"readme_line{line}.py"
    script.write_text(prelude + source)
    result = subprocess.run(
        [sys.executable, script.name], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"README.md block at line {line} failed:\n{result.stderr[-4000:]}"
