"""An independent numpy reference of ONNX Runtime's ``com.microsoft::PagedAttention``, written from
ORT's sources (bert_defs.cc, paged_attention_helper.h, paged_attention_impl.cu; see
docs/ort-paged-attention.md), not from this project's C code.

Three parts, each in the precision its contract states:

* the prologue (q/k RMSNorm, rotary at position past + j) in the arithmetic of ORT's CUDA kernel
  (QkNormRotaryTNH as onnxruntime-gpu 1.31.1 compiles it for sm_90a; docs/ort-paged-attention.md
  "Cache bytes"): the norm's squares, tree sum, mean, scaling and weight in float32, rounded to T;
  rotary in T's arithmetic: float16 one fused multiply-add ``T(a c + T(sign b s))``, bfloat16 through
  float32 rounded to T after each operation, float32 (the plugin's own) the float16 form in fp32 --
  the cache write is compared bit for bit. The one operation not mirrored to the bit is the GPU's
  approximate rsqrtf: here the correctly rounded fp32 1 / sqrt;
* the write: every token with a slot (slot_mapping's, or derived from its position through
  block_table; -1 skips) stores its key / value rows; int8 and float8e4m3fn caches store
  ``q(x / scale)`` with fp32 arithmetic (a zero scale stores 0; int8: clamp to [-128, 127] with
  NaN -> -128, round half to even; float8e4m3fn: clamp to +-448 with NaN -> 448, round to nearest even);
* attention: the attention core's float64 reference (attention_reference.py: dequantized elements
  fp32 e x scale rounded to T as ORT's CUDA kernel rounds them, scores scale x q.k, softcap c tanh(s / c), a window, causal or not, one sink logit with
  no value), ORT's attributes mapped onto it; the result returned in float64 for the test to round
  and compare with a tolerance.

Arrays are numpy float32 holding T values (bfloat16 / float16 / float32); caches are returned as
float32 values of their elements (int8 and float8 codes decoded), with the codes themselves.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from attention_reference import NONE, PER_CHANNEL, PER_TENSOR, paged_attention

FLOAT8_MAX = 448.0


# ----------------------------------------------------------------------------------------------
# Rounding
# ----------------------------------------------------------------------------------------------
def round_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bfloat16 (ties to even), as float32; NaN stays NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    out = rounded.astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x), np.float32(np.nan), out)


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to ``dtype`` ("float32", "float16", "bfloat16"), returned as float32."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return round_bfloat16(x)
    return x


def _float8_table() -> tuple[np.ndarray, np.ndarray]:
    """Every finite float8e4m3fn value >= 0 and its code, ascending (subnormals m x 2^-9)."""
    values, codes = [], []
    for code in range(0x7F):  # 0x7F is NaN
        exponent, mantissa = code >> 3, code & 7
        value = mantissa * 2.0**-9 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7)
        values.append(value)
        codes.append(code)
    return np.array(values), np.array(codes, dtype=np.uint8)


_F8_VALUES, _F8_CODES = _float8_table()


def float8_encode(v: np.ndarray) -> np.ndarray:
    """Finite float32 values with |v| <= 448 -> float8e4m3fn codes, rounded to nearest, ties to the even code."""
    magnitude = np.abs(v.astype(np.float64))
    above = np.clip(np.searchsorted(_F8_VALUES, magnitude), 1, len(_F8_VALUES) - 1)
    low, high = _F8_VALUES[above - 1], _F8_VALUES[above]
    pick_high = (magnitude - low > high - magnitude) | (
        (magnitude - low == high - magnitude) & (_F8_CODES[above] % 2 == 0)
    )
    code = np.where(magnitude <= low, _F8_CODES[above - 1], np.where(pick_high, _F8_CODES[above], _F8_CODES[above - 1]))
    code = np.where(magnitude >= _F8_VALUES[-1], _F8_CODES[-1], code)
    return np.where(np.signbit(v), code | 0x80, code).astype(np.uint8)


def float8_decode(codes: np.ndarray) -> np.ndarray:
    """float8e4m3fn codes -> float64 values (0x7F / 0xFF: NaN)."""
    codes = codes.astype(np.int64)
    magnitude = np.where((codes & 0x7F) == 0x7F, np.nan, _F8_VALUES[np.minimum(codes & 0x7F, 0x7E)])
    return np.where(codes & 0x80, -magnitude, magnitude)


def quantize(values: np.ndarray, scale: np.ndarray, cache_dtype: str) -> np.ndarray:
    """T values (float32) -> int8 / float8e4m3fn codes with fp32 ``x / scale`` (a zero scale stores 0),
    clamped with fmax / fmin as the CUDA kernel (a NaN takes the first bound: -128, or 448)."""
    scale = scale.astype(np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        v = np.where(scale == 0, np.float32(0), values.astype(np.float32) / scale).astype(np.float32)
    if cache_dtype == "int8":
        return np.rint(np.fmin(np.fmax(v, np.float32(-128)), np.float32(127))).astype(np.int8)
    return float8_encode(np.fmax(np.fmin(v, np.float32(FLOAT8_MAX)), np.float32(-FLOAT8_MAX)))


# ----------------------------------------------------------------------------------------------
# A call
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Call:
    """One com.microsoft::PagedAttention call, as numpy (float32 holding T values; int64 indices)."""

    dtype: str  # T: float32, float16, bfloat16
    cache_dtype: str  # T itself, int8 or float8e4m3fn
    query: np.ndarray  # [N, Hq*D] or packed [N, (Hq + 2 Hk) * D]
    key: np.ndarray | None
    value: np.ndarray | None
    key_cache: np.ndarray  # [nb, bs, Hk, D]: T values, or int8 / float8 codes
    value_cache: np.ndarray | None
    cumulative_sequence_length: np.ndarray
    past_seqlens: np.ndarray
    block_table: np.ndarray
    cos_cache: np.ndarray | None = None
    sin_cache: np.ndarray | None = None
    slot_mapping: np.ndarray | None = None
    head_sink: np.ndarray | None = None
    q_norm_weight: np.ndarray | None = None
    k_norm_weight: np.ndarray | None = None
    k_scale: np.ndarray | None = None
    v_scale: np.ndarray | None = None
    attributes: dict[str, Any] = dataclasses.field(default_factory=dict)

    def attr(self, name: str, default: Any) -> Any:
        return self.attributes.get(name, default)


@dataclasses.dataclass
class Result:
    output: np.ndarray  # [N, Hq * Dv] float64
    key_cache: np.ndarray  # the caches after the write, as given (T values or codes)
    value_cache: np.ndarray | None
    query_rows: np.ndarray  # [N, Hq, D] the prepared queries attention used (T values)
    slots: np.ndarray  # [N] each token's slot, -1 unwritten


def _heads(rows: np.ndarray, heads: int, d: int) -> np.ndarray:
    return rows.reshape(rows.shape[0], heads, d).astype(np.float32)


def round_once(hi: np.ndarray, lo: np.ndarray, dtype: str) -> np.ndarray:
    """The exact value ``hi + lo`` (float64 pairs, |lo| at most half an ulp of hi) rounded once to
    ``dtype`` (float16 / float32), returned as float32. numpy converts float64 straight to float16
    (one rounding); where hi is exactly halfway between two T values, lo says which side is nearer."""
    np_dtype = np.float16 if dtype == "float16" else np.float32
    with np.errstate(over="ignore", invalid="ignore"):
        r = hi.astype(np_dtype)
        gap = hi - r.astype(np.float64)
        other = np.nextafter(r, np.where(gap > 0, np_dtype(np.inf), np_dtype(-np.inf)).astype(np_dtype))
        halfway = np.isfinite(r) & (gap != 0) & (hi == (r.astype(np.float64) + other.astype(np.float64)) / 2)
        r = np.where(halfway & (np.sign(lo) == np.sign(gap)), other, r)
    return r.astype(np.float32)


def fused_multiply_add(a: np.ndarray, c: np.ndarray, t: np.ndarray, dtype: str) -> np.ndarray:
    """``a c + t`` (T values as float32; a c is exact in float64) rounded once to T: one FMA in T."""
    p = a.astype(np.float64) * c.astype(np.float64)
    hi = p + t.astype(np.float64)
    back = hi - p
    lo = (p - (hi - back)) + (t.astype(np.float64) - back)  # hi + lo == p + t exactly
    return round_once(hi, lo, dtype)


def rotate(a: np.ndarray, b: np.ndarray, c: np.ndarray, s: np.ndarray, sign: float, dtype: str) -> np.ndarray:
    """One rotated channel ``a c + sign b s`` in T's arithmetic on the GPU (see the module's docstring)."""
    f32 = np.float32
    if dtype == "bfloat16":  # onnxruntime::BFloat16: every operation in fp32, rounded back to bf16
        ac = round_bfloat16(a.astype(f32) * c.astype(f32))
        bs = round_bfloat16(round_bfloat16(f32(sign) * b.astype(f32)) * s.astype(f32))
        return round_bfloat16(ac + bs)
    product = (f32(sign) * b.astype(f32)).astype(np.float64) * s.astype(np.float64)  # exact
    bs = round_once(product, np.zeros_like(product), dtype)  # T(sign b s), one rounding
    return fused_multiply_add(a, c, bs, dtype)


def norm(x: np.ndarray, weight: np.ndarray, dtype: str, eps: float) -> np.ndarray:
    """RMSNorm of heads [N, H, D] (T values) as the CUDA kernel: fp32 squares summed by a tree over the
    smallest power of two >= max(32, D) lanes, mean, + eps, 1 / sqrt (correctly rounded fp32 here; an
    approximate rsqrtf on the GPU), fp32 (x inv) w, rounded to T."""
    f32 = np.float32
    d = x.shape[-1]
    lanes = 32
    while lanes < d:
        lanes *= 2
    tree = np.zeros(x.shape[:-1] + (lanes,), f32)
    tree[..., :d] = x.astype(f32) * x.astype(f32)
    while tree.shape[-1] > 1:  # lane c adds lane c + stride
        half = tree.shape[-1] // 2
        tree = tree[..., :half] + tree[..., half:]
    mean = tree[..., 0] / f32(d) + f32(eps)
    inverse = (1.0 / np.sqrt(mean.astype(np.float64))).astype(f32)
    return round_to((x.astype(f32) * inverse[..., None]) * weight.astype(f32), dtype)


def prepare(x: np.ndarray, weight: np.ndarray | None, positions: np.ndarray, call: Call) -> np.ndarray:
    """Heads [N, H, D] of T values through RMSNorm (weight given) then rotary (do_rotary): T values."""
    dtype = call.dtype
    if weight is not None:
        x = norm(x, weight, dtype, float(np.float32(call.attr("qk_norm_epsilon", 1e-6))))
    if not call.attr("do_rotary", 0):
        return x
    half, offset = call.cos_cache.shape[1], call.attr("rotary_offset", 0)
    out = x.copy()
    cos = call.cos_cache[positions][:, None, :]  # [N, 1, half]
    sin = call.sin_cache[positions][:, None, :]
    for r in range(2 * half):
        if call.attr("rotary_interleaved", 0):
            i, partner, sign = r // 2, r - 1 if r % 2 else r + 1, 1.0 if r % 2 else -1.0
        else:
            i, partner, sign = r % half, r + half if r < half else r - half, -1.0 if r < half else 1.0
        a, b = x[..., offset + r], x[..., offset + partner]
        out[..., offset + r] = rotate(a, b, cos[..., i], sin[..., i], sign, dtype)
    return out


def store(
    cache: np.ndarray, rows: np.ndarray, slots: np.ndarray, scale: np.ndarray | None, quant: str, call: Call
) -> None:
    """Rows [N, Hk, D] (T values) into their slots of ``cache``, quantized per the contract."""
    bs, hk, d = cache.shape[1], cache.shape[2], cache.shape[3]
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        row = rows[t]
        if call.cache_dtype in ("int8", "float8e4m3fn"):
            per_channel = scale.reshape(hk, d) if quant == "PER_CHANNEL" else np.full((hk, d), scale.reshape(-1)[0])
            row = quantize(row, per_channel, call.cache_dtype)
        cache[slot // bs, slot % bs] = row


def reference(call: Call, dequantized_in_t: bool = True) -> Result:
    """The call's output (float64), its caches after the write, the prepared queries and the slots.
    ``dequantized_in_t`` (the default): each dequantized cache element (fp32 ``e * scale``) rounded to T
    before attention, as ORT's CUDA kernel does (found on an H200, 2026-12-04: docs/ort-paged-attention.md
    "Cache bytes") and this project's kernel now does for T float16 / bfloat16 (for float32 the rounding
    is fp32's own, which the kernel's folded scales meet within the float32 tolerance); False keeps them
    exact, as this project's kernel did before (tests/test_gpu_results.py compares the two)."""
    hq, hk = call.attr("num_heads", 0), call.attr("kv_num_heads", 0)
    latent = call.attr("kv_cache_layout", "SEPARATE") == "LATENT"
    packed = call.key is None and not latent
    n = call.query.shape[0]
    d = call.query.shape[1] // (hq + 2 * hk if packed else hq)
    dv = call.attr("v_head_size", 0) or d
    cu, past, table = (
        np.asarray(a, dtype=np.int64) for a in (call.cumulative_sequence_length, call.past_seqlens, call.block_table)
    )
    bs = call.key_cache.shape[1]
    q_rows = call.query[:, : hq * d]
    k_rows = call.query[:, hq * d : (hq + hk) * d] if packed else call.key
    v_rows = call.query[:, (hq + hk) * d :] if packed else call.value

    positions, owner = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for b in range(len(past)):
        for j in range(cu[b + 1] - cu[b]):
            positions[cu[b] + j], owner[cu[b] + j] = past[b] + j, b
    if call.slot_mapping is not None:
        slots = np.where(np.asarray(call.slot_mapping) < 0, -1, np.asarray(call.slot_mapping)).astype(np.int64)
    else:
        slots = np.array([table[owner[t], positions[t] // bs] * bs + positions[t] % bs for t in range(n)], np.int64)

    queries = prepare(_heads(q_rows, hq, d), call.q_norm_weight, positions, call)
    keys = prepare(_heads(k_rows, hk, d), call.k_norm_weight, positions, call)
    key_cache = call.key_cache.copy()
    store(key_cache, keys, slots, call.k_scale, call.attr("k_quant_type", "NONE"), call)
    value_cache = None
    if not latent:
        value_cache = call.value_cache.copy()
        store(value_cache, _heads(v_rows, hk, d), slots, call.v_scale, call.attr("v_quant_type", "NONE"), call)

    output = attention(call, queries, key_cache, value_cache, cu, past, table, d, dv, dequantized_in_t)
    return Result(output.reshape(n, hq * dv), key_cache, value_cache, queries, slots)


def attention(
    call: Call,
    queries: np.ndarray,
    key_cache: np.ndarray,
    value_cache: np.ndarray | None,
    cu: np.ndarray,
    past: np.ndarray,
    table: np.ndarray,
    d: int,
    dv: int,
    dequantized_in_t: bool = True,
) -> np.ndarray:
    """The attention part, ORT's attributes mapped onto the attention core's reference
    (attention_reference.paged_attention): a local window of W positions ending at the token is
    ``window = W - 1`` (ORT passes W - 1 to FlashAttention's window_size_left); scale 0 is 1 / sqrt(D)
    (rounded to fp32, as an attribute is); LATENT reads V from the key rows with the key's scale."""
    latent = value_cache is None
    quant = {"NONE": NONE, "PER_TENSOR": PER_TENSOR, "PER_CHANNEL": PER_CHANNEL}
    k_quant = quant[call.attr("k_quant_type", "NONE")]
    v_quant = k_quant if latent else quant[call.attr("v_quant_type", "NONE")]
    k_scale = None if call.k_scale is None else call.k_scale.reshape(-1).astype(np.float64)
    v_scale = k_scale if latent else None if call.v_scale is None else call.v_scale.reshape(-1).astype(np.float64)
    window = call.attr("local_window_size", -1)

    def stored(cache: np.ndarray) -> np.ndarray:
        return float8_decode(cache) if call.cache_dtype == "float8e4m3fn" else cache.astype(np.float64)

    counts = cu[1:] - cu[:-1]
    return paged_attention(
        queries.astype(np.float64), stored(key_cache), None if latent else stored(value_cache), table, cu[:-1], counts,
        past + counts, scale=float(np.float32(call.attr("scale", 0.0) or 1.0 / np.sqrt(d))), value_head_dim=dv,
        key_quant=k_quant, key_scale=k_scale, value_quant=v_quant, value_scale=v_scale,
        softcap=float(np.float32(call.attr("softcap", 0.0))), window=window - 1 if window > 0 else -1,
        head_sink=None if call.head_sink is None else call.head_sink.astype(np.float64),
        causal=bool(call.attr("is_causal", 1)),
        round_dequantized=(lambda v: round_to(v.astype(np.float32), call.dtype).astype(np.float64))
        if dequantized_in_t else None,
    )  # fmt: skip
