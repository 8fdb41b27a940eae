"""The rotary's one rounding of a c + t (pakv_fused.c): the round-to-odd form the fp32 prologue now takes (a
few instructions) gives the bits of the exact form it replaced (round_once), on random triples (underflows to
zero, overflows to infinity and cancellations among them) and on the halfway case where rounding the double
sum naively would round twice; and round_once keeps the sign of a value it rounds to zero."""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tests" / "native" / "fused_rounding_check.c"


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> ctypes.CDLL:
    out = tmp_path_factory.mktemp("rounding") / "librounding_check.so"
    native = ROOT / "pakv_onnx" / "native_lib"
    subprocess.run(["gcc", "-std=c11", "-O2", "-shared", "-fPIC", "-Wall", "-I", str(native), "-o", str(out), str(SOURCE)],
                   check=True)  # fmt: skip
    lib = ctypes.CDLL(str(out), mode=os.RTLD_LAZY)  # the rest of pakv_fused.c's callees are never called
    lib.pakv_test_rounding_mismatches.argtypes = [ctypes.c_uint64, ctypes.c_int64]
    lib.pakv_test_rounding_mismatches.restype = ctypes.c_int64
    lib.pakv_test_rounding_halfway.argtypes = [ctypes.c_int]
    lib.pakv_test_rounding_halfway.restype = ctypes.c_uint32
    lib.pakv_test_round_once_tiny_negative.argtypes = [ctypes.c_int]
    lib.pakv_test_round_once_tiny_negative.restype = ctypes.c_uint32
    return lib


def test_round_to_odd_matches_the_exact_rounding_on_random_triples(check) -> None:
    assert check.pakv_test_rounding_mismatches(20261204, 400_000) == 0


def test_the_halfway_sum_is_rounded_once(check) -> None:
    expected = struct.unpack("<I", struct.pack("<f", 1.0 + 2.0**-23))[0]  # the exact sum is just below the midpoint
    assert check.pakv_test_rounding_halfway(0) == expected
    assert check.pakv_test_rounding_halfway(1) != expected  # rounding the double sum to float rounds twice: wrong


@pytest.mark.parametrize("half", [0, 1], ids=["float32", "float16"])
def test_a_negative_value_below_the_smallest_step_rounds_to_minus_zero(check, half: int) -> None:
    """IEEE's rounding, the goldens' (torch.round, numpy) and the CUDA kernel's fma keep the sign of a value
    rounded to zero: its cache bytes are -0 (before, round_once's magic-number rounding gave +0)."""
    assert check.pakv_test_round_once_tiny_negative(half) == 0x80000000
