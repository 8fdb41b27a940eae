"""Run an ASan+UBSan build of the attention core on plans built directly (no ORT, no torch).

usage: python attention_core_session.py <sanitized libpakv_ort.so> <pakv_onnx/native_lib/__init__.py> N
Started by tests/test_native_sanitizers.py with LD_PRELOAD=libasan.so; any invalid access or
undefined behaviour aborts the process, so exit 0 means clean.

Covers what pakv::PagedAttention's ORT session cannot reach: N random plans over every feature of
pakv_attention_plan (query / output / cache types apart, int8 and float8e4m3fn caches with per-tensor
or per-channel scales, LATENT, softcap, window, sinks, causal 0, GQA, ragged prefill and decode rows,
block sizes, strided pools with gaps, dequantized elements exact or rounded to float16 / bfloat16
as ORT's CUDA kernel rounds them: dequantized_type), each on the calling thread and on the library's threads (bitwise
equal), checked against tests/attention_reference.py; slots no query sees hold NaN and table entries no
query reads hold garbage; non-finite scores; and malformed plans, refused. Every array is numpy,
read in place: a read past a pool, the query, a scale or the sinks is reported.
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
from pathlib import Path

import numpy as np

LIB, LOADER = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location("native_lib", LOADER)
loader = importlib.util.module_from_spec(spec)
spec.loader.exec_module(loader)
lib = loader.declare(ctypes.CDLL(LIB))
loader.check_abi(lib, LIB)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention_reference import NONE, PER_CHANNEL, PER_TENSOR, decode_float8_e4m3fn, paged_attention  # noqa: E402

F32, F16, BF16, I8, FP8 = 1, 10, 16, 3, 17
QUANT = {NONE: 0, PER_TENSOR: 1, PER_CHANNEL: 2}
KINDS = [(F32, NONE), (F16, NONE), (BF16, NONE), (I8, PER_TENSOR), (I8, PER_CHANNEL), (FP8, PER_TENSOR), (FP8, PER_CHANNEL)]
STORAGE = {F32: np.float32, F16: np.float16, BF16: np.uint16, I8: np.int8, FP8: np.uint8}
rng = np.random.default_rng(0)


def encode(values, onnx_type):
    """fp64 values as stored elements of `onnx_type` (bf16 as its bits, rounded to nearest even;
    int8 rounded; fp8 through the nearest of its 254 finite values)."""
    if onnx_type == BF16:
        bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    if onnx_type == I8:
        return np.clip(np.round(values * 40), -127, 127).astype(np.int8)
    if onnx_type == FP8:
        table = decode_float8_e4m3fn(np.arange(256))
        finite = np.flatnonzero(~np.isnan(table))
        return finite[np.abs(table[finite][None, :] - values.reshape(-1, 1)).argmin(1)].astype(np.uint8).reshape(values.shape)
    return values.astype(STORAGE[onnx_type])


def decode(array, onnx_type):
    if onnx_type == BF16:
        return (array.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if onnx_type == FP8:
        return decode_float8_e4m3fn(array)
    return array.astype(np.float64)


def poison(array, onnx_type):
    array[...] = {F32: np.nan, F16: np.nan, BF16: 0x7FC0, I8: -128, FP8: 0x7F}[onnx_type]


def random_case():
    """A random plan's arrays and scalars: pools [nb, bs, Hk, D] inside a wider buffer (gaps between
    blocks and heads), slots no query sees poisoned, unread table entries garbage."""
    hk, group = int(rng.integers(1, 4)), int(rng.choice([1, 2, 4, 5]))
    d = int(rng.choice([3, 8, 17, 64]))
    latent = rng.random() < 0.2
    dv = int(rng.integers(1, d + 1)) if latent else int(rng.choice([3, 16, 64]))
    bs = int(rng.choice([1, 5, 16]))
    key, value = KINDS[rng.integers(7)], KINDS[rng.integers(7)]
    if latent:
        value = (key[0], PER_CHANNEL if key[1] == PER_TENSOR else key[1])
    window = int(rng.choice([-1, -1, 0, 2, 30]))
    new = rng.integers(0, 5, int(rng.integers(1, 5))) * (rng.integers(4, size=1) > 0)
    if rng.integers(3) == 0:
        new[rng.integers(len(new))] = rng.integers(17, 48)
    past = rng.integers(0, 70, len(new))
    lengths = past + new
    need = -(-lengths // bs)
    nb = int(need.sum()) + 2
    pad_head, pad_block = int(rng.integers(0, 3)), int(rng.integers(0, 2))
    key_buffer = np.empty((nb, bs + pad_block, hk + pad_head, d), STORAGE[key[0]])
    poison(key_buffer, key[0])
    key_pool = key_buffer[:, :bs, :hk]
    value_pool = None
    if not latent:
        value_buffer = np.empty((nb, bs, hk, dv + int(rng.integers(0, 3))), STORAGE[value[0]])
        poison(value_buffer, value[0])
        value_pool = value_buffer[..., :dv]
    table = np.where(rng.integers(2, size=(len(new), int(need.max()) + 1)) > 0, -1, nb + 9).astype(np.int64)
    ids = rng.permutation(nb)
    at = 0
    for b in range(len(new)):
        first = max(0, int(lengths[b] - new[b]) - window) if window >= 0 else 0
        for c in range(need[b]):
            block, at = ids[at], at + 1
            if new[b] == 0 or (c + 1) * bs <= first:
                continue
            table[b, c] = block
            lo, hi = max(first, c * bs), min(int(lengths[b]), (c + 1) * bs)
            key_pool[block, lo - c * bs : hi - c * bs] = encode(rng.standard_normal((hi - lo, hk, d)), key[0])
            if value_pool is not None:
                value_pool[block, lo - c * bs : hi - c * bs] = encode(rng.standard_normal((hi - lo, hk, dv)), value[0])
    query_type, out_type = int(rng.choice([F32, F16, BF16])), int(rng.choice([F32, F16, BF16]))

    def scales(kind, dim):
        if kind[1] == NONE:
            return None
        base = 1 / 40 if kind[0] == I8 else 1.0
        return (base * (0.5 + rng.random(1 if kind[1] == PER_TENSOR else hk * dim))).astype(np.float32)

    return dict(
        query=encode(rng.standard_normal((int(new.sum()), hk * group, d)), query_type), query_type=query_type,
        out_type=out_type, key=key, value=value, key_pool=key_pool, value_pool=value_pool, dv=dv, table=table,
        starts=np.concatenate([[0], np.cumsum(new)[:-1]]).astype(np.int64), counts=new.astype(np.int64),
        lengths=lengths.astype(np.int64), key_scale=scales(key, d), value_scale=scales(value, dv),
        scale=float(rng.choice([1 / np.sqrt(d), 0.37, -0.8])), softcap=float(rng.choice([0.0, 0.0, 2.0])),
        window=window, sink=(rng.standard_normal(hk * group) * 2).astype(np.float32) if rng.random() < 0.4 else None,
        causal=int(rng.random() < 0.7), dequantized_type=int(rng.choice([0, F16, BF16])),
    )  # fmt: skip


def plan_of(case, out):
    k, v = case["key_pool"], case["value_pool"] if case["value_pool"] is not None else case["key_pool"]
    q, t = case["query"], case["table"]

    def address(a):
        return None if a is None else a.ctypes.data

    return loader.AttentionPlan(
        query_type=case["query_type"], out_type=case["out_type"], tables64=1, causal=case["causal"],
        num_blocks=k.shape[0], block_size=k.shape[1], key_cache=k.ctypes.data, value_cache=v.ctypes.data,
        key_type=case["key"][0], value_type=case["value"][0], key_quant=QUANT[case["key"][1]],
        value_quant=QUANT[case["value"][1]], key_scale=address(case["key_scale"]),
        value_scale=address(case["value_scale"]), key_block_stride=k.strides[0], value_block_stride=v.strides[0],
        key_row_stride=k.strides[1], value_row_stride=v.strides[1], key_head_stride=k.strides[2],
        value_head_stride=v.strides[2], num_heads=q.shape[1], num_kv_heads=k.shape[2], head_dim=q.shape[2],
        value_head_dim=case["dv"], query=q.ctypes.data, query_token_stride=q.strides[0],
        query_head_stride=q.strides[1], out=out.ctypes.data, num_tokens=q.shape[0], num_seqs=len(case["counts"]),
        table_cols=t.shape[1], block_tables=t.ctypes.data, table_row_stride=t.strides[0],
        table_col_stride=t.strides[1], query_starts=case["starts"].ctypes.data,
        query_counts=case["counts"].ctypes.data, context_lens=case["lengths"].ctypes.data, scale=case["scale"],
        softcap=case["softcap"], window=case["window"], head_sink=address(case["sink"]),
        dequantized_type=case["dequantized_type"],
    )  # fmt: skip


def run(case, threads=0, **changes):
    """The core's output (decoded to fp64) or its error: (None, kind, message)."""
    q = case["query"]
    out = np.zeros((q.shape[0], q.shape[1], case["dv"]), STORAGE[case["out_type"]])
    plan = plan_of(case, out)
    for name, value in changes.items():
        setattr(plan, name, value)
    error = ctypes.create_string_buffer(1024)
    if threads:
        kind = lib.pakv_attention_threads(ctypes.byref(plan), threads, error, 1024)
    else:
        kind = lib.pakv_attention(ctypes.byref(plan), error, 1024)
    return (out if kind == 0 else None), kind, error.value.decode()


