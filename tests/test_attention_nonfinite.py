"""PagedAttention's non-finite rules (issue 27, docs/reliability.md "Non-finite values in attention"),
the same on every path: the Python API on each backend, ``torch.ops.pakv.paged_attention``, ORT with the
plugin's C kernel and with its Python backends, and stock ORT's fallback function; in float32, float16 and
bfloat16. Each case places NaN / inf by hand (tests/attention_rules.py) and every path must give what
the rules give position by position: NaN exactly where they say, the same infinities, the rest as the
finite math."""

from __future__ import annotations

import functools

import numpy as np
import onnxruntime as ort
import pytest
import torch
from attention_rules import CASES, attention_by_the_rules, check, make_case

import pakv_onnx
from pakv_onnx import runtime_plugin
from pakv_onnx.export import make_attention_model_for
from pakv_onnx.spec import ATTENTION

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (atol, rtol) against the fp64 rules on the dtype-rounded inputs: fp32 summation order; 16-bit outputs one
# fp32 result rounded once.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 2**-10), torch.bfloat16: (1e-2, 2**-7)}
PATHS = ["native", "golden", "torch", "torch.ops", "ort-native", "ort-golden", "ort-torch", "stock"]


def tensors(arrays: dict[str, np.ndarray], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The case as the op's inputs: floats in ``dtype``, index tensors int64."""
    return {
        name: torch.from_numpy(a).to(dtype if a.dtype == np.float64 else torch.int64) for name, a in arrays.items()
    }


@functools.cache
def _session(path: str, dtype: torch.dtype):
    example = tensors(make_case(next(iter(CASES))), dtype)
    model = make_attention_model_for(*example.values(), fallback=path == "stock")
    if path == "stock":
        return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return runtime_plugin.make_session(model, backend=path.removeprefix("ort-"))


def attend(path: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    args = [inputs[n] for n in ATTENTION.input_names]
    if path in ("native", "golden", "torch"):
        return pakv_onnx.paged_attention(*args, backend=path)
    if path == "torch.ops":
        return torch.ops.pakv.paged_attention(*args)
    return runtime_plugin.run(_session(path, args[0].dtype), inputs)["output"]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", list(CASES))
def test_every_path_follows_the_rules(case: str, path: str, dtype: torch.dtype) -> None:
    inputs = tensors(make_case(case), dtype)
    # The rules on the inputs as the op sees them (rounded to dtype).
    want = attention_by_the_rules({n: t.double().numpy() if t.is_floating_point() else t.numpy() for n, t in inputs.items()})
    got = attend(path, inputs)
    assert got.dtype == dtype
    check(got.double().numpy(), want, *TOLERANCE[dtype], f"{path} {case}")


def test_the_cases_reach_what_they_are_named_for() -> None:
    """The reference itself on the cases: which rows are finite, NaN, infinite (so a case cannot quietly
    stop testing its rule)."""
    finite = {name: np.isfinite(attention_by_the_rules(make_case(name))) for name in CASES}
    for name in ("key_plus_inf_against_negative_queries", "and_its_value_nan", "key_minus_inf_against_positive_queries",
                 "nan_value_in_the_other_sequence", "nan_past_the_context"):  # fmt: skip
        assert finite[name][:3].all() or name == "nan_value_in_the_other_sequence", name
    assert finite["nan_past_the_context"].all() and finite["and_its_value_nan"].all()
    assert finite["nan_value_of_a_later_new_token"][:2].all() and not finite["nan_value_of_a_later_new_token"][2, :2, 3].any()
    assert finite["nan_value_in_the_other_sequence"][:3].all() and not finite["nan_value_in_the_other_sequence"][3, 2:].any()
    assert np.isnan(attention_by_the_rules(make_case("every_visible_score_minus_inf"))[3, 0]).all()
    assert np.isposinf(attention_by_the_rules(make_case("plus_inf_value_of_equal_scores"))[1, 2, 4])
