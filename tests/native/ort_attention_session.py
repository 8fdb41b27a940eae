"""com.microsoft::PagedAttention in an ASan + UBSan build of the C library inside ONNX Runtime (no torch,
no pakv_onnx package): random valid calls of every feature against the numpy reference
(tests/ort_attention_reference.py), every kind of broken call refused with nothing written, a writer
racing the block table, outputs bound over inputs.

usage: python ort_attention_session.py <sanitized libpakv_ort.so> <pakv_onnx/native_lib/__init__.py> [N]
Started by tests/test_native_sanitizers.py with LD_PRELOAD=libasan.so; any invalid access or undefined
behaviour aborts the process, so exit 0 and "clean" mean clean. Sessions run without ORT's CPU arena
(each output its own malloc) and read numpy inputs in place, so a read or write one element past any
tensor is reported.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the reference modules
from ort_attention_reference import Call, reference, round_to

LIB = sys.argv[1]
NAMES = (
    "query", "key", "value", "key_cache", "value_cache", "cumulative_sequence_length", "past_seqlens", "block_table",
    "cos_cache", "sin_cache", "slot_mapping", "head_sink", "q_norm_weight", "k_norm_weight", "k_scale", "v_scale",
    "attention_metadata",
)  # fmt: skip
ONNX = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16,
        "int8": TensorProto.INT8, "float8e4m3fn": TensorProto.FLOAT8E4M3FN}  # fmt: skip
# numpy types ORT binds by address (read in place, no copy), with their ONNX types.
NATIVE = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16, np.int8: TensorProto.INT8,
          np.int32: TensorProto.INT32}  # fmt: skip
TOLERANCE = {"float32": (5e-5, 1e-4), "float16": (1e-3, 1e-2), "bfloat16": (1e-2, 2e-2)}
ORT_ERRORS = (RuntimeError, ort.capi.onnxruntime_pybind11_state.Fail,
              ort.capi.onnxruntime_pybind11_state.InvalidArgument,
              ort.capi.onnxruntime_pybind11_state.RuntimeException)  # fmt: skip
rng = np.random.default_rng(0)
sessions: dict = {}


def encode(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 T values as the op's buffer: float32, float16, or bfloat16 as its bits."""
    if dtype == "bfloat16":
        return (round_to(values, "bfloat16").view(np.uint32) >> 16).astype(np.uint16)
    return values.astype(np.float16 if dtype == "float16" else np.float32)


