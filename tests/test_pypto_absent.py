"""Without pypto (and torch_npu) the package imports, auto falls through and backends "pypto"/"pypto-cpu" say why."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    '''
    import importlib.abc
    import sys


    class Blocker(importlib.abc.MetaPathFinder):
        """Pretend pypto and torch_npu are not installed."""

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("pypto", "torch_npu"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None


    sys.meta_path.insert(0, Blocker())

    import torch

    import pakv_onnx
    from pakv_onnx import cli, kernels
    from pakv_onnx.cases import random_case
    from pakv_onnx.ops import gather_pa_kv_cache
    from pakv_onnx.spec import CacheMode

    assert "pypto" in kernels.backend_names()
    backend = kernels.get_backend("pypto")  # the module imports without pypto
    reason = backend.unavailable_reason()
    assert reason is not None and "pypto is not installed" in reason, reason
    cpu_reason = kernels.get_backend("pypto-cpu").unavailable_reason()
    assert cpu_reason is not None and "pypto is not installed" in cpu_reason, cpu_reason

    case = random_case(4, dtype=torch.bfloat16, cache_mode=CacheMode.NORM)
    key, value = gather_pa_kv_cache(*case.inputs(), **case.attributes())  # auto falls through
    try:
        gather_pa_kv_cache(*case.inputs(), **case.attributes(), backend="pypto")
    except kernels.BackendUnavailableError as err:
        message = str(err)
    else:
        raise AssertionError("backend='pypto' ran without pypto")
    assert "pypto is not installed" in message and "backends that can" in message, message
    assert cli.main(["verify-kernel", "--cases", "level0"]) == 2
    assert "pypto" not in sys.modules and "torch_npu" not in sys.modules
    print("OK", message)
    '''
)


def test_package_works_without_pypto_and_names_the_reason():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK backend 'pypto' cannot run this call: pypto is not installed" in proc.stdout
    assert "pypto is not installed" in proc.stderr  # verify-kernel's refusal