def round_to(values, onnx_type):
    """fp64 values through fp32, rounded to float16 / bfloat16 (nearest even), as fp64."""
    if onnx_type == F16:
        return values.astype(np.float32).astype(np.float16).astype(np.float64)
    return decode(encode(values, BF16), BF16)


def reference(case):
    dequantized = case["dequantized_type"]
    return paged_attention(
        decode(case["query"], case["query_type"]), decode(case["key_pool"], case["key"][0]),
        None if case["value_pool"] is None else decode(case["value_pool"], case["value"][0]), case["table"],
        case["starts"], case["counts"], case["lengths"], scale=float(np.float32(case["scale"])),
        value_head_dim=case["dv"], key_quant=case["key"][1], key_scale=case["key_scale"],
        value_quant=case["value"][1], value_scale=case["value_scale"], softcap=float(np.float32(case["softcap"])),
        window=case["window"], head_sink=case["sink"], causal=bool(case["causal"]),
        round_dequantized=(lambda v: round_to(v, dequantized)) if dequantized else None,
    )  # fmt: skip


def valid_plans(count):
    """Random plans: the reference's answer within the core's tolerance (fp32 2e-5 + 1e-5 |want| at
    O(1) values; 16-bit outputs one rounding step), NaN exactly where the reference has NaN; the
    library's threads give the same bytes."""
    for i in range(count):
        case = random_case()
        got, kind, message = run(case)
        assert kind == 0, (i, message)
        threaded, kind, message = run(case, threads=int(rng.integers(2, 5)))
        assert kind == 0 and np.array_equal(got.view(np.uint8), threaded.view(np.uint8)), (i, message)
        want, mine = reference(case), decode(got, case["out_type"])
        assert np.array_equal(np.isnan(want), np.isnan(mine)), i
        atol, rtol = {F32: (2e-5, 1e-5), F16: (2e-3, 2**-9), BF16: (2e-2, 2**-6)}[case["out_type"]]
        scale = np.abs(want[~np.isnan(want)])
        assert (np.abs(mine - want)[~np.isnan(want)] <= atol * max(1.0, scale.max(initial=0)) + rtol * scale).all(), i


def malformed_plans():
    """Each rule the core checks, broken once on a valid plan (one with new tokens): refused."""
    case = random_case()
    while not case["counts"].any():
        case = random_case()
    for changes, kind in [(dict(key_type=7), 2), (dict(query_type=3), 2), (dict(key_quant=3), 2),
                          (dict(key_type=I8, key_quant=1, key_scale=None), 1),
                          (dict(value_type=FP8, value_quant=2, value_scale=None), 1), (dict(softcap=-1.0), 1),
                          (dict(window=-5), 1), (dict(causal=3), 1), (dict(scale=float("nan")), 1),
                          (dict(num_kv_heads=0), 1), (dict(key_block_stride=-4), 1), (dict(num_tokens=2**62), 1),
                          (dict(table_cols=0), 1), (dict(block_size=0), 1), (dict(dequantized_type=I8), 2)]:  # fmt: skip
        out, got, message = run(case, **changes)
        assert out is None and got == kind, (changes, got, message)


valid_plans(int(sys.argv[3]))
malformed_plans()
print("clean", flush=True)
