"""Callbacks into Python stop cleanly at interpreter exit (each scenario in its own interpreter)."""

from __future__ import annotations

import subprocess
import textwrap

from conftest import run_python

SETUP = """
import threading, time
import torch
from pakv_onnx import runtime_plugin
from pakv_onnx.cases import random_case
from onnx_graphs import feeds_for_case, model_for_case
case = random_case(5, dtype=torch.bfloat16)
session = runtime_plugin.make_session(model_for_case(case), backend="golden")
feeds = feeds_for_case(case)
runtime_plugin.run(session, feeds)
"""


def run_script(body: str) -> subprocess.CompletedProcess:
    return run_python(textwrap.dedent(SETUP) + textwrap.dedent(body), timeout=120)


def test_exit_while_threads_still_call_python_backends() -> None:
    result = run_script(
        """
        calls = []
        def hammer():
            deadline = time.perf_counter() + 1.0
            while time.perf_counter() < deadline:
                runtime_plugin.run(session, feeds)
                calls.append(1)
        threads = [threading.Thread(target=hammer) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.2)
        print("main done", flush=True)
        # the interpreter now waits for the threads, then runs the plugin's atexit hook
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "main done" in result.stdout


def test_after_shutdown_python_backends_fail_with_an_ort_error_not_a_crash() -> None:
    result = run_script(
        """
        from pakv_onnx.runtime_plugin import _python_backend
        _python_backend._shutdown()  # what atexit does
        try:
            runtime_plugin.run(session, feeds)
            print("ran after shutdown")
        except Exception as err:
            print("ORT error:", err)
        native = runtime_plugin.make_session(model_for_case(case), backend="native")
        print("native still works:", sorted(runtime_plugin.run(native, feeds)))
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ORT error:" in result.stdout and "interpreter is shutting down" in result.stdout, result.stdout
    assert "native still works: ['key', 'value']" in result.stdout
