"""An independent fp64 numpy reference of the attention core's math (pakv_core.h, pakv_attention_plan).

Written from the plan's definition, not from the C code: every position is read on its own through
the block table (no chunks, no online softmax), in float64, one function per feature. The core's
tests (tests/test_attention_core.py) and the fused op's reuse it; extend it the same way (one
function per feature, shapes in the docstring).

Conventions (every array a numpy array):

- ``query``: [N, Hq, D] float64, the query rows of every sequence's new tokens, back to back.
- ``key_stored`` / ``value_stored``: [num_blocks, block_size, Hk, D] / [..., Dv] float64 holding a
  cache's *stored* elements (what the bytes decode to: :func:`stored_float64`); a quantized cache's
  value is stored x scale (:func:`dequantize`). LATENT: ``value_stored`` is None and V is each key
  row's leading Dv stored channels, with the value's own quantization.
- ``block_table``: [B, cols] ints; ``query_starts``, ``query_counts``, ``context_lens``: [B] ints.
  Sequence b's n = query_counts[b] new tokens are query rows [query_starts[b], + n), at positions
  L - n .. L - 1 of its context of L = context_lens[b] positions.
- Quantization: ``"none"``, ``"per_tensor"`` (scale [1]) or ``"per_channel"`` (scale [Hk * dim]).

Non-finite rules (one list for every backend): positions a query does not see are never read; a
score of -inf weighs exactly 0 and its value row is not multiplied in; a NaN or +inf score (the
sink's included) makes the row NaN; a row whose every score is -inf is NaN, or 0 when a finite sink
gives the denominator. Softcap maps +-inf to +-softcap (tanh's limits) before those rules apply.
"""

from __future__ import annotations

import numpy as np

NONE, PER_TENSOR, PER_CHANNEL = "none", "per_tensor", "per_channel"


# --------------------------------------------------------------------------- #
# Stored elements
# --------------------------------------------------------------------------- #
def decode_float8_e4m3fn(bits: np.ndarray) -> np.ndarray:
    """uint8 bytes of float8e4m3fn (ONNX 17) -> float64, any shape: 1 sign, 4 exponent bits (bias
    7), 3 mantissa bits; exponent 0 is subnormal (mantissa x 2^-9); 0x7F / 0xFF are NaN; no inf."""
    bits = np.asarray(bits, dtype=np.uint8).astype(np.int64)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent, mantissa = (bits >> 3) & 0xF, bits & 7
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0)
    subnormal = mantissa * 2.0**-9
    magnitude = np.where(exponent == 0, subnormal, normal)
    return np.where((bits & 0x7F) == 0x7F, np.nan, sign * magnitude)


def stored_float64(tensor) -> np.ndarray:
    """A torch tensor's stored elements as float64 numpy (float8_e4m3fn decoded from its bytes with
    :func:`decode_float8_e4m3fn`, int8 as integers, float types widened exactly)."""
    import torch

    if tensor.dtype == torch.float8_e4m3fn:
        return decode_float8_e4m3fn(tensor.contiguous().view(torch.uint8).numpy())
    if tensor.dtype == torch.int8:
        return tensor.numpy().astype(np.float64)
    return tensor.to(torch.float64).numpy()


def dequantize(stored: np.ndarray, quant: str, scale: np.ndarray | None, kv_head: int) -> np.ndarray:
    """One kv head's rows [..., dim] of stored elements -> values: as is (NONE), x scale[0]
    (PER_TENSOR) or x scale[kv_head * dim + d] per channel d (PER_CHANNEL)."""
    if quant == NONE:
        return stored
    scale = np.asarray(scale, dtype=np.float64)
    if quant == PER_TENSOR:
        return stored * scale[0]
    dim = stored.shape[-1]
    return stored * scale[kv_head * dim : (kv_head + 1) * dim]


# --------------------------------------------------------------------------- #
# Which positions, read how
# --------------------------------------------------------------------------- #
def visible_positions(length: int, count: int, j: int, causal: bool, window: int) -> tuple[int, int]:
    """[lo, hi] (inclusive) of the context new token j (of `count`, at position length - count + j)
    sees: up to itself when causal, else the whole context; back to position p - window when
    window >= 0."""
    position = length - count + j
    hi = position if causal else length - 1
    lo = max(0, position - window) if window >= 0 else 0
    return lo, hi