def decode(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


def random_call(dtype: str) -> tuple[Call, dict]:
    """A random valid call of every feature (the reference's view, with T values as float32)."""
    latent = rng.random() < 0.2
    hk = 1 if latent else int(rng.choice([1, 2]))
    hq = hk * int(rng.choice([1, 2, 4]))
    d = int(rng.choice([8, 16, 24])) if not latent else 24
    bs = int(rng.choice([1, 2, 4, 16]))
    seqs = [(int(rng.integers(0, 20)), int(rng.integers(0, 6))) for _ in range(int(rng.integers(1, 4)))]
    n = sum(new for _, new in seqs)
    needs = [-(-(p + new) // bs) for p, new in seqs]
    nb = sum(needs) + 2
    cols = max(needs) + 1
    table = np.full((len(seqs), cols), -1, np.int32)
    order, at = rng.permutation(nb), 0
    for b, need in enumerate(needs):
        table[b, :need], at = order[at : at + need], at + need
    cache_dtype = str(rng.choice([dtype, dtype, "int8", "float8e4m3fn"]))
    quant = str(rng.choice(["PER_TENSOR", "PER_CHANNEL"])) if cache_dtype in ("int8", "float8e4m3fn") else None
    values = lambda *shape: round_to(rng.standard_normal(shape).astype(np.float32), dtype)
    packed = not latent and rng.random() < 0.3
    attrs = {"num_heads": hq, "kv_num_heads": hk}
    call = {
        "query": values(n, (hq + 2 * hk) * d if packed else hq * d),
        "key": None if packed else values(n, hk * d),
        "value": None if packed or latent else values(n, hk * d),
        "cumulative_sequence_length": np.concatenate([[0], np.cumsum([new for _, new in seqs])]).astype(np.int32),
        "past_seqlens": np.array([p for p, _ in seqs], np.int32),
        "block_table": table,
    }
    shape = (nb, bs, hk, d)
    if cache_dtype == "int8":
        caches = [rng.integers(-100, 100, shape).astype(np.int8) for _ in range(2)]
    elif cache_dtype == "float8e4m3fn":
        caches = [(rng.integers(0, 0x7E, shape) | (rng.integers(0, 2, shape) << 7)).astype(np.uint8) for _ in range(2)]
    else:
        caches = [values(*shape) for _ in range(2)]
    call.update(key_cache=caches[0], value_cache=None if latent else caches[1])
    if rng.random() < 0.6:
        rd = 8 if latent else int(rng.choice([d, 8]))
        offset = 16 if latent else 0
        rows = max(p + new for p, new in seqs) + 1
        angles = np.arange(rows)[:, None] / 10.0 ** np.arange(rd // 2)[None, :]
        call.update(cos_cache=round_to(np.cos(angles).astype(np.float32), dtype),
                    sin_cache=round_to(np.sin(angles).astype(np.float32), dtype))  # fmt: skip
        attrs.update(do_rotary=1, rotary_interleaved=int(rng.integers(0, 2)), rotary_offset=offset)
    if not latent and rng.random() < 0.3:
        call.update(q_norm_weight=values(d), k_norm_weight=values(d))
    if rng.random() < 0.4:
        slots = [
            int(table[b, (p + j) // bs]) * bs + (p + j) % bs for b, (p, new) in enumerate(seqs) for j in range(new)
        ]
        call["slot_mapping"] = np.array([-1 if rng.random() < 0.2 else s for s in slots], np.int32)
    if not latent and rng.random() < 0.3:
        call["head_sink"] = values(hq)
    for side, name in ((0, "k"), (1, "v")):
        if quant and not (latent and side):
            scale_shape = (1,) if quant == "PER_TENSOR" else (hk, 1, d)
            call[f"{name}_scale"] = (rng.random(scale_shape) * 0.05 + 0.01).astype(np.float32)
            attrs[f"{name}_quant_type"] = quant
    if latent:
        attrs.update(kv_cache_layout="LATENT", v_head_size=16, scale=0.3)
    if rng.random() < 0.3:
        attrs["local_window_size"] = int(rng.integers(1, 6))
    if rng.random() < 0.3:
        attrs["softcap"] = 2.0
    if rng.random() < 0.2:
        attrs["is_causal"] = 0
    return Call(
        dtype, cache_dtype, attributes=attrs, **{k: call.get(k) for k in NAMES if k != "attention_metadata"}
    ), call


def model(call: Call, present: dict) -> bytes:
    names = [n if present.get(n) is not None else "" for n in NAMES]
    while not names[-1]:
        names.pop()
    latent = call.attributes.get("kv_cache_layout") == "LATENT"
    outputs = ["output", "key_cache_out"] + ([] if latent else ["value_cache_out"])
    node = helper.make_node("PagedAttention", names, outputs, domain="com.microsoft", **call.attributes)

    def element(name):
        if name in ("key_cache", "value_cache"):
            return ONNX[call.cache_dtype]
        if name in ("k_scale", "v_scale"):
            return TensorProto.FLOAT
        return TensorProto.INT32 if present[name].dtype == np.int32 else ONNX[call.dtype]

    inputs = [helper.make_tensor_value_info(n, element(n), None) for n in names if n]
    outs = [
        helper.make_tensor_value_info(o, ONNX[call.dtype if o == "output" else call.cache_dtype], None) for o in outputs
    ]
    graph = helper.make_graph([node], "g", inputs, outs)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8).SerializeToString()


def session(proto: bytes, threads: int):
    key = (proto, threads)
    if key not in sessions:
        options = ort.SessionOptions()
        options.register_custom_ops_library(LIB)
        options.intra_op_num_threads = threads
        options.enable_cpu_mem_arena = False
        sessions[key] = ort.InferenceSession(proto, options, providers=["CPUExecutionProvider"])
    return sessions[key]


def buffers(call: Call, arrays: dict) -> dict:
    """The op's input buffers: T tensors encoded (bfloat16 as bits), quantized caches' codes, index
    tensors and scales as they are."""
    out = {}
    for name, value in arrays.items():
        if value is None:
            continue
        raw = value.dtype in (np.int32, np.int8, np.uint8) or name in ("k_scale", "v_scale")
        out[name] = np.ascontiguousarray(value) if raw else encode(value, call.dtype)
    return out


def onnx_type(call: Call, name: str, array: np.ndarray) -> int:
    if name in ("key_cache", "value_cache"):
        return ONNX[call.cache_dtype]
    if name in ("k_scale", "v_scale"):
        return TensorProto.FLOAT
    return TensorProto.INT32 if array.dtype == np.int32 else ONNX[call.dtype]


def run(call: Call, feeds: dict, threads: int = 1, in_place: bool = True, crossed: bool = False) -> dict:
    """One run through IOBinding (every buffer by its ONNX type, read in place): cache outputs bound to
    the caches (in place), to buffers of their own, or ``crossed`` (each over the other cache: a host's
    mistake); the output and the caches after the call."""
    s = session(model(call, feeds), threads)
    binding = s.io_binding()
    value = lambda name, array: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array, onnx_type(call, name, array))
    for name, array in feeds.items():
        if array.dtype.type in NATIVE and NATIVE[array.dtype.type] == onnx_type(call, name, array):
            binding.bind_input(name, "cpu", 0, array.dtype.type, list(array.shape), array.ctypes.data)  # in place
        else:  # bfloat16 / float8 bits: an OrtValue of that type
            binding.bind_ortvalue_input(name, value(name, array))
    caches = [n for n in ("key_cache", "value_cache") if n in feeds]
    width = call.attributes["num_heads"] * (call.attributes.get("v_head_size") or call.key_cache.shape[3])
    out = np.zeros((feeds["query"].shape[0], width), feeds["query"].dtype)
    binding.bind_ortvalue_output("output", ort.OrtValue.ortvalue_from_numpy_with_onnx_type(out, ONNX[call.dtype]))
    result = {"output": out}
    for name, target in zip(caches, caches[::-1] if crossed else caches):
        # In place: the cache's own buffer; else a buffer of its own (the kernel copies the pool there).
        result[name] = feeds[target] if in_place else np.zeros_like(feeds[name])
        binding.bind_ortvalue_output(name + "_out", value(name, result[name]))
    s.run_with_iobinding(binding)
    result["output"] = decode(out, call.dtype)
    return result


def cache_view(cache: np.ndarray, call: Call) -> np.ndarray:
    """A cache as the reference holds it (float32 values, int8 / float8 codes)."""
    if call.cache_dtype in ("int8", "float8e4m3fn"):
        return cache.view(np.uint8 if call.cache_dtype == "float8e4m3fn" else np.int8)
    return decode(cache, call.dtype) if call.cache_dtype == "bfloat16" else cache.astype(np.float32)


def valid_calls(count: int) -> int:
    for i in range(count):
        call, arrays = random_call(str(rng.choice(["float32", "float16", "bfloat16"])))
        want = reference(call)
        got = run(call, buffers(call, arrays), threads=1 + i % 2, in_place=bool(i % 3))
        assert np.array_equal(cache_view(got["key_cache"], call), want.key_cache), ("key_cache", i)
        if want.value_cache is not None:
            assert np.array_equal(cache_view(got["value_cache"], call), want.value_cache), ("value_cache", i)
        expected = round_to(want.output.astype(np.float32), call.dtype)
        atol, rtol = TOLERANCE[call.dtype]
        assert np.all(np.abs(got["output"] - expected) <= atol + rtol * np.abs(expected)), ("output", i)
    return count


# One broken rule per call: (change, a piece of the message).
BREAKS = (
    (lambda a, c: a.__setitem__("past_seqlens", a["past_seqlens"] - 100), "past_seqlens must be non-negative"),
    (lambda a, c: a["block_table"].__setitem__((0, 0), 10**6), "is outside [0, "),
    (lambda a, c: a.__setitem__("cumulative_sequence_length", a["cumulative_sequence_length"][:-1].copy()),
     "past_seqlens must have batch_size"),
    (lambda a, c: a.__setitem__("slot_mapping", np.full(a["query"].shape[0], 10**6, np.int32)), "slot_mapping[0]"),
    (lambda a, c: a.__setitem__("head_sink", np.zeros(99, a["query"].dtype)), "head_sink"),
    (lambda a, c: a.__setitem__("q_norm_weight", np.ones(3, a["query"].dtype)), "norm_weight"),
    (lambda a, c: a.__setitem__("past_seqlens", a["past_seqlens"] + 10**4), "too short"),
)  # fmt: skip


def broken_calls(count: int) -> int:
    refused = 0
    for i in range(count):
        call, arrays = random_call("float32")
        if arrays["query"].shape[0] == 0:
            continue
        feeds = buffers(call, arrays)
        change, text = BREAKS[i % len(BREAKS)]
        change(feeds, call)
        before = {n: feeds[n].copy() for n in ("key_cache", "value_cache") if n in feeds}
        try:
            run(call, feeds)
            continue  # the change broke nothing this call reads (an idle sequence's table row, say)
        except ORT_ERRORS as exc:
            assert text in str(exc) or "must" in str(exc), (text, str(exc)[:300])
            refused += 1
        for name, cache in before.items():  # refused before anything was written
            assert np.array_equal(cache.view(np.uint8), feeds[name].view(np.uint8)), ("written", name)
    assert refused > count // 2, refused
    return refused


def race(seconds: float = 1.0) -> dict:
    """A writer flips block_table entries between valid and invalid ids while calls run: each call
    completes or is refused (by the validator, or by the attention core re-reading an id)."""
    call, arrays = random_call("float32")
    while arrays["cumulative_sequence_length"][1] == 0:  # sequence 0 reads its table row
        call, arrays = random_call("float32")
    call.attributes.pop("local_window_size", None)  # a window could leave column 0 unread
    feeds = buffers(call, arrays)
    table, stop, counts = feeds["block_table"], [], {"ok": 0, "refused": 0}

    def writer():
        valid = table.copy()
        while not stop:
            table[0, 0] = 10**6
            time.sleep(0.0005)
            table[0, 0] = valid[0, 0]
            time.sleep(0.0002)

    thread = threading.Thread(target=writer)
    thread.start()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            run(call, feeds, threads=2)
            counts["ok"] += 1
        except ORT_ERRORS:
            counts["refused"] += 1
    stop.append(1)
    thread.join()
    assert counts["refused"] > 0, counts
    return counts


def outputs_over_inputs() -> None:
    """Each cache output bound over the other cache (a host's mistake) is refused before any write."""
    call, arrays = random_call("float32")
    while arrays.get("value_cache") is None or arrays["query"].shape[0] == 0:
        call, arrays = random_call("float32")
    feeds = buffers(call, arrays)
    before = {n: feeds[n].copy() for n in ("key_cache", "value_cache")}
    try:
        run(call, feeds, crossed=True)
    except ORT_ERRORS as exc:
        assert "overlaps" in str(exc), str(exc)[:300]
        assert all(np.array_equal(before[n].view(np.uint8), feeds[n].view(np.uint8)) for n in before)
        return
    raise AssertionError("cache outputs bound over the other cache were not refused")


# ----------------------------------------------------------------------------------------------------
# Issue 35: an adversarial user's calls, each refused cleanly (nothing written), and the slot race
# ----------------------------------------------------------------------------------------------------
def attack_model(inputs: dict, outputs: tuple, attributes: dict, initializers: dict | None = None) -> bytes:
    """A one-node float32 model of ``inputs`` (numpy arrays; None: absent), the given outputs."""
    from onnx import numpy_helper

    names = [n if inputs.get(n) is not None else "" for n in NAMES]
    while not names[-1]:
        names.pop()
    node = helper.make_node("PagedAttention", names, list(outputs), domain="com.microsoft", **attributes)
    initializers = initializers or {}
    typed = {np.float32: TensorProto.FLOAT, np.int32: TensorProto.INT32, np.int64: TensorProto.INT64}
    graph_inputs = [helper.make_tensor_value_info(n, typed[inputs[n].dtype.type], None) for n in names if n and n not in initializers]
    graph_outputs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs if o]
    graph = helper.make_graph([node], "attack", graph_inputs, graph_outputs,
                              initializer=[numpy_helper.from_array(v, n) for n, v in initializers.items()])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8).SerializeToString()


def attack_run(inputs: dict, outputs: tuple, attributes: dict, bound: bool = True) -> None:
    """One run, every input bound in place; cache outputs (when the node has them) bound to the pools
    (``bound``) or left to ORT."""
    s = session(attack_model(inputs, outputs, attributes), 1)
    binding = s.io_binding()
    for name, array in inputs.items():
        if array is not None:
            binding.bind_input(name, "cpu", 0, array.dtype.type, list(array.shape), array.ctypes.data)
    for name in outputs:
        pool = inputs.get(name.removesuffix("_out"))
        if name != "output" and bound and pool is not None:
            binding.bind_output(name, "cpu", 0, np.float32, list(pool.shape), pool.ctypes.data)
        else:
            binding.bind_output(name, "cpu")
    s.run_with_iobinding(binding)


def attack_call(tokens: int = 1, blocks: int = 4, batch: int = 1, index=np.int32) -> dict:
    """``tokens`` new tokens of sequence 0 (from position 0; one head of 16), ``batch - 1`` idle ones."""
    table = np.full((batch, 1), -1, index)
    table[0, 0] = 1
    cu = np.full(batch + 1, tokens, index)
    cu[0] = 0
    return {"query": np.ones((tokens, 16), np.float32), "key": np.ones((tokens, 16), np.float32),
            "value": np.ones((tokens, 16), np.float32), "key_cache": np.zeros((blocks, 16, 1, 16), np.float32),
            "value_cache": np.zeros((blocks, 16, 1, 16), np.float32), "cumulative_sequence_length": cu,
            "past_seqlens": np.zeros(batch, index), "block_table": table}  # fmt: skip


def attack_refusals() -> int:
    """Each call of issue 35 that reaches ORT, through each node form: refused by its rule, no pool byte
    changed, and (ASan + UBSan) no overflow on the way."""
    heads = {"num_heads": 1, "kv_num_heads": 1}
    forms = (("output", "key_cache_out", "value_cache_out"), ("output",))
    refused = 0

    def refuse(inputs: dict, attributes: dict, text: str, outputs: tuple, bound: bool = True) -> None:
        nonlocal refused
        pools = {n: inputs[n].copy() for n in ("key_cache", "value_cache") if inputs.get(n) is not None}
        try:
            attack_run(inputs, outputs, attributes, bound)
        except ORT_ERRORS as exc:
            assert text in str(exc), (text, str(exc)[:400])
            assert all(np.array_equal(pools[n], inputs[n]) for n in pools), ("written", text)
            refused += 1
            return
        raise AssertionError(f"not refused: {text}")

    for outputs in forms:
        for bound in (True, False):
            rotary = attack_call()
            rotary.update(cos_cache=np.ones((4, 4096), np.float32), sin_cache=np.zeros((4, 4096), np.float32))
            refuse(rotary, {**heads, "do_rotary": 1, "rotary_offset": 2**63 - 8}, "rotary_offset (9223372036854775800)",
                   outputs, bound)
            packed = attack_call()
            packed.update(key=None, value=None)
            refuse(packed, {"num_heads": 2**62, "kv_num_heads": 2**62}, "overflows int64 (query is packed QKV)",
                   outputs, bound)
            inside = attack_call()
            inside["cos_cache"] = inside["key_cache"].reshape(-1)[:64].reshape(8, 8)
            inside["sin_cache"] = np.zeros((8, 8), np.float32)
            refuse(inside, heads, "cos_cache overlaps key_cache in memory", outputs, bound)
    latent = attack_call()
    latent.update(value=None, value_cache=None)
    for attributes, outputs, text in (
        ({**heads, "kv_cache_layout": "LATENT", "v_head_size": 8, "scale": 0.5}, ("output", "key_cache_out", "value_cache_out"),
         "value_cache_out has no place when kv_cache_layout is 'LATENT'"),
        ({**heads, "k_quant_type": "NONE\x00X"}, ("output",), "got '(a NUL at byte 4)'"),
    ):
        call = latent if "LATENT" in attributes.values() else attack_call()
        try:
            session(attack_model(call, outputs, attributes), 1)
            raise AssertionError(f"session created: {text}")
        except ORT_ERRORS as exc:
            assert text in str(exc), (text, str(exc)[:400])
            refused += 1
    constant = attack_call()
    try:
        session(attack_model(constant, ("output",), heads, initializers={"key_cache": constant["key_cache"]}), 1)
        raise AssertionError("a constant pool written in place was accepted")
    except ORT_ERRORS as exc:
        assert "is an initializer" in str(exc) and "no cache outputs" in str(exc), str(exc)[:400]
        refused += 1
    return refused


def slot_race(seconds: float = 2.0) -> dict:
    """A native thread (tests/table_flipper.py) flips an int64 block_table entry between its block and
    2**62 (x block_size overflows int64: UBSan's report on the old code) while a node without cache
    outputs runs in place over a batch whose validation pass is long: each run completes or is refused,
    and no block but the named one is ever written."""
    from table_flipper import Flipping

    call = attack_call(batch=1 << 18, blocks=8, index=np.int64)
    counts = {"ran": 0, "refused": 0}
    with Flipping(call["block_table"].ctypes.data, 2**62, 1):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                attack_run(call, ("output",), {"num_heads": 1, "kv_num_heads": 1})
                counts["ran"] += 1
            except ORT_ERRORS as exc:
                assert "4611686018427387904" in str(exc) or "block_tables changed" in str(exc), str(exc)[:400]
                counts["refused"] += 1
            for cache in (call["key_cache"], call["value_cache"]):
                written = cache.reshape(8, -1).any(axis=1)
                assert not written[[0, *range(2, 8)]].any(), ("a block no table names was written", written)
    assert counts["ran"] + counts["refused"] > 0, counts
    return counts


if __name__ == "__main__":
    count = int(sys.argv[3]) if len(sys.argv) > 3 else 200
    result = {"valid": valid_calls(count), "refused": broken_calls(count // 2), "race": race()}
    outputs_over_inputs()
    result.update(attack=attack_refusals(), slot_race=slot_race())
    print("clean", result, flush=True)
