"""com.microsoft::PagedAttention through the Python front (``pakv_onnx.ort_paged_attention``): the native
(C) and golden (torch) backends against the independent reference (caches bit-exact, the output within
test_ort_paged_attention.TOLERANCE), and every rule of the contract refused with the C validator's
message naming the input (nothing written)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from ort_attention_cases import OrtCall, cache_values, random_ort_call, rounded
from ort_attention_reference import reference
from test_ort_paged_attention import TOLERANCE

import pakv_onnx
from pakv_onnx import kernels
from pakv_onnx.spec import ORT_ATTENTION, bitwise_equal

FEATURES = {
    "plain": {"dtype": "float32"},
    "packed-window-softcap-skip": {"dtype": "float32", "packed": True, "window": 3, "softcap": 2.0, "slots": "skip"},
    "int8-channel-norm-rotary-sink": {"dtype": "bfloat16", "rotary": "half", "sink": True, "cache_dtype": "int8",
                                      "quant": "PER_CHANNEL", "norm": True},
    "float8-latent-offset-rotary": {"dtype": "float16", "latent": True, "head_size": 24, "v_head_size": 16, "scale": 0.3,
                                    "rotary": "interleaved", "rotary_dim": 8, "rotary_offset": 16,
                                    "cache_dtype": "float8e4m3fn", "quant": "PER_TENSOR"},
    "not-causal-gqa4": {"dtype": "bfloat16", "causal": 0, "num_heads": 8, "kv_num_heads": 2, "index_dtype": torch.int64},
}  # fmt: skip


def front(call: OrtCall, backend: str = "native", **kwargs: object) -> torch.Tensor:
    """The call through the front (its caches written in place)."""
    attributes = dict(call.attributes)
    heads, kv_heads = attributes.pop("num_heads"), attributes.pop("kv_num_heads")
    args = [call.inputs[name] for name in ORT_ATTENTION.input_names]
    return pakv_onnx.ort_paged_attention(
        *args, num_heads=heads, kv_num_heads=kv_heads, backend=backend, **attributes, **kwargs
    )


@pytest.mark.parametrize("features", FEATURES, ids=str)
@pytest.mark.parametrize("backend", ["native", "golden", "auto"])
def test_backends_match_the_reference(features: str, backend: str) -> None:
    call = random_ort_call(30, **FEATURES[features])
    want = reference(call.numpy_call())
    work = call.clone()
    out = front(work, backend)
    np.testing.assert_array_equal(cache_values(work.inputs["key_cache"]), want.key_cache)
    if want.value_cache is not None:
        np.testing.assert_array_equal(cache_values(work.inputs["value_cache"]), want.value_cache)
    expected = rounded(want.output, call.dtype)
    atol, rtol = TOLERANCE[call.dtype]
    assert np.all(np.abs(out.float().numpy() - expected) <= atol + rtol * np.abs(expected))


def test_out_is_written_in_place() -> None:
    call = random_ort_call(31, dtype="float16", rotary="half")
    out = torch.empty(9, 4 * 16, dtype=torch.float16)
    assert front(call, out=out) is out


def test_a_backend_without_the_op_is_refused_by_name() -> None:
    with pytest.raises(kernels.BackendUnavailableError, match="has no com.microsoft::PagedAttention kernel"):
        front(random_ort_call(32), "torch")


# --------------------------------------------------------------------------------------------- #
# Refusals: (change to a valid call, the error, the C validator's message)
# --------------------------------------------------------------------------------------------- #
def _set(name: str, value) -> callable:
    return lambda c: c.inputs.__setitem__(name, value(c) if callable(value) else value)


def _attr(**changes) -> callable:
    return lambda c: c.attributes.update(changes)


def _pos(name: str, index: tuple, value: int) -> callable:
    return lambda c: c.inputs[name].__setitem__(index, value)


def _inside(pool: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A copy of ``like`` stored in the first bytes of ``pool`` (a view of it)."""
    view = pool.view(torch.uint8).reshape(-1)[: like.nbytes].view(like.dtype).view(like.shape)
    return view.copy_(like)


