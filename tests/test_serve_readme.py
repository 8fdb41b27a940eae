"""The README's serving example runs as written: its bash block (the sample folder, the export, the
server in the background, the curl) in a fresh directory, then its openai block against that server.
The one change: port 8000 (the block's `--port 8000` and URLs) becomes a free loopback port (others may use 8000 on a shared machine). The
bash block runs in a session of its own; the server it leaves in the background is killed with it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from serve_helpers import needs
from test_readme import NEEDS_SERVER, README, ROOT

BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```$", re.DOTALL | re.MULTILINE)
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serving_blocks() -> tuple[str, str]:
    text = README.read_text()
    bash = [b for b in BASH_BLOCK.findall(text) if "pakv-onnx serve" in b]
    python = [b for b in PYTHON_BLOCK.findall(text) if b.startswith(NEEDS_SERVER)]
    assert len(bash) == 1 and len(python) == 1, "the README has one serving bash block and one openai block"
    return bash[0], python[0]


@pytest.mark.slow  # an export and a server start
def test_readme_serving_example_runs(tmp_path: Path) -> None:
    for module in ("fastapi", "uvicorn", "openai", "onnxruntime_genai"):
        needs(module)
    bash, python = serving_blocks()
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # `pakv-onnx` is the installed script (pip install -e: this checkout, as PYTHONPATH also says)
    script = "set -euo pipefail\n" + bash.replace("8000", port)
    # Files, not pipes: the server the block leaves running keeps its output open after the block ends.
    out_file, err_file = tmp_path / "stdout", tmp_path / "stderr"
    with out_file.open("w") as stdout, err_file.open("w") as stderr:
        shell = subprocess.Popen(
            ["bash", "-c", script], cwd=tmp_path, env=env, stdout=stdout, stderr=stderr, start_new_session=True
        )
    try:
        shell.wait(300)
        out, err = out_file.read_text(), err_file.read_text()
        assert shell.returncode == 0, err[-3000:]
        assert '"object":"text_completion"' in out and '"finish_reason":"length"' in out, out[-2000:]
        run = subprocess.run(
            [sys.executable, "-c", python.replace("8000", port)], check=False, cwd=tmp_path, env=env, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        lines = run.stdout.splitlines()
        assert re.fullmatch(r"(t\d+ ?)+", lines[0]) and re.fullmatch(r"(t\d+ ?)+", lines[1]), run.stdout
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)  # the server the block left in the background
        shell.wait(30)
