"""The attention walk's vector rounding of dequantized elements to float16 / bfloat16 (pakv_vec.h:
``vround_f16`` / ``vround_bf16``, used when a plan's dequantized_type asks for ORT's arithmetic) gives the
bits of pakv_float.h's scalar round-to-nearest-even conversions (the cache write's, torch's) for every
float it is shown, NaN for NaN, at both walk widths and in the AVX-512 build (float16 by its conversion
instructions): every bit pattern whose low 12 bits are one of the
rounding's edge cases, and a stride through all 2^32 (every pattern under -m slow)."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tests" / "native" / "vector_rounding_check.c"
TYPES = {"float16": 0, "bfloat16": 1}


def _has_avx512() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return all(f" {flag}" in flags for flag in ("avx512f", "avx512vl", "avx512bw", "avx512dq"))


# The 8-float walk's integer steps, the 16-float ones built generically, and the 16-float walk's own
# build (x86-64-v4: float16 through the conversion instructions), which only a CPU with AVX-512 runs.
BUILDS = {"w8": (8, []), "w16": (16, []), "w16-avx512": (16, ["-march=x86-64-v4"])}


@pytest.fixture(scope="module", params=list(BUILDS))
def check(request, tmp_path_factory) -> ctypes.CDLL:
    width, flags = BUILDS[request.param]
    if flags and not _has_avx512():
        pytest.skip("this CPU has no AVX-512: the 16-float walk never runs here")
    out = tmp_path_factory.mktemp("vround") / f"libvround_{request.param}.so"
    subprocess.run(["gcc", "-std=c11", "-O2", "-shared", "-fPIC", "-Wall", f"-DPAKV_W={width}", *flags, "-I",
                    str(ROOT / "pakv_onnx" / "native_lib"), "-o", str(out), str(SOURCE)], check=True)  # fmt: skip
    lib = ctypes.CDLL(str(out))
    lib.pakv_test_vround_mismatches.argtypes = [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int64, ctypes.c_int]
    lib.pakv_test_vround_mismatches.restype = ctypes.c_int64
    return lib


# Low bits where rounding turns: 0, the half of float16's dropped 13 bits (0x1000) and of bfloat16's 16
# (0x8000: its low 12 bits are 0), one either side, all ones.
EDGES = (0x000, 0x001, 0x7FF, 0x800, 0x801, 0xFFE, 0xFFF)


@pytest.mark.parametrize("dtype", TYPES)
def test_every_high_pattern_with_edge_low_bits(check, dtype: str) -> None:
    for low in EDGES:  # 2^20 patterns each: every sign, exponent and high mantissa
        assert check.pakv_test_vround_mismatches(low, 1 << 12, 1 << 20, TYPES[dtype]) == 0, hex(low)


@pytest.mark.parametrize("dtype", TYPES)
def test_a_stride_through_all_floats(check, dtype: str) -> None:
    assert check.pakv_test_vround_mismatches(0, 997, (1 << 32) // 997 + 1, TYPES[dtype]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", TYPES)
def test_every_float(check, dtype: str) -> None:
    assert check.pakv_test_vround_mismatches(0, 1, 1 << 32, TYPES[dtype]) == 0