REFUSALS = {
    "num_heads not a multiple": (_attr(num_heads=3), ValueError, r"^num_heads \(3\) must be a multiple of kv_num_heads \(2\)$"),
    "kv_num_heads 0": (_attr(kv_num_heads=0), ValueError, r"^kv_num_heads must be at least 1, got 0$"),
    "is_causal 2": (_attr(is_causal=2), ValueError, r"^is_causal must be 0 \(off\) or 1 \(on\), got 2$"),
    "window -2": (_attr(local_window_size=-2), ValueError, r"^local_window_size must be -1 or 0 \(no window\)"),
    "rotary_offset 4": (_attr(rotary_offset=4), ValueError, r"^rotary_offset must be non-negative and a multiple of 8, got 4$"),
    "scale inf": (_attr(scale=float("inf")), ValueError, r"^scale must be a finite float"),
    "softcap negative": (_attr(softcap=-1.0), ValueError, r"^softcap must be a finite float >= 0 \(0: off\), got -1$"),
    "epsilon 0": (_attr(qk_norm_epsilon=0.0), ValueError, r"^qk_norm_epsilon must be a positive finite float, got 0$"),
    "k_quant_type unknown": (_attr(k_quant_type="PER_ROW"), ValueError, r"^k_quant_type must be 'NONE', 'PER_TENSOR' or 'PER_CHANNEL', got 'PER_ROW'$"),
    "v_quant_type unknown": (_attr(v_quant_type="none"), ValueError, r"^v_quant_type must be 'NONE', 'PER_TENSOR' or 'PER_CHANNEL', got 'none'$"),
    "int4 refused by name": (_attr(k_cache_dtype="int4"), ValueError, r"^k_cache_dtype 'int4' \(two values packed per byte in a uint8 cache\) is not implemented by this CPU kernel$"),
    "float4 refused by name": (_attr(v_cache_dtype="float4e2m1"), ValueError, r"^v_cache_dtype 'float4e2m1' .* is not implemented"),
    "cache dtype unknown": (_attr(k_cache_dtype="fp8"), ValueError, r"^k_cache_dtype must be '' \(the cache tensor's own element type\)"),
    "cache dtype disagrees": (_attr(k_cache_dtype="float16"), ValueError, r"^k_cache_dtype is 'float16' but key_cache's element type is float32"),
    "layout unknown": (_attr(kv_cache_layout="PAGED"), ValueError, r"^kv_cache_layout must be 'SEPARATE' or 'LATENT', got 'PAGED'$"),
    "query int32": (_set("query", lambda c: c.inputs["query"].int()), TypeError, r"^query dtype int32 is not one PagedAttention computes in"),
    "query 3-D": (_set("query", lambda c: c.inputs["query"].reshape(9, 4, 16)), ValueError, r"^query must have rank 2 \(\[num_tokens, hidden_size\]\)"),
    "query hidden": (_set("query", lambda c: c.inputs["query"][:, :62]), ValueError, r"^query hidden size 62 must be num_heads = 4 x head_size"),
    "query strided inside": (_set("query", lambda c: torch.zeros(9, 128)[:, ::2]), ValueError, r"^query must be dense within each token"),
    "key only": (_set("value", None), ValueError, r"^key and value must be both present, or both absent"),
    "key dtype": (_set("key", lambda c: c.inputs["key"].half()), TypeError, r"^key must have query's dtype float32, got float16$"),
    "key shape": (_set("key", lambda c: c.inputs["key"][:8]), ValueError, r"^key must be shaped \[9, 32\] \(num_tokens, kv_num_heads x head_size\), not \[8, 32\]$"),
    "v_head_size separate": (_attr(v_head_size=8), ValueError, r"^v_head_size \(8\) may differ from head_size \(16\) only when kv_cache_layout is 'LATENT'$"),
    "v_head_size too big": (_attr(v_head_size=17), ValueError, r"^v_head_size must be 0 \(head_size\) or in \[1, head_size = 16\], got 17$"),
    "value_cache missing": (_set("value_cache", None), ValueError, r"^value_cache \(unless kv_cache_layout is 'LATENT'\) is required$"),
    "cache uint8": (_set("key_cache", lambda c: c.inputs["key_cache"].view(torch.uint8)[..., :16]), ValueError, r"^key_cache dtype uint8 holds packed int4 / float4e2m1 values"),
    "cache float16 for float32": (_set("key_cache", lambda c: c.inputs["key_cache"].half()), TypeError, r"^key_cache dtype float16 must be query's dtype float32 or a quantized one"),
    "value_cache dtype": (_set("value_cache", lambda c: c.inputs["value_cache"].to(torch.int8)), TypeError, r"^value_cache must have key_cache's dtype float32, got int8$"),
    "cache heads": (_set("key_cache", lambda c: c.inputs["key_cache"][:, :, :1].contiguous()), ValueError, r"^key_cache must be shaped \[12, 4, 2, 16\] \(num_blocks, block_size, kv_num_heads, head_size\), not \[12, 4, 1, 16\]$"),
    "value_cache blocks": (_set("value_cache", lambda c: c.inputs["value_cache"][:11]), ValueError, r"^value_cache must be shaped \[12, 4, 2, 16\]"),
    "caches one buffer": (_set("value_cache", lambda c: c.inputs["key_cache"]), ValueError, r"^key_cache and value_cache share bytes"),
    "cache not row-major": (_set("key_cache", lambda c: c.inputs["key_cache"].transpose(2, 3).contiguous().transpose(2, 3)), ValueError, r"^key_cache must be row-major contiguous within each block"),
    "key overlaps cache": (_set("key", lambda c: c.inputs["key_cache"].view(-1)[: 9 * 32].view(9, 32)), ValueError, r"^key overlaps key_cache in memory: the call writes key_cache, so no input may share bytes with it$"),
    "cu shape": (_set("cumulative_sequence_length", lambda c: c.inputs["cumulative_sequence_length"][:4]), ValueError, r"^past_seqlens must have batch_size = 3 entries"),
    "cu float": (_set("cumulative_sequence_length", lambda c: c.inputs["cumulative_sequence_length"].float()), TypeError, r"^cumulative_sequence_length must be int32 or int64, got float32$"),
    "table rows": (_set("block_table", lambda c: c.inputs["block_table"][:3]), ValueError, r"^block_table must have batch_size = 4 rows, got shape \[3, \d+\]$"),
    "cu start": (_pos("cumulative_sequence_length", (0,), 1), ValueError, r"^cumulative_sequence_length must start at 0"),
    "cu decreasing": (_pos("cumulative_sequence_length", (2,), 0), ValueError, r"^cumulative_sequence_length must be non-decreasing, got cumulative_sequence_length\[2\] = 0 < cumulative_sequence_length\[1\] = \d+$"),
    "cu end": (_pos("cumulative_sequence_length", (4,), 8), ValueError, r"^cumulative_sequence_length must end at num_tokens = 9 \(query's rows\)"),
    "past negative": (_pos("past_seqlens", (0,), -1), ValueError, r"^past_seqlens must be non-negative, got past_seqlens\[0\] = -1$"),
    "table short": (_pos("past_seqlens", (0,), 20), ValueError, r"^block_table row 0 is too short: sequence 0's context of 21 tokens"),
    "block id": (_pos("block_table", (0, 0), 12), ValueError, r"^block_table\[0, 0\] = 12 is outside \[0, 12\) \(num_blocks of key_cache\); sequence 0 reads it"),
    "slot outside": (lambda c: c.inputs.__setitem__("slot_mapping", torch.full((9,), 48, dtype=torch.int32)), ValueError, r"^slot_mapping\[0\] = 48 is outside \[0, 48\)"),
    "slot twice": (lambda c: c.inputs.__setitem__("slot_mapping", torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, 5], dtype=torch.int32)), ValueError, r"^slot_mapping\[8\] = 5 repeats slot_mapping\[0\]: two tokens cannot write one slot$"),
    "slot_mapping length": (lambda c: c.inputs.__setitem__("slot_mapping", torch.zeros(8, dtype=torch.int32)), ValueError, r"^slot_mapping must have num_tokens = 9 entries, got shape \[8\]$"),
    "derived slots collide": (lambda c: c.inputs["block_table"].__setitem__((3, 0), int(c.inputs["block_table"][1, 0])), ValueError, r"^tokens \d+ and \d+ would both write slot \d+ \(slots derived from block_table"),
    "head_sink shape": (_set("head_sink", torch.zeros(3)), ValueError, r"^head_sink must be shaped \[4\] \(num_heads\), not \[3\]$"),
    "head_sink dtype": (_set("head_sink", torch.zeros(4, dtype=torch.float16)), TypeError, r"^head_sink must have query's dtype float32, got float16$"),
    "norm one weight": (_set("q_norm_weight", torch.ones(16)), ValueError, r"^q_norm_weight and k_norm_weight must be given together$"),
    "norm weight shape": (lambda c: c.inputs.update(q_norm_weight=torch.ones(8), k_norm_weight=torch.ones(8)), ValueError, r"^q_norm_weight must be shaped \[16\] \(head_size\), not \[8\]$"),
    "norm weight strided": (lambda c: c.inputs.update(q_norm_weight=torch.ones(32)[::2], k_norm_weight=torch.ones(16)), ValueError, r"^q_norm_weight must be a dense tensor"),
    "rotary without tables": (_attr(do_rotary=1), ValueError, r"^do_rotary = 1 needs cos_cache and sin_cache$"),
    "cos without sin": (_set("cos_cache", torch.ones(20, 8)), ValueError, r"^cos_cache and sin_cache must be given together$"),
    "sin shape": (lambda c: c.inputs.update(cos_cache=torch.ones(20, 8), sin_cache=torch.ones(20, 4)), ValueError, r"^sin_cache must have cos_cache's shape \[20, 8\], got \[20, 4\]$"),
    "rotary too wide": (lambda c: (c.inputs.update(cos_cache=torch.ones(20, 8), sin_cache=torch.ones(20, 8)), c.attributes.update(rotary_offset=8)), ValueError, r"^rotary_offset \(8\) \+ rotary_dim \(2 x cos_cache's dim 1 = 2 x 8\) must not exceed head_size 16$"),
    "rotary_offset near INT64_MAX": (lambda c: (c.inputs.update(cos_cache=torch.ones(20, 4096), sin_cache=torch.zeros(20, 4096)), c.attributes.update(do_rotary=1, rotary_offset=2**63 - 8)), ValueError, r"^rotary_offset \(9223372036854775800\) \+ rotary_dim \(2 x cos_cache's dim 1 = 2 x 4096\) must not exceed head_size 16$"),
    "heads overflow packed": (lambda c: (c.inputs.update(key=None, value=None), c.attributes.update(num_heads=2**62, kv_num_heads=2**62)), ValueError, r"^num_heads \(4611686018427387904\) \+ 2 x kv_num_heads \(4611686018427387904\) overflows int64 \(query is packed QKV\)$"),
    "query on meta": (_set("query", lambda c: c.inputs["query"].to("meta")), ValueError, r"^query is on the meta device \(a shape with no data to read or write\)$"),
    "block_table on meta": (_set("block_table", lambda c: c.inputs["block_table"].to("meta")), ValueError, r"^block_table is on the meta device"),
    "NUL in a string attribute": (_attr(k_quant_type="NONE\x00X"), ValueError, r"^k_quant_type must be 'NONE', 'PER_TENSOR' or 'PER_CHANNEL', got '\(a NUL at byte 4\)'$"),
    "cos_cache inside the pool": (lambda c: (c.inputs.update(cos_cache=c.inputs["key_cache"].view(-1)[:160].view(20, 8), sin_cache=torch.zeros(20, 8))), ValueError, r"^cos_cache overlaps key_cache in memory: the call writes key_cache, so no input may share bytes with it$"),
    "block_table inside the pool": (lambda c: c.inputs.update(block_table=_inside(c.inputs["key_cache"], c.inputs["block_table"])), ValueError, r"^block_table overlaps key_cache in memory: the call writes key_cache"),
    "q_norm_weight inside the pool": (lambda c: c.inputs.update(q_norm_weight=c.inputs["value_cache"][5, 1, 0], k_norm_weight=torch.ones(16)), ValueError, r"^q_norm_weight overlaps value_cache in memory"),
    "rotary rows": (lambda c: (c.inputs.update(cos_cache=torch.ones(3, 8), sin_cache=torch.ones(3, 8)), c.attributes.update(do_rotary=1)), ValueError, r"^cos_cache has 3 positions but sequence \d+'s new tokens sit at positions up to \d+"),
    "scale without quant": (_set("k_scale", torch.ones(1)), ValueError, r"^k_scale must be absent when k_quant_type is 'NONE'$"),
    "quant of a float cache": (lambda c: (c.inputs.update(k_scale=torch.ones(1)), c.attributes.update(k_quant_type="PER_TENSOR")), ValueError, r"^k_quant_type is 'PER_TENSOR' but key_cache holds float32: use an int8 or float8_e4m3fn cache"),
    "attention_metadata shape": (_set("attention_metadata", torch.zeros(4, dtype=torch.int32)), ValueError, r"^attention_metadata holds 2 or 3 entries"),
    "attention_metadata negative": (_set("attention_metadata", torch.tensor([1, -1], dtype=torch.int32)), ValueError, r"^attention_metadata entries must be non-negative \(0: unknown\), got attention_metadata\[1\] = -1$"),
    "output shape": (lambda c: c.__dict__.update(out=torch.empty(9, 32)), ValueError, r"^output must have shape \[9, 64\], got \[9, 32\]$"),
    "output overlaps": (lambda c: c.__dict__.update(out=c.inputs["key_cache"].view(-1)[: 9 * 64].view(9, 64)), ValueError, r"^output overlaps key_cache in memory"),
}  # fmt: skip