def read_position(stored: np.ndarray, table_row: np.ndarray, position: int, kv_head: int) -> np.ndarray:
    """The stored row [dim] of one kv head at one context position, through the block table."""
    block_size = stored.shape[1]
    block = int(table_row[position // block_size])
    assert 0 <= block < stored.shape[0], f"position {position} reads block {block}"
    return stored[block, position % block_size, kv_head]


# --------------------------------------------------------------------------- #
# Scores and softmax
# --------------------------------------------------------------------------- #
def scores(query_row: np.ndarray, keys: np.ndarray, scale: float, softcap: float) -> np.ndarray:
    """[n] scores of one query row [D] against key values [n, D]: scale x q . k, then
    softcap x tanh(s / softcap) when softcap > 0."""
    with np.errstate(invalid="ignore", over="ignore"):
        s = scale * (keys @ query_row)
        if softcap > 0:
            s = softcap * np.tanh(s / softcap)
    return s


def softmax_weights(s: np.ndarray, sink: float | None) -> tuple[np.ndarray, float] | None:
    """Weights [n] and the denominator of scores [n] plus an optional sink logit (in the denominator,
    no value), stabilized by the max over the finite scores and the sink; None when the row is NaN
    (a NaN or +inf score or sink, or nothing finite to weigh)."""
    logits = s if sink is None else np.append(s, sink)
    if np.isnan(logits).any() or np.isposinf(logits).any():
        return None
    finite = logits[np.isfinite(logits)]
    if finite.size == 0:
        return None
    top = finite.max()
    weights = np.where(np.isneginf(s), 0.0, np.exp(np.where(np.isneginf(s), 0.0, s - top)))
    denominator = weights.sum() + (np.exp(sink - top) if sink is not None and np.isfinite(sink) else 0.0)
    return weights, denominator


def weighted_values(weights: np.ndarray, values: np.ndarray) -> np.ndarray:
    """sum over rows with weight != 0 of weight x value row: [n] x [n, Dv] -> [Dv] (a row of weight 0,
    a -inf score's, is not multiplied in: 0 x NaN must not poison the output)."""
    kept = weights != 0
    return weights[kept] @ values[kept] if kept.any() else np.zeros(values.shape[1])


# --------------------------------------------------------------------------- #
# The attention
# --------------------------------------------------------------------------- #
def attend_row(query_row, keys, values, scale, softcap, sink) -> np.ndarray:
    """One query row [D] over its visible key values [n, D] and value values [n, Dv] -> [Dv]."""
    weighed = softmax_weights(scores(query_row, keys, scale, softcap), sink)
    if weighed is None:
        return np.full(values.shape[1], np.nan)
    weights, denominator = weighed
    return weighted_values(weights, values) / denominator


def paged_attention(
    query: np.ndarray,
    key_stored: np.ndarray,
    value_stored: np.ndarray | None,
    block_table: np.ndarray,
    query_starts: np.ndarray,
    query_counts: np.ndarray,
    context_lens: np.ndarray,
    *,
    scale: float,
    value_head_dim: int | None = None,
    key_quant: str = NONE,
    key_scale: np.ndarray | None = None,
    value_quant: str = NONE,
    value_scale: np.ndarray | None = None,
    softcap: float = 0.0,
    window: int = -1,
    head_sink: np.ndarray | None = None,
    causal: bool = True,
    round_dequantized=None,
) -> np.ndarray:
    """The plan's attention -> [N, Hq, Dv] float64 (rows of tokens no sequence owns stay 0).

    Query head h reads kv head h // (Hq // Hk) (GQA). LATENT: value_stored None, V = the key rows'
    leading value_head_dim stored channels, dequantized with the value's quantization.
    ``round_dequantized`` (values -> values), where given, is applied to each quantized side's
    dequantized elements (ORT's CUDA kernel rounds them to T: ort_attention_reference)."""
    n_tokens, heads, _ = query.shape
    kv_heads = key_stored.shape[2]
    group = heads // kv_heads
    value_head_dim = value_head_dim if value_stored is None else value_stored.shape[3]
    out = np.zeros((n_tokens, heads, value_head_dim))
    for b in range(len(query_counts)):
        count, length, start = int(query_counts[b]), int(context_lens[b]), int(query_starts[b])
        for j in range(count):
            lo, hi = visible_positions(length, count, j, causal, window)
            positions = range(lo, hi + 1)
            for g in range(kv_heads):
                k_rows = np.stack([read_position(key_stored, block_table[b], p, g) for p in positions])
                if value_stored is None:
                    v_rows = k_rows[:, :value_head_dim]
                else:
                    v_rows = np.stack([read_position(value_stored, block_table[b], p, g) for p in positions])
                keys = dequantize(k_rows, key_quant, key_scale, g)
                values = dequantize(v_rows, value_quant, value_scale, g)
                if round_dequantized is not None:
                    keys = keys if key_quant == NONE else round_dequantized(keys)
                    values = values if value_quant == NONE else round_dequantized(values)
                for h in range(g * group, (g + 1) * group):
                    sink = None if head_sink is None else float(head_sink[h])
                    out[start + j, h] = attend_row(query[start + j, h], keys, values, scale, softcap, sink)
    return out
