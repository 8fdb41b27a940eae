"""Run an ASan+UBSan build of the C library inside ONNX Runtime (no torch, no pakv_onnx package).

usage: python sanitizer_session.py <sanitized libpakv_ort.so> <pakv_onnx/native_lib/__init__.py> [N]
       python sanitizer_session.py <sanitized libpakv_ort.so> <...__init__.py> N --device <fake driver .so>
Started by tests/test_native_sanitizers.py with LD_PRELOAD=libasan.so; any invalid access or
undefined behaviour aborts the process (-fno-sanitize-recover), so exit 0 means clean.

With --device (a process of its own: the library keeps its first registration, here the fake
runtime's) the CPU, CUDA and CANN entries run through the fake ORT runtime (tests/fake_ort_api.py)
and the fake driver (tests/native/fake_device_driver.c, host memcpy: ASan checks every copy's
bounds): random valid and invalid calls against the numpy reference, ORT's ParallelFor on the CPU
entry, driver failures.

Covers: random valid and invalid calls checked against a per-token numpy reference (both layouts,
both seq_lens forms, mixed key/value dtypes, any seq_offset), strict attributes, extreme shapes
ORT accepts (Q+1, bytes per token, T * i in the thread split), a writer thread changing the block
table during runs, a second registration on the same options, and the copy core through ctypes
(strided pool views, overlapping blocks, bad plans), the validator through ctypes (records of
valid and invalid calls: exact or refused with nothing written) and outputs a host bound over
each other or over an input (refused before any copy: an overlapping memcpy would be reported).
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
import threading
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

LIB, LOADER = sys.argv[1], sys.argv[2]
INPUTS = ("key_cache", "value_cache", "block_tables", "seq_lens", "seq_offset")
ORT_ERRORS = (RuntimeError, ort.capi.onnxruntime_pybind11_state.Fail,
              ort.capi.onnxruntime_pybind11_state.InvalidArgument,
              ort.capi.onnxruntime_pybind11_state.RuntimeException)  # fmt: skip
# numpy dtype -> ONNX type for the cache dtypes numpy has.
CACHE = {np.float16: TensorProto.FLOAT16, np.float32: TensorProto.FLOAT, np.int8: TensorProto.INT8,
         np.uint8: TensorProto.UINT8, np.int32: TensorProto.INT32}  # fmt: skip
INDEX = {np.int32: TensorProto.INT32, np.int64: TensorProto.INT64}
NUMPY = {v: k for k, v in (*CACHE.items(), *INDEX.items())}  # ONNX type -> numpy type (for bind_input)
rng = np.random.default_rng(0)
sessions: dict = {}


def model(types, mode="Norm", cumsum=1, attrs=None, opset=1):
    names = [n if t is not None else "" for n, t in zip(INPUTS, types)]
    while names and names[-1] == "":
        names.pop()
    inputs = [helper.make_tensor_value_info(n, t, None) for n, t in zip(INPUTS, types) if t is not None]
    outputs = [helper.make_tensor_value_info(n, t, None) for n, t in zip(("key", "value"), types[:2])]
    attrs = {"cache_mode": mode, "is_seq_lens_cumsum": cumsum} if attrs is None else attrs
    node = helper.make_node("GatherPaKvCache", names, ["key", "value"], domain="pakv", **attrs)
    graph = helper.make_graph([node], "g", inputs, outputs)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("pakv", opset)])
    proto.ir_version = 8  # readable by every ORT the library supports (>= 1.16)
    return proto


def session(proto, threads=0):
    """One session per (model, intra_op_num_threads; 0 is ORT's default), without ORT's CPU arena: each
    output is then a malloc of its own, so ASan sees a write one byte past it."""
    key = (proto.SerializeToString(), threads)
    if key not in sessions:
        options = ort.SessionOptions()
        options.register_custom_ops_library(LIB)
        options.intra_op_num_threads = threads
        options.enable_cpu_mem_arena = False
        sessions[key] = ort.InferenceSession(key[0], options, providers=["CPUExecutionProvider"])
    return sessions[key]


def reference(kc, vc, bt, sl, so, nz, cumsum):
    bs = kc.shape[2 if nz else 1]
    lengths = np.diff(sl) if cumsum else sl
    out = []
    for cache in (kc, vc):
        rows = []
        for q, n in enumerate(lengths):
            col0 = 0 if so is None else int(so[q]) // bs
            for t in range(int(n)):
                b, s = int(bt[q, col0 + t // bs]), t % bs
                rows.append(cache[b, :, s, :].reshape(-1) if nz else cache[b, s])
        shape = (cache.shape[1] * cache.shape[3],) if nz else cache.shape[2:]
        out.append(np.stack(rows) if rows else np.zeros((0, *shape), cache.dtype))
    return out


def random_call(i):
    kt, vt = rng.choice(list(CACHE)), rng.choice(list(CACHE))
    nz, cumsum = bool(rng.integers(2)), bool(rng.integers(2))
    nb, bs, q = int(rng.integers(0, 6)), int(rng.integers(1, 5)), int(rng.integers(0, 4))

    def cache(t):
        e = 32 // np.dtype(t).itemsize
        if nz:
            shape = (nb, int(rng.integers(1, 3)), bs, e)
        else:
            shape = (nb, bs, int(rng.integers(1, 3)), int(rng.integers(0, 4)))
        return rng.integers(0, 100, shape).astype(t)

    kc, vc = cache(kt), cache(vt)
    lengths = rng.integers(0, 3 * bs + 1, q)
    offsets = rng.integers(0, 2 * bs + 1, q)
    cols = int(max([0, *(o // bs + -(-n // bs) for o, n in zip(offsets, lengths))]))
    bt = rng.integers(0, max(nb, 1), (q, cols)).astype(rng.choice(list(INDEX)))
    if bt.size and rng.integers(4) == 0:
        bt.flat[rng.integers(bt.size)] = rng.choice([-1, nb, 2**31 - 1])
    sl = (np.concatenate([[0], np.cumsum(lengths)]) if cumsum else lengths).astype(rng.choice(list(INDEX)))
    if rng.integers(6) == 0 and sl.size:
        sl[-1] = rng.choice([-5, 2**31 - 1])
    so = offsets.astype(rng.choice(list(INDEX))) if rng.integers(3) else None
    types = [CACHE[kt], CACHE[vt], INDEX[bt.dtype.type], INDEX[sl.dtype.type]]
    types.append(None if so is None else INDEX[so.dtype.type])
    s = session(model(types, "PA_NZ" if nz else "Norm", int(cumsum)))
    feeds = {n: a for n, a in zip(INPUTS, (kc, vc, bt, sl, so)) if a is not None}
    try:
        key, value = s.run(None, feeds)
    except ORT_ERRORS:
        return "refused"
    want = reference(kc, vc, bt, sl, so, nz, cumsum)
    assert key.dtype == kc.dtype and np.array_equal(key, want[0]) and np.array_equal(value, want[1]), i
    return "ok"


def bind_run(proto, shapes):
    """Run on zero-element inputs bound by address (the shapes ORT accepts without data)."""
    buffer = np.zeros(64, np.int64)
    s = session(proto)
    binding = s.io_binding()
    for name, (onnx_type, shape) in shapes.items():
        binding.bind_input(name, "cpu", 0, NUMPY[onnx_type], shape, buffer.ctypes.data)
    for name in ("key", "value"):
        binding.bind_output(name, "cpu")
    s.run_with_iobinding(binding)
    return [tuple(v.shape()) for v in binding.get_outputs()]


def expect_error(fn, text):
    try:
        fn()
    except ORT_ERRORS as exc:
        assert text in str(exc), str(exc)
        return
    raise AssertionError(f"no error (expected {text!r})")


def extreme_shapes():
    f16, i64 = TensorProto.FLOAT16, TensorProto.INT64
    types = [f16, f16, i64, i64, None]
    big = 2**63 - 1

    def empty_gather(mode, key_shape, value_shape, tables_shape, lens_shape):
        shapes = {"key_cache": (f16, key_shape), "value_cache": (f16, value_shape),
                  "block_tables": (i64, tables_shape), "seq_lens": (i64, lens_shape)}  # fmt: skip
        return lambda: bind_run(model(types, mode), shapes)

    # Q + 1 with Q = INT64_MAX (block_tables [INT64_MAX, 0] holds no data).
    expect_error(empty_gather("Norm", [1, 1, 1, 1], [1, 1, 1, 1], [big, 0], [0]), "Q+1")
    # Bytes per token of zero-block caches, Norm and PA_NZ.
    expect_error(empty_gather("Norm", [0, 1, 2**32, 2**32], [0, 1, 1, 1], [1, 0], [2]), "overflow")
    expect_error(empty_gather("PA_NZ", [0, 2**62, 1, 16], [0, 1, 1, 16], [1, 0], [2]), "overflow")
    # T = INT64_MAX tokens of zero-byte rows, threads forced on (PAKV_ONNX_PARALLEL_MIN_BYTES=0):
    # the thread split must not form T * i. Two blocks of 2**62 slots cover T.
    lengths = np.array([big], np.int64)
    s = session(model([f16, f16, i64, i64, None], cumsum=0))
    binding = s.io_binding()
    table = np.zeros((1, 2), np.int64)
    cache = np.zeros(8, np.float16)
    binding.bind_input("key_cache", "cpu", 0, np.float16, [1, 2**62, 0, 4], cache.ctypes.data)
    binding.bind_input("value_cache", "cpu", 0, np.float16, [1, 2**62, 0, 3], cache.ctypes.data)
    binding.bind_ortvalue_input("block_tables", ort.OrtValue.ortvalue_from_numpy(table))
    binding.bind_ortvalue_input("seq_lens", ort.OrtValue.ortvalue_from_numpy(lengths))
    binding.bind_output("key", "cpu")
    binding.bind_output("value", "cpu")
    s.run_with_iobinding(binding)
    assert [tuple(v.shape()) for v in binding.get_outputs()] == [(big, 0, 4), (big, 0, 3)]


def race(seconds=1.0):
    nb, bs, q, per = 32, 8, 4, 8
    kc = rng.integers(0, 100, (nb, bs, 2, 32)).astype(np.float16)
    good = rng.permutation(nb)[: q * per].reshape(q, per).astype(np.int32)
    table = good.copy()
    huge = np.full_like(good, 2**30)
    sl = (np.arange(q + 1) * per * bs).astype(np.int64)
    s = session(model([TensorProto.FLOAT16, TensorProto.FLOAT16, TensorProto.INT32, TensorProto.INT64, None]))
    binding = s.io_binding()
    for name, array in (("key_cache", kc), ("value_cache", kc), ("block_tables", table), ("seq_lens", sl)):
        binding.bind_input(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
    binding.bind_output("key", "cpu")
    binding.bind_output("value", "cpu")
    stop = []

    def writer():
        while not stop:
            table[...] = huge
            table[...] = good

    thread = threading.Thread(target=writer)
    thread.start()
    counts = {"ok": 0, "refused": 0}
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        try:
            s.run_with_iobinding(binding)
            counts["ok"] += 1
        except ORT_ERRORS as exc:
            assert "block_tables" in str(exc), str(exc)
            counts["refused"] += 1
    stop.append(1)
    thread.join()
    return counts


def attributes_and_registration():
    f16, i32 = TensorProto.FLOAT16, TensorProto.INT32
    types = [f16, f16, i32, i32, None]
    for attrs, text in (({"cache_mode": 1}, "STRING attribute"), ({"cache_mode": b"Norm\0junk"}, "NUL byte"),
                        ({"is_seq_lens_cumsum": "1"}, "INT attribute"), ({"cache_mode": ["PA_NZ"]}, "STRINGS"),
                        ({"is_seq_lens_cumsum": 3}, "0/1")):  # fmt: skip
        expect_error(lambda: session(model(types, attrs=attrs)), text)
    options = ort.SessionOptions()
    options.register_custom_ops_library(LIB)
    expect_error(lambda: options.register_custom_ops_library(LIB), "already registered")


def core():
    spec = importlib.util.spec_from_file_location("native_lib", LOADER)
    loader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loader)
    lib = loader.declare(ctypes.CDLL(LIB))
    loader.check_abi(lib, LIB)
    pool = rng.integers(0, 255, (6, 2, 4, 16)).astype(np.uint8)  # [nb, k/v, bs, row bytes]
    table = np.array([[5, 0, 3]], np.int64)
    lengths, starts, cols = np.array([10], np.int64), np.array([0], np.int64), np.array([0], np.int64)
    out_k, out_v = np.zeros((10, 16), np.uint8), np.zeros((10, 16), np.uint8)

    def plan(**changes):
        fields = dict(layout=0, tables64=1, num_blocks=6, block_size=4, key_cache=pool.ctypes.data,
                      value_cache=pool.ctypes.data + 64, key_block_stride=128, value_block_stride=128,
                      key_row_bytes=16, value_row_bytes=16, key_out=out_k.ctypes.data, value_out=out_v.ctypes.data,
                      num_seqs=1, table_cols=3, block_tables=table.ctypes.data, table_row_stride=24,
                      table_col_stride=8, seq_lengths=lengths.ctypes.data, out_starts=starts.ctypes.data,
                      col_starts=cols.ctypes.data, num_tokens=10)  # fmt: skip
        fields.update(changes)
        return loader.Plan(**fields)

    error = ctypes.create_string_buffer(1024)
    assert lib.pakv_gather(ctypes.byref(plan()), error, 1024) == 0, error.value
    for t in range(10):
        b, s = table[0, t // 4], t % 4
        assert np.array_equal(out_k[t], pool[b, 0, s]) and np.array_equal(out_v[t], pool[b, 1, s])
    # Block stride 0 (an expanded pool: every block id reads the one block at the base).
    assert lib.pakv_gather(ctypes.byref(plan(key_block_stride=0)), error, 1024) == 0, error.value
    assert all(np.array_equal(out_k[t], pool[0, 0, t % 4]) for t in range(10))
    for bad in (dict(num_blocks=5), dict(key_block_stride=-8), dict(num_tokens=2**62), dict(block_size=0),
                dict(key_row_bytes=2**62, value_row_bytes=2**62), dict(table_cols=2),
                dict(table_row_stride=-8), dict(key_block_stride=2**62)):  # fmt: skip
        assert lib.pakv_gather(ctypes.byref(plan(**bad)), error, 1024) != 0, bad


def validator():
    """pakv_plan_gather (the validator, as the Python front calls it) then pakv_gather: valid calls
    exact, malformed ones refused before anything is written."""
    spec = importlib.util.spec_from_file_location("native_lib", LOADER)
    loader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loader)
    lib = loader.declare(ctypes.CDLL(LIB))
    kc = rng.integers(0, 255, (6, 4, 2, 8)).astype(np.uint8)  # [nb, bs, H, D] uint8 (ONNX 2)
    vc = rng.integers(0, 255, (6, 4, 1, 8)).astype(np.uint8)
    bt, sl, so = np.array([[5, 0, 3], [1, 2, 4]], np.int32), np.array([0, 10, 13], np.int32), np.array([0, 5], np.int32)

    def call(arrays, types, nz=0, cumsum=1):
        error = ctypes.create_string_buffer(1024)
        request = loader.GatherCall()
        for i, (array, elem) in enumerate(zip(arrays, types)):
            if array is None:
                continue
            t = request.records[i]
            t.data, t.host_data, t.present, t.elem_type = array.ctypes.data, array.ctypes.data, 1, elem
            t.ndim, t.device = array.ndim, b"cpu"
            for d, (n, stride) in enumerate(zip(array.shape, array.strides)):
                t.dims[d], t.strides[d] = n, stride // array.itemsize
        scratch = np.zeros(3 * len(bt), np.int64)
        request.nz, request.cumsum, request.scratch_len = nz, cumsum, scratch.size
        request.scratch, request.error = scratch.ctypes.data, ctypes.addressof(error)
        kind = lib.pakv_plan_gather(ctypes.addressof(request))
        if kind:
            return kind
        assert lib.pakv_gather(ctypes.addressof(request.plan), error, 1024) == 0, error.value
        return 0

    types = [2, 2, 6, 6, 6, 2, 2]
    ko, vo = np.zeros((13, 2, 8), np.uint8), np.zeros((13, 1, 8), np.uint8)
    assert call([kc, vc, bt, sl, so, ko, vo], types) == 0
    want_k, want_v = reference(kc, vc, bt, sl, so, False, 1)
    assert np.array_equal(ko, want_k) and np.array_equal(vo, want_v)
    # A strided block table (every other column of a wider one) is read in place.
    wide = np.zeros((2, 6), np.int32)
    wide[:, ::2] = bt
    ko[:] = 0
    assert call([kc, vc, wide[:, ::2], sl, so, ko, vo], types) == 0 and np.array_equal(ko, want_k)
    short_k, wide_v = np.zeros((12, 2, 8), np.uint8), np.zeros((13, 2, 8), np.uint8)
    for label, arrays in (
        ("used block id out of range", [kc, vc, np.array([[6, 0, 3], [1, 2, 4]], np.int32), sl, so, ko, vo]),
        ("negative seq_offset", [kc, vc, bt, sl, np.array([0, -4], np.int32), ko, vo]),
        ("decreasing seq_lens", [kc, vc, bt, np.array([0, 10, 9], np.int32), so, ko, vo]),
        ("table too short", [kc, vc, bt[:, :2].copy(), sl, so, ko, vo]),
        ("key output one row short", [kc, vc, bt, sl, so, short_k, vo]),
        ("value output of the wrong width", [kc, vc, bt, sl, so, ko, wide_v]),
        ("key output over key_cache", [kc, vc, bt, sl, so, kc.reshape(-1)[: ko.size].reshape(ko.shape), vo]),
    ):
        for out in (ko, vo, short_k, wide_v):
            out[:] = 0
        before = kc.copy()
        assert call(arrays, types) == 1, label
        assert not any(o.any() for o in (ko, vo, short_k, wide_v)), label  # nothing written
        assert np.array_equal(kc, before), label
    assert call([kc, vc, bt, sl, so, ko, vo], [2, 3, 6, 6, 6, 2, 2]) == 2  # value_cache's dtype differs from its output


def bound_outputs_over_inputs():
    """Outputs a host bound over each other or over a cache are refused (never an overlapping copy)."""
    f16, i32 = TensorProto.FLOAT16, TensorProto.INT32
    s = session(model([f16, f16, i32, i32, None]))
    kc = rng.integers(0, 100, (4, 4, 2, 8)).astype(np.float16)
    vc = kc.copy()
    bt, sl = np.array([[0, 1, 2, 3]], np.int32), np.array([0, 16], np.int32)
    shared = np.zeros((16, 2, 8), np.float16)
    for key_out, value_out, text in ((shared, shared, "key_out and value_out overlap"),
                                     (kc.reshape(16, 2, 8), np.zeros_like(shared), "key_out overlaps key_cache")):  # fmt: skip
        before = kc.copy()
        binding = s.io_binding()
        for name, array in (("key_cache", kc), ("value_cache", vc), ("block_tables", bt), ("seq_lens", sl)):
            binding.bind_input(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
        for name, array in (("key", key_out), ("value", value_out)):
            binding.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
        expect_error(lambda: s.run_with_iobinding(binding), text)
        assert np.array_equal(kc, before)


def device_entries(iterations, driver_path):
    """Random calls through the fake runtime's CPU/CUDA/CANN entries; every accepted one exact."""
    import os
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the fake runtime
    from fake_ort_api import DEVICE_GPU, DEVICE_NPU, EPS, FakeDriver, FakeOrtError, FakeRuntime, FakeTensor

    os.environ["PAKV_ONNX_CUDA_DRIVER"] = os.environ["PAKV_ONNX_CANN_DRIVER"] = driver_path
    runtime = FakeRuntime(api_version=17)
    runtime.register(ctypes.CDLL(LIB))
    driver = FakeDriver(Path(driver_path))
    driver.reset(runtime.stream)
    counts = {"ok": 0, "refused": 0, "failed": 0}
    itemsize = {t: np.dtype(n).itemsize for t, n in NUMPY.items()}
    for i in range(iterations):
        kt, vt = rng.choice(list(CACHE)), rng.choice(list(CACHE))
        nz, cumsum = bool(rng.integers(2)), bool(rng.integers(2))
        nb, bs, q = int(rng.integers(0, 6)), int(rng.integers(1, 5)), int(rng.integers(0, 4))

        def cache(t):
            e = 32 // np.dtype(t).itemsize
            shape = (
                (nb, int(rng.integers(1, 3)), bs, e)
                if nz
                else (nb, bs, int(rng.integers(1, 3)), int(rng.integers(0, 4)))
            )
            return rng.integers(0, 100, shape).astype(t)

        kc, vc = cache(kt), cache(vt)
        lengths = rng.integers(0, 3 * bs + 1, q)
        offsets = rng.integers(0, 2 * bs + 1, q)
        cols = int(max([0, *(o // bs + -(-n // bs) for o, n in zip(offsets, lengths))]))
        bt = rng.integers(0, max(nb, 1), (q, cols)).astype(rng.choice(list(INDEX)))
        if bt.size and rng.integers(4) == 0:
            bt.flat[rng.integers(bt.size)] = rng.choice([-1, nb, 2**31 - 1])
        sl = (np.concatenate([[0], np.cumsum(lengths)]) if cumsum else lengths).astype(rng.choice(list(INDEX)))
        so = offsets.astype(rng.choice(list(INDEX))) if rng.integers(3) else None
        ep = EPS[int(rng.integers(len(EPS)))]
        device = {"CUDAExecutionProvider": DEVICE_GPU, "CANNExecutionProvider": DEVICE_NPU}.get(ep, 0)
        arrays = [kc, vc, bt, sl, so]
        onnx = [
            CACHE[kt],
            CACHE[vt],
            INDEX[bt.dtype.type],
            INDEX[sl.dtype.type],
            None if so is None else INDEX[so.dtype.type],
        ]
        feeds = [None if a is None else FakeTensor(a.ctypes.data, t, a.shape, device if k < 2 else 0)
                 for k, (a, t) in enumerate(zip(arrays, onnx))]  # fmt: skip
        if so is None:
            feeds.pop()
        op = runtime.find_op(ep, CACHE[kt], CACHE[vt])
        kernel = runtime.create_kernel(op, {"cache_mode": "PA_NZ" if nz else "Norm", "is_seq_lens_cumsum": int(cumsum)})
        failing = device and rng.integers(10) == 0
        if failing:
            driver.fail_at(int(rng.integers(0, 3)), 700)
        try:
            outputs = runtime.compute(op, kernel, feeds, out_device=(device, 0))
        except FakeOrtError as exc:
            counts["failed" if "failed with" in str(exc) else "refused"] += 1
            continue
        finally:
            runtime.destroy_kernel(op, kernel)
            driver.reset(runtime.stream)
        want = reference(kc, vc, bt, sl, so, nz, cumsum)
        for (tensor, buffer), expected in zip(outputs, want):
            got = np.frombuffer(buffer, np.uint8)[: expected.nbytes].view(expected.dtype).reshape(expected.shape)
            assert itemsize[tensor.elem_type] == expected.itemsize and np.array_equal(got, expected), (i, ep)
        counts["ok"] += 1
    assert counts["ok"] > 20 and counts["refused"] > 20 and driver.count("wrong_stream") == 0, counts
    return counts


if "--device" in sys.argv:
    print("clean", device_entries(int(sys.argv[3]), sys.argv[sys.argv.index("--device") + 1]), flush=True)
    sys.exit(0)

counts = {"ok": 0, "refused": 0}
for i in range(int(sys.argv[3]) if len(sys.argv) > 3 else 400):
    counts[random_call(i)] += 1
assert counts["ok"] > 20 and counts["refused"] > 20, counts
extreme_shapes()
raced = race()
assert raced["refused"] > 0, raced
attributes_and_registration()
core()
validator()
bound_outputs_over_inputs()
print("clean", counts, raced, flush=True)
