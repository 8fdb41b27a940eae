"""com.microsoft::PagedAttention over int8 / float8e4m3fn caches with T float16 / bfloat16: the plugin
dequantizes each cache element as ORT's CUDA kernel does, fp32 ``e x scale`` rounded to T before
attention (found on an H200: docs/ort-paged-attention.md "Cache bytes"), for K (the scores) and V (the
weighted sum), LATENT's V (the key rows, the key's scale) included.

Checked against the reference with that rounding (``reference(call, dequantized_in_t=True)``), within the
tolerance of the unquantized cases (tests/test_ort_paged_attention.py: one rounding step of T), on both
walk widths (the widest the CPU runs, and the 8-float one in a subprocess with
PAKV_ONNX_ATTENTION_WIDTH=8). Every case is one where the exact dequantization (what the kernel did
before) lies outside that tolerance, so each would fail without the rounding.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import rerun_with_the_8_float_walk
from ort_attention_cases import random_ort_call, rounded
from ort_attention_reference import reference
from test_ort_paged_attention import TOLERANCE, run_plugin
from test_ort_paged_attention_front import front

PHASES = {"decode": ((40, 1), (17, 1), (5, 1), (63, 1)), "prefill": ((0, 12), (20, 6), (9, 3))}
LAYOUTS = {
    "separate": {"num_heads": 8, "kv_num_heads": 2, "head_size": 64, "scale": 0.4},
    "latent": {"latent": True, "num_heads": 8, "head_size": 96, "v_head_size": 64, "rotary": "half", "rotary_dim": 32,
               "rotary_offset": 64, "scale": 0.4},
}  # fmt: skip
SWEEP = list(itertools.product(("int8", "float8e4m3fn"), ("PER_TENSOR", "PER_CHANNEL"), ("float16", "bfloat16"),
                               LAYOUTS, PHASES))  # fmt: skip


def sweep_call(index: int):
    cache_dtype, quant, dtype, layout, phase = SWEEP[index]
    return random_ort_call(700 + index, dtype=dtype, cache_dtype=cache_dtype, quant=quant, block_size=16,
                           num_blocks=12, sequences=PHASES[phase], **LAYOUTS[layout])  # fmt: skip


def outside(got: np.ndarray, want: np.ndarray, dtype: str) -> float:
    """How far past the tolerance ``got`` lies from ``want`` at its worst element (<= 0: within)."""
    atol, rtol = TOLERANCE[dtype]
    return float((np.abs(got - want) - (atol + rtol * np.abs(want))).max())


@pytest.mark.parametrize("index", range(len(SWEEP)), ids=lambda i: "-".join(SWEEP[i]))
def test_quantized_caches_read_in_orts_arithmetic(index: int) -> None:
    call = sweep_call(index)
    dtype = call.dtype
    got = run_plugin(call.clone())["output"].float().numpy()
    orts = rounded(reference(call.numpy_call(), dequantized_in_t=True).output, dtype)
    exact = rounded(reference(call.numpy_call(), dequantized_in_t=False).output, dtype)
    assert outside(exact, orts, dtype) > 0, "the case cannot tell the two arithmetics apart"
    assert outside(got, orts, dtype) <= 0, f"{outside(got, orts, dtype):.3g} past the tolerance"


@pytest.mark.parametrize("index", range(len(SWEEP)), ids=lambda i: "-".join(SWEEP[i]))
def test_the_golden_backend_reads_them_alike(index: int) -> None:
    """pakv_onnx.ort_paged_attention(backend="golden") (float64 attention over the same T-rounded
    elements): within the tolerance of ORT's arithmetic, where the exact elements are not."""
    call = sweep_call(index)
    got = front(call.clone(), "golden").float().numpy()
    orts = rounded(reference(call.numpy_call(), dequantized_in_t=True).output, call.dtype)
    assert outside(got, orts, call.dtype) <= 0, f"{outside(got, orts, call.dtype):.3g} past the tolerance"


def test_the_8_float_walk_reads_them_alike() -> None:
    rerun_with_the_8_float_walk(__file__, "8_float or golden")