QUANTIZED_REFUSALS = {
    "quantized without quant type": (_attr(k_quant_type="NONE"), ValueError, r"^k_scale must be absent when k_quant_type is 'NONE'$"),
    "quantized, quant NONE": (lambda c: (c.inputs.update(k_scale=None), c.attributes.update(k_quant_type="NONE")), ValueError, r"^key_cache holds int8 values: k_quant_type must be 'PER_TENSOR' or 'PER_CHANNEL'$"),
    "quantized without scale": (_set("v_scale", None), ValueError, r"^v_scale must be given when v_quant_type is not 'NONE'$"),
    "scale dtype": (_set("k_scale", lambda c: c.inputs["k_scale"].double()), TypeError, r"^k_scale must be float32, got float64$"),
    "per-channel shape": (_set("k_scale", torch.ones(2, 1, 8)), ValueError, r"^k_scale must be shaped \[2, 1, 16\] \(kv_num_heads, 1, head_size for PER_CHANNEL"),
    "scale not finite": (_pos("v_scale", (1, 0, 3), float("nan")), ValueError, r"^v_scale\[19\] = nan is not finite \(flat index\)$"),
    "per-tensor count": (lambda c: (c.inputs.update(k_scale=torch.ones(2)), c.attributes.update(k_quant_type="PER_TENSOR")), ValueError, r"^k_scale must have exactly 1 element for PER_TENSOR, got shape \[2\]$"),
}  # fmt: skip

