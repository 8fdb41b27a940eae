#!/usr/bin/env bash
# The GPU check in one command, on a machine with an NVIDIA GPU and its driver (libcuda.so.1).
# NEVER RUN ON REAL HARDWARE: the project's machines have no GPU (tests/test_device_script.py runs
# only `gpu_check.py --dry-run` on a CPU). Needs network access to PyPI (or a mirror pip is set up for).
#
#   bash tests/device/gpu_check.sh [gpu_check.py options: --quick --json results.json --strict]
#
# Makes a venv (PAKV_GPU_VENV, default a temporary one), installs onnxruntime-gpu with its CUDA and
# cuDNN wheels (onnxruntime.preload_dlls() loads them), a CUDA build of torch (the golden runs on the
# CPU; the comparisons need torch.cuda), the package's other dependencies and this checkout without
# its `onnxruntime` dependency (the CPU wheel would shadow onnxruntime-gpu), then runs the check.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv="${PAKV_GPU_VENV:-$(mktemp -d)/venv}"
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q "onnxruntime-gpu[cuda,cudnn]" "torch>=2.6,<2.14" numpy ml_dtypes "onnx>=1.16" \
    "onnxscript>=0.3" pytest
"$venv/bin/pip" install -q --no-deps -e .   # builds libpakv_ort.so (plain C: no CUDA toolkit needed)
"$venv/bin/python" -c "import onnxruntime as o; o.preload_dlls(); print(o.__version__, o.get_available_providers())"
exec "$venv/bin/python" tests/device/gpu_check.py "$@"
