"""The write op's in-place routes and the attention's non-finite rules in ONNX Runtime with a given build of
the library (no torch, no pakv_onnx package): run by tests/test_native_sanitizers.py on the ASan + UBSan
build, so any invalid access aborts.

usage: python write_session.py <libpakv_ort.so> <tests dir>

Covers (issue 27): random valid writes (both layouts, padding slots, int32/int64 slots) on every route (an
unbound output: the copy; outputs bound to the pools; outputs feeding a gather with and without the alias
opt-in) against a numpy reference; a second reader of a pool, one pool feeding two writes and an initializer
pool (each sees what ONNX says; opted in, an initializer pool is refused at session creation); read-only
pools and read-only bound outputs (refused by name, nothing written, no signal); a write of padding only
into a 0-block pool and of no token; attention's non-finite rules (tests/attention_rules.py) in float32 and
float16, and head_dim 0.
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

LIB, TESTS = sys.argv[1], sys.argv[3]  # argv[2]: the native_lib loader every session is handed (unused)
sys.path.insert(0, TESTS)
from attention_rules import CASES, attention_by_the_rules, check, make_case  # noqa: E402

ERRORS = (RuntimeError, ort.capi.onnxruntime_pybind11_state.Fail, ort.capi.onnxruntime_pybind11_state.InvalidArgument,
          ort.capi.onnxruntime_pybind11_state.RuntimeException)  # fmt: skip
WRITE = ("key", "value", "key_cache", "value_cache", "slot_mapping")
F32, I64 = TensorProto.FLOAT, TensorProto.INT64
rng = np.random.default_rng(27)
folder = tempfile.mkdtemp()


def value(name, onnx_type=F32):
    return helper.make_tensor_value_info(name, onnx_type, None)


def graph_model(nodes, inputs, outputs, initializers=(), output_type=F32):
    graph = helper.make_graph(nodes, "g", [value(n, t) for n, t in inputs], [value(n, output_type) for n in outputs],
                              list(initializers))  # fmt: skip
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("pakv", 1)])
    proto.ir_version = 8
    return proto


def write_node(pools=("key_cache", "value_cache"), outs=("key_cache_out", "value_cache_out"), slots="slot_mapping", mode="Norm", name="write"):
    return helper.make_node("ScatterPaKvCache", ["key", "value", *pools, slots], list(outs), domain="pakv", cache_mode=mode, name=name)


def gather_node(pools, outs, name, mode="Norm"):
    return helper.make_node("GatherPaKvCache", [*pools, "tables", "lens"], list(outs), domain="pakv", name=name, cache_mode=mode)


def session(proto, alias=None):
    options = ort.SessionOptions()
    options.enable_cpu_mem_arena = False  # each output a malloc of its own: ASan bounds it
    if alias is not None:
        options.add_session_config_entry("pakv_onnx.alias_caches", alias)
    options.register_custom_ops_library(LIB)
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def expect_error(fn, text):
    try:
        fn()
    except ERRORS as exc:
        assert text in str(exc), str(exc)
        return
    raise AssertionError(f"no error (expected {text!r})")


def reference(key, kc, slots, nz):
    out, bs = kc.copy(), kc.shape[2 if nz else 1]
    for t, s in enumerate(slots):
        if s >= 0:
            if nz:
                out[s // bs, :, s % bs, :] = key[t].reshape(out.shape[1], out.shape[3])
            else:
                out[s // bs, s % bs] = key[t]
    return out


def random_write(nz):
    nb, bs = int(rng.integers(1, 6)), int(rng.choice([1, 4, 16]))
    cache = (nb, 2, bs, 8) if nz else (nb, bs, 2, 8)
    token = (1, 16) if nz else (2, 8)
    t = int(rng.integers(0, nb * bs + 1))
    slots = rng.permutation(nb * bs)[:t]
    slots = np.where(rng.integers(4, size=t) == 0, -1, slots).astype(rng.choice([np.int32, np.int64]))
    key, value_rows = (rng.standard_normal((t, *token)).astype(np.float32) for _ in range(2))
    kc, vc = (rng.standard_normal(cache).astype(np.float32) for _ in range(2))
    return key, value_rows, kc, vc, slots


def valid_writes(count):
    routes = {"copy": 0, "bound": 0, "fed": 0, "fed alias": 0}
    for i in range(count):
        nz = bool(i % 2)
        mode = "PA_NZ" if nz else "Norm"
        key, val, kc, vc, slots = random_write(nz)
        want = reference(key, kc, slots, nz), reference(val, vc, slots, nz)
        stype = TensorProto.INT32 if slots.dtype == np.int32 else I64
        inputs = [("key", F32), ("value", F32), ("key_cache", F32), ("value_cache", F32), ("slot_mapping", stype)]
        route = list(routes)[i % 4]
        feeds = dict(zip(WRITE, (key, val, kc.copy(), vc.copy(), slots)))
        if route in ("copy", "bound"):
            s = session(graph_model([write_node(mode=mode)], inputs, ["key_cache_out", "value_cache_out"]))
            if route == "copy":
                got = s.run(None, feeds)
                assert np.array_equal(feeds["key_cache"], kc), i  # the input is left as it was
            else:
                binding = s.io_binding()
                for name, array in feeds.items():
                    binding.bind_input(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
                for name, array in zip(("key_cache_out", "value_cache_out"), (feeds["key_cache"], feeds["value_cache"])):
                    binding.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
                s.run_with_iobinding(binding)
                got = feeds["key_cache"], feeds["value_cache"]
        else:  # the updated caches feed a gather of every token (the demo's shape)
            nodes = [write_node(outs=("k2", "v2"), mode=mode), gather_node(("k2", "v2"), ("ko", "vo"), "all", mode)]
            s = session(graph_model(nodes, [*inputs, ("tables", I64), ("lens", I64)], ["ko", "vo"]),
                        alias="1" if route == "fed alias" else None)  # fmt: skip
            nb, bs = kc.shape[0], kc.shape[2 if nz else 1]
            index = {"tables": np.arange(nb, dtype=np.int64)[None], "lens": np.array([0, nb * bs], np.int64)}
            gathered = s.run(None, {**feeds, **index})
            got = [g.reshape(w.transpose(0, 2, 1, 3).shape).transpose(0, 2, 1, 3) if nz else g.reshape(w.shape)
                   for g, w in zip(gathered, want)]  # fmt: skip
            aliased = route == "fed alias" and int(ort.__version__.split(".")[1]) >= 18
            assert np.array_equal(feeds["key_cache"], want[0] if aliased else kc), (i, route)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), (i, route)
        routes[route] += 1
    return routes


def readers_and_initializers():
    kc, vc = (rng.standard_normal((4, 4, 2, 8)).astype(np.float32) for _ in range(2))
    new = rng.standard_normal((1, 2, 8)).astype(np.float32)
    index = {"tables": np.arange(4, dtype=np.int64)[None], "lens": np.array([0, 16], np.int64)}
    base = [("key", F32), ("value", F32), ("key_cache", F32), ("value_cache", F32)]
    # A second reader of the pool input: the old rows, whatever the order.
    nodes = [write_node(outs=("k2", "v2")), gather_node(("k2", "v2"), ("nk", "nv"), "new"),
             gather_node(("key_cache", "value_cache"), ("ok", "ov"), "old")]  # fmt: skip
    s = session(graph_model(nodes, [*base, ("slot_mapping", I64), ("tables", I64), ("lens", I64)], ["nk", "ok"]))
    got_new, got_old = s.run(None, {"key": new, "value": new, "key_cache": kc, "value_cache": vc, "slot_mapping": np.array([5]), **index})
    assert np.array_equal(got_old, kc.reshape(16, 2, 8)) and np.array_equal(got_new, reference(new, kc, [5], False).reshape(16, 2, 8))
    # An initializer pool: the model's constant, run after run; opted in, refused at creation.
    inits = [numpy_helper.from_array(kc, "key_cache"), numpy_helper.from_array(vc, "value_cache")]
    proto = graph_model([write_node(outs=("k2", "v2")), gather_node(("k2", "v2"), ("nk", "nv"), "g")],
                        [("key", F32), ("value", F32), ("slot_mapping", I64), ("tables", I64), ("lens", I64)], ["nk"], inits)  # fmt: skip
    s = session(proto)
    s.run(None, {"key": new, "value": new, "slot_mapping": np.array([3]), **index})
    (got,) = s.run(None, {"key": new * 2, "value": new, "slot_mapping": np.array([9]), **index})
    assert np.array_equal(got, reference(new * 2, kc, [9], False).reshape(16, 2, 8))
    if int(ort.__version__.split(".")[1]) >= 18:  # older runtimes read no alias map: nothing to refuse
        expect_error(lambda: session(proto, alias="1"), "ScatterPaKvCache node 'write': key_cache 'key_cache' is an initializer")


def read_only(array, name):
    path = os.path.join(folder, name)
    array.tofile(path)
    return np.memmap(path, dtype=array.dtype, mode="r", shape=array.shape)


def read_only_pools():
    kc, vc = (rng.standard_normal((4, 4, 2, 8)).astype(np.float32) for _ in range(2))
    new = rng.standard_normal((2, 2, 8)).astype(np.float32)
    maps = read_only(kc, "k"), read_only(vc, "v")
    base = [("key", F32), ("value", F32), ("key_cache", F32), ("value_cache", F32), ("slot_mapping", I64)]
    nodes = [write_node(outs=("k2", "v2")), gather_node(("k2", "v2"), ("ko", "vo"), "all")]
    fed = session(graph_model(nodes, [*base, ("tables", I64), ("lens", I64)], ["ko", "vo"]), alias="1")
    feeds = {"key": new, "value": new, "key_cache": maps[0], "value_cache": maps[1], "slot_mapping": np.array([1, 14])}
    index = {"tables": np.arange(4, dtype=np.int64)[None], "lens": np.array([0, 16], np.int64)}
    if int(ort.__version__.split(".")[1]) >= 18:
        expect_error(lambda: fed.run(None, {**feeds, **index}), "key_cache: the rows this write goes to are not writable memory")
    one = session(graph_model([write_node()], base, ["key_cache_out", "value_cache_out"]))
    for outputs, text in ((maps, "key_cache: the rows"), ((read_only(kc, "ko"), read_only(vc, "vo")), "key_cache_out: the buffer")):
        binding = one.io_binding()
        for name, array in feeds.items():
            binding.bind_input(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
        for name, array in zip(("key_cache_out", "value_cache_out"), outputs):
            binding.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
        expect_error(lambda: one.run_with_iobinding(binding), text)
    assert np.array_equal(maps[0], kc) and np.array_equal(maps[1], vc)


def degenerate_writes():
    base = [("key", F32), ("value", F32), ("key_cache", F32), ("value_cache", F32), ("slot_mapping", I64)]
    s = session(graph_model([write_node()], base, ["key_cache_out", "value_cache_out"]))
    rows = np.zeros((3, 2, 8), np.float32)
    empty = np.zeros((0, 4, 2, 8), np.float32)
    got = s.run(None, dict(zip(WRITE, (rows, rows, empty, empty, np.array([-1, -1, -1])))))
    assert got[0].shape == empty.shape
    kc = rng.standard_normal((2, 4, 2, 8)).astype(np.float32)
    got = s.run(None, dict(zip(WRITE, (rows[:0], rows[:0], kc, kc.copy(), np.zeros(0, np.int64)))))
    assert np.array_equal(got[0], kc)


ATTENTION = ("query", "key_cache", "value_cache", "block_table", "cumulative_sequence_lengths", "past_sequence_lengths")


def attention_rules():
    for onnx_type, dtype, tolerance in ((F32, np.float32, (1e-5, 1e-5)), (TensorProto.FLOAT16, np.float16, (1e-3, 2**-10))):
        node = helper.make_node("PagedAttention", list(ATTENTION), ["output"], domain="pakv")
        inputs = [(n, onnx_type if i < 3 else I64) for i, n in enumerate(ATTENTION)]
        s = session(graph_model([node], inputs, ["output"], output_type=onnx_type))
        for name in CASES:
            arrays = make_case(name)
            feeds = {n: a.astype(dtype) if a.dtype == np.float64 else a for n, a in arrays.items()}
            want = attention_by_the_rules({n: a.astype(np.float64) for n, a in feeds.items()})
            check(s.run(None, feeds)[0].astype(np.float64), want, *tolerance, f"{name} {dtype.__name__}")
    # head_dim 0: every score 0, the mean of the visible values.
    q, kc, vc = np.zeros((1, 2, 0), np.float32), np.zeros((2, 4, 1, 0), np.float32), rng.standard_normal((2, 4, 1, 3)).astype(np.float32)
    feeds = dict(zip(ATTENTION, (q, kc, vc, np.array([[1, 0]]), np.array([0, 1]), np.array([5]))))
    got = s_f32().run(None, feeds)[0]
    assert np.allclose(got[0, 0], np.concatenate([vc[1], vc[0]])[:6, 0].mean(0), atol=1e-6)


def s_f32():
    node = helper.make_node("PagedAttention", list(ATTENTION), ["output"], domain="pakv")
    return session(graph_model([node], [(n, F32 if i < 3 else I64) for i, n in enumerate(ATTENTION)], ["output"]))


routes = valid_writes(int(os.environ.get("PAKV_WRITE_CALLS", "120")))
readers_and_initializers()
read_only_pools()
degenerate_writes()
attention_rules()
print("clean", routes, flush=True)