LATENT_REFUSALS = {
    "latent with value": (_set("value", lambda c: c.inputs["key"].clone()), ValueError, r"^value must not be given when kv_cache_layout is 'LATENT'"),
    "latent without key": (_set("key", None), ValueError, r"^key must be given when kv_cache_layout is 'LATENT'$"),
    "latent value_cache": (_set("value_cache", lambda c: c.inputs["key_cache"].clone()), ValueError, r"^value_cache must be absent when kv_cache_layout is 'LATENT' \(V is read from key_cache's leading"),
    "latent sink": (_set("head_sink", torch.zeros(4, dtype=torch.bfloat16)), ValueError, r"^head_sink must be absent when kv_cache_layout is 'LATENT' \(no absorbed-MLA model uses it\)$"),
    "latent scale implicit": (_attr(scale=0.0), ValueError, r"^an explicit scale attribute must be given when v_head_size \(16\) differs from head_size \(24\)"),
    "latent kv heads": (_attr(kv_num_heads=2), ValueError, r"^kv_num_heads must be 1 when kv_cache_layout is 'LATENT', got 2$"),
    "latent v quant": (_attr(v_quant_type="PER_TENSOR"), ValueError, r"^v_quant_type and v_cache_dtype must be unset when kv_cache_layout is 'LATENT'"),
}  # fmt: skip


