#!/usr/bin/env bash
# The GPU check in one command, on a machine with an NVIDIA GPU and its driver (libcuda.so.1).
# Its steps ran on an H200 on 2026-12-04 (by hand, docs/plugin-hosts.md "The GPU check"); the
# project's machines run only `gpu_check.py --dry-run` (tests/test_device_script.py).
#
#   bash tests/device/gpu_check.sh [gpu_check.py options: --quick --parts ... --json results.json --strict]
#
# With network (PyPI or a mirror pip is set up for): makes a venv (PAKV_GPU_VENV, default a temporary
# one), installs onnxruntime-gpu with its CUDA and cuDNN wheels (onnxruntime.preload_dlls() loads
# them), onnxruntime-genai-cuda, a CUDA build of torch, the package's other dependencies and this
# checkout without its `onnxruntime` dependency (the CPU wheel would shadow onnxruntime-gpu).
#
# Without network: PAKV_GPU_WHEELS=DIR names a folder of wheels brought over (onnxruntime-gpu,
# onnxruntime-genai-cuda; gpu_check.py --help says how): they are installed with
# `pip --no-index --no-deps --target` into DIR/site, put first on PYTHONPATH, and the machine's own
# python, torch and onnx are used; the library is built in place (plain C: gcc, no CUDA toolkit).
set -euo pipefail
cd "$(dirname "$0")/../.."
if [[ -n "${PAKV_GPU_WHEELS:-}" ]]; then
    site="$PAKV_GPU_WHEELS/site"
    python3 -m pip install -q --no-index --no-deps --target "$site" "$PAKV_GPU_WHEELS"/*.whl
    python3 setup.py -q build_ext --inplace
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    python3 -c "import torch, onnxruntime as o; o.preload_dlls(); print(o.__version__, o.get_available_providers())"
    exec python3 tests/device/gpu_check.py "$@"
fi
venv="${PAKV_GPU_VENV:-$(mktemp -d)/venv}"
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q "onnxruntime-gpu[cuda,cudnn]" onnxruntime-genai-cuda "torch>=2.6,<2.14" numpy ml_dtypes \
    "onnx>=1.16" "onnxscript>=0.3" transformers tokenizers pytest
"$venv/bin/pip" install -q --no-deps -e .   # builds libpakv_ort.so (plain C: no CUDA toolkit needed)
"$venv/bin/python" -c "import onnxruntime as o; o.preload_dlls(); print(o.__version__, o.get_available_providers())"
exec "$venv/bin/python" tests/device/gpu_check.py "$@"
