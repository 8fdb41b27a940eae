"""Run an ASan+UBSan build of the C library inside ONNX Runtime (no torch, no pakv_onnx package).

usage: python sanitizer_session.py <sanitized libpakv_ort.so> <pakv_onnx/native_lib/__init__.py> [N]
       python sanitizer_session.py <sanitized libpakv_ort.so> <...__init__.py> N --device <fake driver .so>
       python sanitizer_session.py <sanitized libpakv_ort.so> <...__init__.py> N --attention
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

With --attention, pakv::PagedAttention inside ORT: N random valid calls (float32, float16, bfloat16;
GQA, block sizes, ragged and idle sequences, vector tails, several query tiles and chunks, 1 or 2
intra-op threads, bitwise equal) against a numpy fp64 reference of causal paged attention; N calls
with one contract rule broken, each refused with that rule's message; shapes at int64's edge; a
writer racing the block table the op reads in place; outputs bound over inputs.

Sessions run without ORT's CPU arena, so ORT's outputs are mallocs ASan can bound; numpy inputs
are read in place (no copy), so a read past a cache or the query is reported too.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
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


@contextlib.contextmanager
def flipping(table, good, huge):
    """While the block runs, a thread rewrites ``table`` in place, all ``huge`` then ``good`` again
    (a host racing the validator and the kernels over a bound block table)."""
    stop = []

    def writer():
        while not stop:
            table[...] = huge
            table[...] = good

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        yield
    finally:
        stop.append(1)
        thread.join()


def random_gather(corrupt_lengths):
    """One random gather call from ``rng``: (kt, vt, nz, cumsum, kc, vc, bt, sl, so), a block id out
    of range now and then, and with ``corrupt_lengths`` a bad last length now and then."""
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
    if corrupt_lengths and rng.integers(6) == 0 and sl.size:
        sl[-1] = rng.choice([-5, 2**31 - 1])
    so = offsets.astype(rng.choice(list(INDEX))) if rng.integers(3) else None
    return kt, vt, nz, cumsum, kc, vc, bt, sl, so


def random_call(i):
    kt, vt, nz, cumsum, kc, vc, bt, sl, so = random_gather(corrupt_lengths=True)
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
    counts = {"ok": 0, "refused": 0}
    deadline = time.perf_counter() + seconds
    with flipping(table, good, huge):
        while time.perf_counter() < deadline:
            try:
                s.run_with_iobinding(binding)
                counts["ok"] += 1
            except ORT_ERRORS as exc:
                assert "block_tables" in str(exc), str(exc)
                counts["refused"] += 1
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
        kt, vt, nz, cumsum, kc, vc, bt, sl, so = random_gather(corrupt_lengths=False)
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


# --------------------------------------------------------------------------- #
# PagedAttention (--attention)
# --------------------------------------------------------------------------- #
ATTENTION = ("query", "key_cache", "value_cache", "block_table", "cumulative_sequence_lengths", "past_sequence_lengths")
FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
# numpy dtype -> ONNX type of the index inputs, and of the wrong dtypes an invalid call gives them.
INDEX_OR_NOT = {**INDEX, np.float32: TensorProto.FLOAT, np.int16: TensorProto.INT16, np.uint8: TensorProto.UINT8}
# (atol, rtol) on |got - want| <= atol + rtol |want|, want in fp64. fp32: the kernel's summation
# order and e^x (~2e-7), and scores rounded to fp32: at |score| ~150 (scale -1.5, D 64, 4x queries)
# that is ~1e-5 in a weight (5e-5: 3x the worst of 1500 random calls). 16-bit outputs: one fp32
# result rounded once (2^-11, 2^-8 relative).
ATTENTION_TOLERANCE = {TensorProto.FLOAT: (5e-5, 1e-4), TensorProto.FLOAT16: (1e-3, 1e-2),
                       TensorProto.BFLOAT16: (1e-2, 2e-2)}  # fmt: skip


def encode(values, onnx_type):
    """fp64 values as the op's input: float32, float16, or bfloat16 as its bits (numpy has no bfloat16)."""
    if onnx_type == TensorProto.BFLOAT16:
        return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return values.astype(np.float32 if onnx_type == TensorProto.FLOAT else np.float16)


