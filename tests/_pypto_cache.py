"""A temporary cache directory for the PyPTO tests; the interpreter's helper library stays shared.

The helper build takes about a minute, so it lives in the user's real cache (built once per
machine); every run directory, log, tuned-tiles file and pypto-cpu worker of the tests goes
to a temporary directory removed with the test module.
"""

from __future__ import annotations

import os

import pytest

from pakv_onnx.paths import CACHE_DIR_ENV, cache_dir


@pytest.fixture(scope="module")
def temp_cache(tmp_path_factory):
    """Point the project cache at a fresh temporary directory for one test module."""
    from pakv_onnx.pypto import cpu
    from pakv_onnx.pypto.adapter import HELPER_DIR_ENV

    shared_helper = os.environ.get(HELPER_DIR_ENV) or str(cache_dir("pypto", "calculator"))
    path = tmp_path_factory.mktemp("pakv-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_DIR_ENV, str(path))
        patch.setenv(HELPER_DIR_ENV, shared_helper)
        yield path
        cpu._stop_worker()  # noqa: SLF001  (its run directory is in this cache)