def _refused(call: OrtCall, change, error: type, pattern: str) -> None:
    call.out = None
    change(call)
    before = {name: t.clone() for name in ("key_cache", "value_cache") if (t := call.inputs[name]) is not None}
    with pytest.raises(error, match=pattern):
        front(call, out=call.out)
    for name, tensor in before.items():  # nothing written
        assert bitwise_equal(call.inputs[name].contiguous(), tensor.contiguous()), name


@pytest.mark.parametrize("name", REFUSALS)
def test_each_rule_is_refused_naming_the_input(name: str) -> None:
    _refused(random_ort_call(40, dtype="float32"), *REFUSALS[name])


@pytest.mark.parametrize("name", QUANTIZED_REFUSALS)
def test_each_quantization_rule_is_refused(name: str) -> None:
    _refused(random_ort_call(41, dtype="float32", cache_dtype="int8", quant="PER_CHANNEL"), *QUANTIZED_REFUSALS[name])


@pytest.mark.parametrize("name", LATENT_REFUSALS)
def test_each_latent_rule_is_refused(name: str) -> None:
    call = random_ort_call(42, dtype="bfloat16", latent=True, head_size=24, v_head_size=16, scale=0.3)
    _refused(call, *LATENT_REFUSALS[name])


def test_the_refusal_table_covers_every_fused_rule() -> None:
    """Every message of the fused op's contract units is matched by one refusal above (or named as one
    that only a C caller or an ORT session can reach)."""
    from test_one_validator import _CALL, _LITERAL, PACKAGE

    reachable_elsewhere = {  # rules only ORT's records or the C API can break (tested there)
        "%s must be given (an INT attribute >= 1)", "no memory for the plan's %lld scratch entries",
        "value_cache_out has no place", "key_cache_out and value_cache_out must be both present",
        "%s and %s overlap in memory; pass separate tensors", "past_seqlens[%lld] = %lld plus its",
        "must have batch_size + 1 >= 1 entries",
        "channels overflow int64 byte offsets",
        # never reached from valid shapes (tested through the C API in test_ort_paged_attention_attack.py
        # where reachable: the table changing between its check and the slots, by another thread)
        "x head_size (%lld) overflows int64", "x block_size %lld overflows int64", "writes its position %lld there",
    }  # fmt: skip
    messages = []
    for unit in ("pakv_contract_fused.c", "pakv_contract_fused_values.c"):
        text = (PACKAGE / "native_lib" / unit).read_text()
        messages += ["".join(_LITERAL.findall(m.group(1))) for m in _CALL.finditer(text)]
    patterns = [p for *_, p in (*REFUSALS.values(), *QUANTIZED_REFUSALS.values(), *LATENT_REFUSALS.values())]
    texts = [p.replace("\\", "") for p in patterns]
    missed = []
    for message in messages:
        if any(known in message for known in reachable_elsewhere):
            continue
        pieces = [piece for piece in re.split(r"%[-.0-9]*(?:lld|zu|s|d|g)", message) if len(piece.strip()) >= 12]
        if not any(piece.strip()[:20] in text for piece in pieces for text in texts):
            missed.append(message)
    assert not missed, missed