def decode(array, onnx_type):
    if onnx_type == TensorProto.BFLOAT16:
        return (array.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return array.astype(np.float64)


def attention_model(onnx_type, index_types, scale):
    """A one-node pakv::PagedAttention model: query and caches of `onnx_type`, the index inputs of
    `index_types`, no shapes (any rank reaches the validator)."""
    types = [onnx_type] * 3 + list(index_types)
    inputs = [helper.make_tensor_value_info(n, t, None) for n, t in zip(ATTENTION, types)]
    outputs = [helper.make_tensor_value_info("output", onnx_type, None)]
    node = helper.make_node("PagedAttention", list(ATTENTION), ["output"], domain="pakv", scale=float(scale))
    graph = helper.make_graph([node], "g", inputs, outputs)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("pakv", 1)])
    proto.ir_version = 8
    return proto


def attention_case(
    onnx_type=None, batch=None, group=None, head_dim=None, value_dim=None, new=None, past=None, scale=None
):
    """A random valid call (any argument given is kept): GQA ratios 1/2/4 over 1-3 kv heads, head dims
    3/8/17/64 (3 and 17 end in the vectors' scalar tails), block sizes 1/5/16, ragged new tokens (idle sequences: 0,
    their past any size, even int max), sometimes a prefill of several query tiles, contexts of several
    32-position chunks, block-table entries past what a sequence reads -1 or garbage, shared blocks."""
    onnx_type = FLOATS[rng.integers(3)] if onnx_type is None else onnx_type
    hk = int(rng.integers(1, 4))
    group = int(rng.choice([1, 2, 4])) if group is None else group
    d = int(rng.choice([3, 8, 17, 64])) if head_dim is None else head_dim
    dv = (d if rng.integers(2) else int(rng.choice([3, 17, 64]))) if value_dim is None else value_dim
    bs = int(rng.choice([1, 5, 16]))
    if new is None:
        batch = int(rng.integers(1, 5)) if batch is None else batch
        new = rng.integers(0, 6, batch) * (rng.integers(4, size=batch) > 0)
        if batch and rng.integers(3) == 0:
            new[rng.integers(batch)] = rng.integers(17, 48)
    new = np.asarray(new, np.int64)
    index = [rng.choice(list(INDEX)) for _ in range(3)]
    past = rng.integers(0, 70, len(new)) if past is None else np.asarray(past, np.int64)
    idle_past = np.where(rng.integers(4, size=len(new)) == 0, np.iinfo(index[2]).max, past)
    past = np.where(new == 0, idle_past, past)
    need = np.where(new > 0, -(-(past + new) // bs), 0)
    cols, nb = int(need.max(initial=0)) + int(rng.integers(0, 3)), int(need.sum()) + int(rng.integers(0, 3))
    ids = rng.permutation(nb) if rng.integers(2) else rng.integers(0, max(nb, 1), nb)  # or blocks shared
    table = np.where(rng.integers(3, size=(len(new), cols)) > 0, -1, nb + 7)
    for b, at in enumerate(np.cumsum(need) - need):
        table[b, : need[b]] = ids[at : at + need[b]]
    query = rng.standard_normal((int(new.sum()), hk * group, d)) * rng.choice([1.0, 4.0])
    arrays = {"query": query, "key_cache": rng.standard_normal((nb, bs, hk, d)),
              "value_cache": rng.standard_normal((nb, bs, hk, dv))}  # fmt: skip
    arrays = {n: encode(a, onnx_type) for n, a in arrays.items()}
    arrays["block_table"] = table.astype(index[0])
    arrays["cumulative_sequence_lengths"] = np.concatenate([[0], np.cumsum(new)]).astype(index[1])
    arrays["past_sequence_lengths"] = past.astype(index[2])
    scale = float(rng.choice([0.0, 0.0, 0.37, -1.5])) if scale is None else scale
    return {"dtype": onnx_type, "arrays": arrays, "scale": scale}


def attention_reference(case):
    """Causal paged attention in fp64, read position by position through the block table: new token j
    of sequence b (n new, context L = past + n) sees positions 0 .. L - n + j; query head h reads kv
    head h // (Hq / Hk)."""
    q, kc, vc = (decode(case["arrays"][n], case["dtype"]) for n in ATTENTION[:3])
    table, cu, past = (case["arrays"][n].astype(np.int64) for n in ATTENTION[3:])
    hq, d, hk, bs = q.shape[1], q.shape[2], kc.shape[2], kc.shape[1]
    scale = float(np.float32(case["scale"])) or (1 / np.sqrt(d) if d else 1.0)
    out = np.zeros((q.shape[0], hq, vc.shape[3]))
    for b in range(len(past)):
        start, n = cu[b], cu[b + 1] - cu[b]
        if n == 0:
            continue
        pos = np.arange(past[b] + n)
        blocks = table[b, pos // bs]
        keys, values = (np.repeat(c[blocks, pos % bs], hq // hk, axis=1) for c in (kc, vc))
        scores = np.einsum("nhd,lhd->hnl", q[start : start + n], keys) * scale
        scores = np.where(pos[None, :] <= (past[b] + np.arange(n))[:, None], scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        out[start : start + n] = np.einsum("hnl,lhd->nhd", weights / weights.sum(-1, keepdims=True), values)
    return out


def index_types(arrays):
    return [INDEX_OR_NOT[arrays[n].dtype.type] for n in ATTENTION[3:]]


def attend(case, threads):
    """The call in ORT: its output (ORT allocates it), or the ORT error raised. bfloat16 travels as its bits in
    OrtValues, its output bound to a numpy buffer (a caller's output, validated like an input)."""
    arrays, onnx_type = case["arrays"], case["dtype"]
    s = session(attention_model(onnx_type, index_types(arrays), case["scale"]), threads)
    if onnx_type != TensorProto.BFLOAT16:
        return s.run(None, dict(arrays))[0]
    binding = s.io_binding()
    for i, name in enumerate(ATTENTION):
        element = onnx_type if i < 3 else INDEX_OR_NOT[arrays[name].dtype.type]
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy_with_onnx_type(arrays[name], element))
    out = np.zeros((*arrays["query"].shape[:2], arrays["value_cache"].shape[3]), np.uint16)
    binding.bind_ortvalue_output("output", ort.OrtValue.ortvalue_from_numpy_with_onnx_type(out, onnx_type))
    s.run_with_iobinding(binding)
    return out


def assert_attention_close(got, case, label):
    want, (atol, rtol) = attention_reference(case), ATTENTION_TOLERANCE[case["dtype"]]
    assert got.shape == want.shape, (label, got.shape, want.shape)
    got = decode(got, case["dtype"])
    worst = np.max(np.abs(got - want) - (atol + rtol * np.abs(want)), initial=-1.0)
    assert np.isfinite(got).all() and worst <= 0, (label, worst)


def attention_work(case):
    """The core's own size estimate (multiply-adds): at PAKV_ONNX_ATTENTION_PARALLEL_MIN or more it splits
    the parts across ORT's pool."""
    a = case["arrays"]
    new, past = np.diff(a["cumulative_sequence_lengths"].astype(np.int64)), a["past_sequence_lengths"]
    hq, d, dv = a["query"].shape[1], a["query"].shape[2], a["value_cache"].shape[3]
    return int(sum(int(n) * (int(p) + int(n)) for n, p in zip(new, past) if n)) * hq * (d + dv + 1)


def attention_valid_calls(count):
    """Random valid calls (first the edges: no sequence, all idle, no query head, head_dim 0, no value,
    and the default scale of head_dim 3 and 2, which was 2/3 and 1) against the reference, on 1 or 2 intra-op
    threads; every 4th also on the other count, bitwise equal (each part is computed alone). Inputs are
    left as they were (the op only reads)."""
    edges = [{"batch": 0}, {"new": [0, 0, 0]}, {"group": 0}, {"head_dim": 0}, {"value_dim": 0},
             {"head_dim": 3, "scale": 0.0}, {"head_dim": 2, "scale": 0.0}]  # fmt: skip
    split, threshold = 0, int(os.environ.get("PAKV_ONNX_ATTENTION_PARALLEL_MIN", "262144"))
    for i in range(count):
        case = attention_case(**(edges[i] if i < len(edges) else {}))
        before = {n: a.copy() for n, a in case["arrays"].items()}
        threads = int(rng.integers(1, 3))
        got = attend(case, threads)
        assert_attention_close(got, case, i)
        if i % 4 == 0:
            assert np.array_equal(attend(case, 3 - threads).view(np.uint8), got.view(np.uint8)), i
        assert all(np.array_equal(before[n], a) for n, a in case["arrays"].items()), i
        split += attention_work(case) >= threshold
    assert 0 < split < count, (split, count)  # both the calling thread's loop and ORT's pool ran
    return {"ok": count, "split": split}


def reading(a):
    """The sequences that read the caches (new tokens), and the columns each reads."""
    new = np.diff(a["cumulative_sequence_lengths"].astype(np.int64))
    lengths = a["past_sequence_lengths"].astype(np.int64) + new
    return np.flatnonzero(new), -(-lengths // a["key_cache"].shape[1])


def bad_block_id(a, b, cols):
    table = a["block_table"]
    table[b, rng.integers(cols[b])] = rng.choice([-1, len(a["key_cache"]), np.iinfo(table.dtype).max])
    return "block_table["


def context_past_the_table(a, b, cols):
    new, bs = np.diff(a["cumulative_sequence_lengths"])[b], a["key_cache"].shape[1]
    a["past_sequence_lengths"][b] = a["block_table"].shape[1] * bs - new + 1 + rng.integers(bs)
    return "is too short"


def int_max_past(a, b, cols):
    past = a["past_sequence_lengths"]
    past[b] = np.iinfo(past.dtype).max
    return "overflows int64" if past.dtype == np.int64 else "is too short"


def negative_past(a, b, cols):
    a["past_sequence_lengths"][b] = -1 - rng.integers(2**20)
    return "must be non-negative"


def cu_not_from_zero(a, b, cols):
    a["cumulative_sequence_lengths"] += 1
    return "must start at 0"


def cu_decreasing(a, b, cols):
    cu = a["cumulative_sequence_lengths"]
    cu[b + 1] = cu[b] - 1
    return "must be non-decreasing"


def cu_wrong_end(a, b, cols):
    """The last entry past N: the last sequence gains tokens, and its past + new (an idle one's past may
    be int max) is checked before the end."""
    cu = a["cumulative_sequence_lengths"]
    cu[-1] = rng.choice([cu[-1] + 1, np.iinfo(cu.dtype).max])
    overflow = int(a["past_sequence_lengths"][-1]) + int(cu[-1]) - int(cu[-2]) > np.iinfo(np.int64).max
    return "new tokens overflows int64" if overflow else "must end at query's"


def cu_entries(a, b, cols):
    cu = a["cumulative_sequence_lengths"]
    a["cumulative_sequence_lengths"] = cu[:-1] if rng.integers(2) else np.append(cu, cu[-1])
    return "must have B+1 entries"


def past_entries(a, b, cols):
    past = a["past_sequence_lengths"]
    a["past_sequence_lengths"] = past[:-1] if rng.integers(2) else np.append(past, past[:1])
    return "past_sequence_lengths must have B ="


def heads_not_a_multiple(a, b, cols):
    query, hk = a["query"], a["key_cache"].shape[2]
    if hk == 1:  # every head count is a multiple of 1: the value cache's heads differ instead
        a["value_cache"] = np.concatenate([a["value_cache"]] * 2, axis=2)
        return "value_cache must have key_cache's"
    a["query"] = np.concatenate([query, query[:, :1]], axis=1)
    return "must be a multiple of key_cache's"


def head_dim_mismatch(a, b, cols):
    a["query"] = np.concatenate([a["query"], a["query"][..., :1]], axis=2)
    return "must be key_cache's head_dim"


def wrong_rank(a, b, cols):
    name = str(rng.choice(ATTENTION))
    x = a[name]
    a[name] = x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1]) if x.ndim > 1 else x[:, None]
    return "must have rank"


def index_dtype(a, b, cols):
    name = str(rng.choice(ATTENTION[3:]))
    a[name] = a[name].astype(rng.choice([np.float32, np.int16, np.uint8]))
    return "must be int32 or int64"


def zero_block_size(a, b, cols):
    a["key_cache"], a["value_cache"] = a["key_cache"][:, :0], a["value_cache"][:, :0]
    return "block_size must be >= 1"


def caches_disagree(a, b, cols):
    a["value_cache"] = np.concatenate([a["value_cache"], a["value_cache"][:1]])
    return "num_blocks/block_size"


BREAKS = (bad_block_id, bad_block_id, bad_block_id, context_past_the_table, int_max_past, negative_past,
          cu_not_from_zero, cu_decreasing, cu_wrong_end, cu_entries, past_entries, heads_not_a_multiple,
          head_dim_mismatch, wrong_rank, index_dtype, zero_block_size, caches_disagree)  # fmt: skip


def attention_invalid_calls(count):
    """Valid calls with one rule broken (BREAKS; a sequence with new tokens breaks it where the rule is
    per sequence), or a non-finite scale: each an ORT error naming the rule, nothing crashes. float32 and
    float16 only: bfloat16's pre-bound output would have to guess the shape of a malformed call."""
    refused = 0
    while refused < count:
        case = attention_case(onnx_type=FLOATS[rng.integers(2)], batch=int(rng.integers(1, 5)))
        a = case["arrays"]
        readers, cols = reading(a)
        if not len(readers):
            continue
        refused += 1
        if rng.integers(len(BREAKS) + 1) == 0:
            case["scale"], text = float(rng.choice([np.inf, -np.inf, np.nan])), "scale must be a finite float"
        else:
            text = BREAKS[rng.integers(len(BREAKS))](a, int(rng.choice(readers)), cols)
        expect_error(lambda: attend(case, int(rng.integers(1, 3))), text)  # noqa: B023 - called at once
    return {"refused": refused}


def attention_bound(inputs, scale=0.0):
    """Run a float16 call on inputs bound by address: an array by its data, a shape (a list) as a
    zero-element tensor (ORT reads no data for it, so any dims); the output's shape."""
    buffer = np.zeros(8, np.int64)
    s = session(attention_model(TensorProto.FLOAT16, [TensorProto.INT64] * 3, scale))
    binding = s.io_binding()
    for name in ATTENTION:
        x = inputs[name]
        shape, data = (x, buffer) if isinstance(x, list) else (list(x.shape), x)
        binding.bind_input(name, "cpu", 0, np.float16 if name in ATTENTION[:3] else np.int64, shape, data.ctypes.data)
    binding.bind_output("output", "cpu")
    s.run_with_iobinding(binding)
    return tuple(binding.get_outputs()[0].shape())


def attention_extreme_shapes():
    """Shapes at int64's edge that ORT accepts without data: 2**62 tokens of no head (one block of 2**62
    slots holds their context) give an empty output of that shape; past + new past INT64_MAX, B + 1
    past INT64_MAX and a head_dim whose bytes overflow are refused."""
    big, i64 = 2**62, np.int64
    tokens = {"query": [big, 0, 0], "key_cache": [1, big, 1, 0], "value_cache": [1, big, 1, 0],
              "block_table": np.zeros((1, 1), i64), "cumulative_sequence_lengths": np.array([0, big], i64),
              "past_sequence_lengths": np.zeros(1, i64)}  # fmt: skip
    assert attention_bound(tokens) == (big, 0, 0)
    overflowing = {**tokens, "past_sequence_lengths": np.array([big], i64)}
    expect_error(lambda: attention_bound(overflowing), "new tokens overflows int64")
    empty = {"query": [0, 1, 4], "key_cache": [0, 1, 1, 4], "value_cache": [0, 1, 1, 4], "block_table": [0, 0],
             "cumulative_sequence_lengths": np.zeros(1, i64), "past_sequence_lengths": [0]}  # fmt: skip
    assert attention_bound(empty) == (0, 1, 4)
    expect_error(lambda: attention_bound({**empty, "block_table": [2**63 - 1, 0]}), "must have B+1 entries")
    wide = {**empty, "query": [0, 1, big], "key_cache": [0, 1, 1, big]}
    expect_error(lambda: attention_bound(wide), "bytes per token")


def attention_attributes():
    """scale of another attribute type is refused when ORT creates the kernel."""
    for scale, kind in ((1, "INT"), ("0.5", "STRING")):
        node = helper.make_node("PagedAttention", list(ATTENTION), ["output"], domain="pakv", scale=scale)
        proto = attention_model(TensorProto.FLOAT, [TensorProto.INT32] * 3, 0.0)
        proto.graph.node[0].CopyFrom(node)
        expect_error(lambda: session(proto), f"must be a FLOAT attribute, got attribute type {kind}")  # noqa: B023


def bind_attention(s, arrays):
    binding = s.io_binding()
    for name in ATTENTION:
        x = arrays[name]
        binding.bind_input(name, "cpu", 0, x.dtype, list(x.shape), x.ctypes.data)
    return binding


def attention_outputs_over_inputs():
    """An output a host binds over query or value_cache is refused before anything is written."""
    case = attention_case(onnx_type=TensorProto.FLOAT, new=[5, 3], head_dim=8, value_dim=8)
    a = case["arrays"]
    before = {n: x.copy() for n, x in a.items()}
    s = session(attention_model(TensorProto.FLOAT, index_types(a), case["scale"]))
    shape = [*a["query"].shape[:2], 8]
    for over in ("query", "value_cache"):
        binding = bind_attention(s, a)
        binding.bind_output("output", "cpu", 0, np.float32, shape, a[over].ctypes.data)
        expect_error(lambda: s.run_with_iobinding(binding), f"output overlaps {over}")  # noqa: B023
    assert all(np.array_equal(before[n], x) for n, x in a.items())


def attention_race(seconds=1.0):
    """A writer flips block_table between its ids and ids out of range while PagedAttention reads it in
    place (bound by address), on two threads: each run is refused naming block_table (by the validator,
    the plan check or the core mid-run), or is bitwise the undisturbed run's output."""
    case = attention_case(TensorProto.FLOAT, new=[8, 8, 8, 8], past=[200, 150, 250, 100], head_dim=64, value_dim=64)
    a = case["arrays"]
    table = a["block_table"]
    good, huge = table.copy(), np.full_like(table, 2**30)
    s = session(attention_model(TensorProto.FLOAT, index_types(a), case["scale"]), 2)
    want = s.run(None, dict(a))[0]
    binding = bind_attention(s, a)
    binding.bind_output("output", "cpu")
    counts = {"ok": 0, "validator": 0, "plan": 0, "core": 0}  # who refused (the core: mid-run)
    deadline = time.perf_counter() + seconds
    with flipping(table, good, huge):
        while time.perf_counter() < deadline:
            try:
                s.run_with_iobinding(binding)
            except ORT_ERRORS as exc:
                text = str(exc)
                assert "block_table" in text, text
                who = "plan" if "after validation" in text else "validator"
                counts["core" if "while the attention ran" in text else who] += 1
                continue
            assert np.array_equal(binding.copy_outputs_to_cpu()[0], want)
            counts["ok"] += 1
    assert counts["ok"] < sum(counts.values()), counts
    return counts


def paged_attention(count):
    counts = {**attention_valid_calls(count), **attention_invalid_calls(count)}
    attention_extreme_shapes()
    attention_attributes()
    attention_outputs_over_inputs()
    return counts, attention_race()


if "--attention" in sys.argv:
    print("clean", paged_attention(int(sys.argv[3])), flush=True)
    sys.exit(0)

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
