"""Where pakv-onnx keeps files it makes: one cache directory the project controls.

``$PAKV_ONNX_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/pakv-onnx``, else
``~/.cache/pakv-onnx``. Nothing is ever written to the current directory.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "PAKV_ONNX_CACHE_DIR"


def cache_dir(*parts: str) -> Path:
    """The project's cache directory (or a subdirectory of it), created on first use."""
    root = os.environ.get(CACHE_DIR_ENV)
    if root:
        base = Path(root)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg) if xdg else Path.home() / ".cache") / "pakv-onnx"
    path = base.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def pypto_output_env(base: Path) -> dict[str, str]:
    """Environment variables that send everything PyPTO writes (outputs, logs, run records) under ``base``.

    Without them PyPTO writes ``./output``, ``~/ascend/log`` and ``~/.pypto`` on import and on
    every compile.
    """
    return {
        "PYPTO_HOME": str(base / "home" / ".pypto"),
        "TILE_FWK_OUTPUT_DIR": str(base / "output"),
        "ASCEND_PROCESS_LOG_PATH": str(base / "ascend_log"),
    }
