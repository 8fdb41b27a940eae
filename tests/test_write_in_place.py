"""The write op's in-place routes (issue 27): no reader sees a write it did not ask for, and a read-only
pool is an error, never a signal, whatever the graph and host.

ORT >= 1.18 (ORT_SEQUENTIAL) applies an op's alias map whatever else reads the buffer; the library now
declares it only for registrations that opt in, and ``make_session`` opts in only for graphs
``alias_hazards`` clears. Each graph below used to show a write to a reader that did not ask for it: (a) a
second node reading the pool input, (b) one pool feeding two writes, (c) an initializer pool (the constant
changed, the next run read the last run's rows); (d) a read-only pool died of SIGSEGV in ``write_row``.
What serving needs stays in place: a write whose outputs feed only later nodes (the demo's graphs,
``make_session``), outputs bound to the pools (ORT GenAI, the decoder steps: any host), and a raw host that
opts in with the session config entry.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import ORT_ERRORS
from onnx import TensorProto
from onnx import helper as h

import pakv_onnx
from pakv_onnx import native_lib, runtime_plugin
from pakv_onnx.export import gather_node, make_scatter_model_for, scatter_node
from pakv_onnx.runtime_plugin import alias_hazards
from pakv_onnx.spec import SCATTER, bitwise_equal

ORT_MINOR = int(ort.__version__.split(".")[1])
NB, BS, H, D = 4, 4, 2, 8
TOKENS = NB * BS
POOL_NAMES = ("key_cache", "value_cache")


def _value(name: str, dtype=TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return h.make_tensor_value_info(name, dtype, None)


def _model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = h.make_graph(nodes, "g", [_value(n, t) for n, t in inputs], [_value(n) for n in outputs], list(initializers))
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("pakv", 1)])
    model.ir_version = 8
    return model


def _gather(prefix: str, pools=("kc", "vc")) -> onnx.NodeProto:
    return gather_node(*pools, "tables", "lens", outputs=(f"{prefix}_k", f"{prefix}_v"), name=f"gather_{prefix}")


INDEX = [("tables", TensorProto.INT64), ("lens", TensorProto.INT64)]
WRITE = [("key", TensorProto.FLOAT), ("value", TensorProto.FLOAT), ("kc", TensorProto.FLOAT), ("vc", TensorProto.FLOAT)]


def pools(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((NB, BS, H, D)).astype(np.float32) for _ in range(2))


def rows(seed: int, count: int = 1) -> np.ndarray:
    return np.random.default_rng(100 + seed).standard_normal((count, H, D)).astype(np.float32)


def index_feeds() -> dict[str, np.ndarray]:
    return {"tables": np.arange(NB, dtype=np.int64)[None], "lens": np.array([0, TOKENS], np.int64)}


def written(pool: np.ndarray, slots: list[int], new: np.ndarray) -> np.ndarray:
    out = pool.copy()
    for t, s in enumerate(slots):
        out[s // BS, s % BS] = new[t]
    return out


def plugin(model, **kwargs):
    return runtime_plugin.make_session(model, **kwargs)


def raw(model, alias: str | None = None):
    """A host that loads the library itself (any C host does the same), opting in or not."""
    options = ort.SessionOptions()
    if alias is not None:
        options.add_session_config_entry(native_lib.CONFIG_KEY_ALIAS, alias)
    options.register_custom_ops_library(native_lib.library_path())
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


HOSTS = {"make_session": plugin, "raw host": raw}


# --------------------------------------------------------------------------- #
# (a) a second reader of the pool input
# --------------------------------------------------------------------------- #
def second_reader_model() -> onnx.ModelProto:
    """Write slot 5, gather through the written pools (new) and, listed after the write, from the pool
    inputs themselves (old: the graph's inputs are immutable)."""
    nodes = [
        scatter_node("key", "value", "kc", "vc", "slots", outputs=("kc2", "vc2"), name="write"),
        _gather("new", ("kc2", "vc2")),
        _gather("old"),
    ]
    return _model(nodes, [*WRITE, ("slots", TensorProto.INT64), *INDEX], ["new_k", "old_k"])


@pytest.mark.parametrize("host", list(HOSTS))
def test_a_second_reader_of_the_pool_sees_the_old_rows(host: str) -> None:
    kc, vc = pools()
    new = rows(0)
    feeds = {"key": new, "value": new, "kc": kc.copy(), "vc": vc.copy(), "slots": np.array([5]), **index_feeds()}
    got_new, got_old = HOSTS[host](second_reader_model()).run(None, feeds)
    assert np.array_equal(got_old, kc.reshape(TOKENS, H, D)), "the pool input's reader saw the write"
    assert np.array_equal(got_new, written(kc, [5], new).reshape(TOKENS, H, D))
    assert np.array_equal(feeds["kc"], kc), "the graph input was written"


# --------------------------------------------------------------------------- #
# (b) one pool feeding two writes
# --------------------------------------------------------------------------- #
def two_writes_model() -> onnx.ModelProto:
    nodes = [
        scatter_node("key", "value", "kc", "vc", "slots_a", outputs=("ka", "va"), name="A"),
        scatter_node("key", "value", "kc", "vc", "slots_b", outputs=("kb", "vb"), name="B"),
        _gather("a", ("ka", "va")),
        _gather("b", ("kb", "vb")),
    ]
    slots = [("slots_a", TensorProto.INT64), ("slots_b", TensorProto.INT64)]
    return _model(nodes, [*WRITE, *slots, *INDEX], ["a_k", "b_k"])


@pytest.mark.parametrize("host", list(HOSTS))
def test_two_writes_of_one_pool_each_see_their_own_rows_only(host: str) -> None:
    kc, vc = pools(1)
    new = rows(1)
    feeds = {"key": new, "value": new, "kc": kc, "vc": vc, "slots_a": np.array([0]), "slots_b": np.array([5]),
             **index_feeds()}  # fmt: skip
    got_a, got_b = HOSTS[host](two_writes_model()).run(None, feeds)
    assert np.array_equal(got_a, written(kc, [0], new).reshape(TOKENS, H, D)), "A's gather holds B's row"
    assert np.array_equal(got_b, written(kc, [5], new).reshape(TOKENS, H, D)), "B's gather holds A's row"


# --------------------------------------------------------------------------- #
# (c) an initializer pool
# --------------------------------------------------------------------------- #
def initializer_model(kc: np.ndarray, vc: np.ndarray) -> onnx.ModelProto:
    nodes = [scatter_node("key", "value", "kc", "vc", "slots", outputs=("kc2", "vc2"), name="write"), _gather("all", ("kc2", "vc2"))]
    inits = [onnx.numpy_helper.from_array(kc, "kc"), onnx.numpy_helper.from_array(vc, "vc")]
    return _model(nodes, [WRITE[0], WRITE[1], ("slots", TensorProto.INT64), *INDEX], ["all_k"], inits)


@pytest.mark.parametrize("host", list(HOSTS))
def test_an_initializer_pool_stays_the_models_constant(host: str) -> None:
    kc, vc = pools(2)
    session = HOSTS[host](initializer_model(kc, vc))
    first, second = rows(2), rows(3)
    session.run(None, {"key": first, "value": first, "slots": np.array([3]), **index_feeds()})
    (got,) = session.run(None, {"key": second, "value": second, "slots": np.array([9]), **index_feeds()})
    assert np.array_equal(got, written(kc, [9], second).reshape(TOKENS, H, D)), "the next run read the last run's rows"


@pytest.mark.skipif(ORT_MINOR < 18, reason="the alias route needs ORT >= 1.18")
def test_an_opted_in_host_with_an_initializer_pool_is_refused_at_session_creation() -> None:
    with pytest.raises(ORT_ERRORS, match=r"ScatterPaKvCache node 'write': key_cache 'kc' is an initializer"):
        raw(initializer_model(*pools(2)), alias="1")


# --------------------------------------------------------------------------- #
# What keeps the alias route, and what it is for
# --------------------------------------------------------------------------- #
def test_alias_hazards_names_the_node_and_the_pool() -> None:
    assert alias_hazards(make_scatter_model_for(*_torch_case(), then_gather=True, fallback=False)) == []
    assert alias_hazards(second_reader_model()) == [
        "ScatterPaKvCache node 'write': key_cache 'kc' is also read by GatherPaKvCache node 'gather_old'",
        "ScatterPaKvCache node 'write': value_cache 'vc' is also read by GatherPaKvCache node 'gather_old'",
    ]
    assert "ScatterPaKvCache node 'A': key_cache 'kc' is also read by ScatterPaKvCache node 'B'" in alias_hazards(two_writes_model())
    assert alias_hazards(initializer_model(*pools()))[0] == (
        "ScatterPaKvCache node 'write': key_cache 'kc' is an initializer (a constant of the model)"
    )
    # A pool that is also a graph output, or that a node makes, or a write inside a subgraph.
    unbound = make_scatter_model_for(*_torch_case(), fallback=False)
    unbound.graph.output.append(_value("key_cache"))
    assert "key_cache 'key_cache' is also a graph output" in alias_hazards(unbound)[0]
    made = _model([h.make_node("Identity", ["p"], ["kc"]), scatter_node("key", "value", "kc", "vc", "s", name="w")],
                  [("p", TensorProto.FLOAT), *WRITE[:2], ("vc", TensorProto.FLOAT), ("s", TensorProto.INT64)], ["key_cache_out"])  # fmt: skip
    assert "key_cache 'kc' is not a graph input" in alias_hazards(made)[0]
    shaped = make_scatter_model_for(*_torch_case(), then_gather=True, fallback=False)
    shaped.graph.node.append(h.make_node("Shape", ["key_cache"], ["pool_shape"]))  # reads no data: harmless
    assert alias_hazards(shaped) == []
    body = h.make_graph([scatter_node("key", "value", "kc", "vc", "s")], "body", [], [_value("key_cache_out")])
    looped = _model([h.make_node("If", ["c"], ["o"], then_branch=body, else_branch=body)], [("c", TensorProto.BOOL)], ["o"])
    assert alias_hazards(looped)[0] == "If node #0 (unnamed) has a write in its subgraph"


def _torch_case():
    kc, vc = (torch.from_numpy(p) for p in pools())
    return torch.from_numpy(rows(0)), torch.from_numpy(rows(0)), kc, vc, torch.tensor([5])


def _then_gather_feeds(kc, vc, new):
    return {"key": new, "value": new, "key_cache": kc, "value_cache": vc, "slot_mapping": np.array([5]),
            "block_tables": np.arange(NB, dtype=np.int64)[None], "seq_lens": np.array([0, TOKENS])}  # fmt: skip


@pytest.mark.parametrize("host, in_place", [("make_session", True), ("raw host", False), ("raw host, opted in", True)])
def test_a_write_feeding_only_later_nodes_takes_the_alias_route_where_asked(host: str, in_place: bool) -> None:
    """The demo's shape (a write whose outputs feed only a gather): make_session and an opted-in host write
    the caller's pools in place (no copy); a host that did not opt in gets a copy, its inputs untouched."""
    model = make_scatter_model_for(*_torch_case(), then_gather=True, fallback=False, opset_version=17)
    session = plugin(model) if host == "make_session" else raw(model, "1" if "opted" in host else None)
    kc, vc = pools()
    mine = kc.copy()
    new = rows(0)
    (got, _) = session.run(None, _then_gather_feeds(mine, vc.copy(), new))
    assert np.array_equal(got, written(kc, [5], new).reshape(TOKENS, H, D))
    assert np.array_equal(mine, written(kc, [5], new) if in_place and ORT_MINOR >= 18 else kc)


def test_options_registered_with_the_alias_route_refuse_a_model_it_is_unsafe_for() -> None:
    options = ort.SessionOptions()
    plugin(make_scatter_model_for(*_torch_case(), then_gather=True, fallback=False), sess_options=options)
    assert runtime_plugin.registered_alias(options) is True
    with pytest.raises(ValueError, match=r"alias route.*'gather_old'.*new onnxruntime.SessionOptions"):
        plugin(second_reader_model(), sess_options=options)
    fresh = ort.SessionOptions()
    plugin(second_reader_model(), sess_options=fresh)
    assert runtime_plugin.registered_alias(fresh) is False


# --------------------------------------------------------------------------- #
# (d) read-only pools: an error, never a signal
# --------------------------------------------------------------------------- #
READ_ONLY = """
import sys, os, tempfile, numpy as np, onnxruntime as ort, torch
sys.path.insert(0, {tests!r})
from test_write_in_place import _torch_case, _then_gather_feeds, pools, rows
from pakv_onnx import runtime_plugin
from pakv_onnx.export import make_scatter_model_for
from conftest import ORT_ERRORS

kc, vc = pools()
folder = tempfile.mkdtemp()
maps = []
for name, pool in (("k", kc), ("v", vc)):
    pool.tofile(os.path.join(folder, name))
    maps.append(np.memmap(os.path.join(folder, name), dtype=np.float32, mode="r", shape=pool.shape))
model = make_scatter_model_for(*_torch_case(), then_gather=True, fallback=False, opset_version=17)
# make_session's own session refuses the memmap (writeable=False) by name before ORT runs ...
try:
    runtime_plugin.make_session(model, backend={backend!r}).run(None, _then_gather_feeds(maps[0], maps[1], rows(0)))
except ValueError as exc:
    print("GUARDED", exc)
# ... and the kernel refuses read-only memory itself: a raw session on the alias route.
options = ort.SessionOptions()
runtime_plugin.register(options, {backend!r}, alias=True)
session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
try:
    session.run(None, _then_gather_feeds(maps[0], maps[1], rows(0)))
    print("RAN")
except ORT_ERRORS as exc:
    print("REFUSED", exc)
assert np.array_equal(maps[0], kc) and np.array_equal(maps[1], vc)
"""


@pytest.mark.parametrize("backend", ["native", "golden"])
def test_a_read_only_pool_in_ort_is_refused_not_a_signal(backend: str, tmp_path) -> None:
    """np.memmap(mode="r") pools fed to session.run of a graph that takes the alias route: the write would
    go to the read-only mapping (ORT >= 1.18); an error naming key_cache, nothing written. Older ORT copies."""
    script = tmp_path / "read_only.py"
    script.write_text(READ_ONLY.format(tests=os.path.dirname(__file__), backend=backend))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-1500:]}"
    assert "GUARDED key_cache is a read-only numpy array (writeable=False)" in result.stdout, result.stdout
    if ORT_MINOR >= 18:
        assert "REFUSED" in result.stdout and "key_cache: the rows this write goes to are not writable memory" in result.stdout


def _read_only(array: np.ndarray, tmp_path, name: str) -> np.memmap:
    path = tmp_path / name
    array.tofile(path)
    return np.memmap(path, dtype=array.dtype, mode="r", shape=array.shape)


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
@pytest.mark.parametrize("backend", ["native", "golden", "torch", "auto"])
def test_a_read_only_pool_through_the_python_api_is_refused(backend: str, tmp_path) -> None:
    kc, vc = pools()
    maps = [torch.from_numpy(_read_only(p, tmp_path, n)) for p, n in ((kc, "k"), (vc, "v"))]
    new = torch.from_numpy(rows(0))
    with pytest.raises(ValueError, match=r"^key_cache: the rows this write goes to are not writable memory"):
        pakv_onnx.scatter_pa_kv_cache(new, new, *maps, torch.tensor([5]), backend=backend)
    with pytest.raises(ValueError, match=r"^key_cache: the rows this write goes to are not writable memory"):
        torch.ops.pakv.scatter_pa_kv_cache(new, new, *maps, torch.tensor([5]))
    assert np.array_equal(maps[0].numpy(), kc)


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
@pytest.mark.parametrize("bound", ["the pools", "other read-only buffers"])
def test_outputs_bound_to_read_only_memory_are_refused(bound: str, tmp_path) -> None:
    """Bound to the (read-only) pools: the in-place route, refused naming key_cache; bound elsewhere to
    read-only memory: the copy route's destination, refused naming key_cache_out. Nothing written."""
    kc, vc = pools()
    maps = [torch.from_numpy(_read_only(p, tmp_path, n)) for p, n in ((kc, "k"), (vc, "v"))]
    outs = maps if bound == "the pools" else [torch.from_numpy(_read_only(p, tmp_path, n + "o")) for p, n in ((kc, "k"), (vc, "v"))]
    session = plugin(make_scatter_model_for(*_torch_case(), fallback=False, opset_version=17))
    new = torch.from_numpy(rows(0))
    feeds = dict(zip(SCATTER.input_names, (new, new, *maps, torch.tensor([5]))))
    name = "key_cache" if bound == "the pools" else "key_cache_out"
    with pytest.raises(ORT_ERRORS, match=rf"ValueError: {name}: the (rows this write goes to are|buffer is) not writable"):
        runtime_plugin.run(session, feeds, out=dict(zip(SCATTER.output_names, outs)))
    assert all(bitwise_equal(m, torch.from_numpy(p)) for m, p in zip(maps, (kc, vc)))


# --------------------------------------------------------------------------- #
# The probe needs no process_vm_writev (a seccomp policy may refuse it): it asks through a pipe
# --------------------------------------------------------------------------- #
NO_VM_WRITEV = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <sys/uio.h>
#include <unistd.h>
/* What a seccomp policy that refuses the call looks like to the library (said once on stderr). */
ssize_t process_vm_writev(pid_t pid, const struct iovec* l, unsigned long nl, const struct iovec* r, unsigned long nr,
                          unsigned long flags) {
  static int said;
  (void)pid; (void)l; (void)nl; (void)r; (void)nr; (void)flags;
  if (!said++) write(2, "process_vm_writev refused\n", 26);
  errno = EPERM;
  return -1;
}
"""

PIPE_PROBE = """
import sys, numpy as np, torch, warnings
warnings.simplefilter("ignore")
import pakv_onnx
kc = np.zeros((4, 4, 2, 8), np.float32)
kc.tofile(sys.argv[1])
read_only = torch.from_numpy(np.memmap(sys.argv[1], dtype=np.float32, mode="r", shape=kc.shape))
key = torch.ones(2, 2, 8)
try:
    pakv_onnx.scatter_pa_kv_cache(key, key, read_only, torch.zeros(4, 4, 2, 8), torch.tensor([1, 14]))
    print("WROTE")
except ValueError as exc:
    print("REFUSED", exc)
pool = torch.zeros(4, 4, 2, 8)
pakv_onnx.scatter_pa_kv_cache(key, key, pool, torch.zeros(4, 4, 2, 8), torch.tensor([1, 14]))
assert float(pool.sum()) == 32.0 and np.array_equal(np.asarray(read_only), kc)
print("OK")
"""


def _pipe_probe_with_shim(tmp_path, shim_source: str, script: str = PIPE_PROBE) -> subprocess.CompletedProcess:
    """``script`` (PIPE_PROBE) in a fresh process with ``shim_source`` (C) compiled and LD_PRELOADed."""
    shim, source = tmp_path / "shim.so", tmp_path / "shim.c"
    source.write_text(shim_source)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(shim), str(source)], check=True)
    env = dict(os.environ, LD_PRELOAD=str(shim), PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "pool")], capture_output=True, text=True,
                            timeout=120, env=env)  # fmt: skip
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-1500:]}"
    return result


def test_the_probe_works_where_process_vm_writev_is_refused(tmp_path) -> None:
    result = _pipe_probe_with_shim(tmp_path, NO_VM_WRITEV)
    assert "process_vm_writev refused" not in result.stderr  # never asked: the pipe is the probe
    assert "REFUSED key_cache: the rows this write goes to are not writable memory" in result.stdout and "OK" in result.stdout


NO_PIPE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <unistd.h>
/* A process out of file descriptors, as the library's probe pipe sees it. */
int pipe2(int fds[2], int flags) {
  (void)fds; (void)flags;
  errno = EMFILE;
  return -1;
}
"""


def test_a_decode_steps_two_probes_need_no_pipe(tmp_path) -> None:
    """One or two probes (a decode step writes one page of each cache) are futex(2) atomic adds of 0, one call
    each (pakv_writable.c): a read-only pool is refused even where the probe's pipe cannot be made (before,
    the probe could not tell, the write went ahead and died of SIGSEGV), the pool's bytes unchanged."""
    result = _pipe_probe_with_shim(tmp_path, NO_PIPE)
    assert "REFUSED key_cache: the rows this write goes to are not writable memory" in result.stdout and "OK" in result.stdout


SPREAD_PROBE = """
import mmap, sys, numpy as np, torch, warnings
warnings.simplefilter("ignore")
import pakv_onnx
page = mmap.PAGESIZE
# One block a page: slots 1 and 14 (blocks 0 and 3) on two pages of each cache, four probes in all.
np.zeros((4, page // 4), np.float32).tofile(sys.argv[1])
read_only = torch.from_numpy(np.memmap(sys.argv[1], dtype=np.float32, mode="r", shape=(4, page // 4)))
writable = torch.zeros(4, page // 4)
pools = [p[:, :64].view(4, 4, 2, 8) for p in (read_only, writable)]
key = torch.ones(2, 2, 8)
try:
    pakv_onnx.scatter_pa_kv_cache(key, key, *pools, torch.tensor([1, 14]))
    print("WROTE")
except ValueError as exc:
    print("REFUSED", exc)
assert not np.asarray(read_only).any() and not writable.any()
print("OK")
"""


def test_more_than_two_probes_without_a_pipe_ask_futex_one_by_one(tmp_path) -> None:
    """Four probes where the probe's pipe cannot be made (a process out of descriptors): each byte asked by
    futex(2) in turn, the read-only key cache refused by name, nothing written. Before, the probe could not
    tell and the write went ahead: SIGSEGV (seen as a flaky crash of the two-probe test above whenever the
    value pool's zeros happened to straddle a page: a third probe)."""
    result = _pipe_probe_with_shim(tmp_path, NO_PIPE, SPREAD_PROBE)
    assert "REFUSED key_cache: the rows this write goes to are not writable memory" in result.stdout, result.stdout
    assert "OK" in result.stdout


def test_more_than_two_probes_go_through_the_pipe_and_keep_every_value() -> None:
    """Four probes (each cache's first and last written byte on different pages) take the pipe's two calls:
    a value cache whose last written page is read-only is refused by name, nothing written, every byte of
    both pools as it was; writable again, the same write goes through."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    blocks, block_size, heads, dim = 4, 4, 2, 8  # 256 bytes a block: slots 1 and 14 on one page unless spread
    per_block = page  # one block a page: the two written rows of each cache on two pages
    areas = [mmap.mmap(-1, blocks * per_block, prot=mmap.PROT_READ | mmap.PROT_WRITE) for _ in range(2)]
    for area in areas:
        area[:] = bytes(range(256)) * (blocks * per_block // 256)
    pools = [torch.frombuffer(area, dtype=torch.float32).view(blocks, per_block // 4)[:, : block_size * heads * dim]
             .view(blocks, block_size, heads, dim) for area in areas]  # fmt: skip
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    value_base = ctypes.addressof(ctypes.c_char.from_buffer(areas[1]))
    key = torch.ones(2, heads, dim)
    slots = torch.tensor([1, 14])  # blocks 0 and 3
    before = [bytes(area) for area in areas]
    assert libc.mprotect(value_base + 3 * per_block, per_block, mmap.PROT_READ) == 0
    with pytest.raises(ValueError, match=r"^value_cache: the rows this write goes to are not writable memory"):
        pakv_onnx.scatter_pa_kv_cache(key, key, pools[0], pools[1], slots)
    assert [bytes(area) for area in areas] == before
    assert libc.mprotect(value_base + 3 * per_block, per_block, mmap.PROT_READ | mmap.PROT_WRITE) == 0
    pakv_onnx.scatter_pa_kv_cache(key, key, pools[0], pools[1], slots)
    assert float(pools[0][0, 1].sum()) == float(pools[1][3, 2].sum()) == heads * dim


def test_the_writability_probe_names_the_first_unwritable_byte_and_keeps_every_value() -> None:
    """The probe (pakv_writable.c, through native_lib.check_buffer_writable: a buffer's first and last
    byte): a buffer whose last page is read-only, or unreadable, is refused naming it; the bytes probed
    keep their values; a probe that failed half-way leaves nothing behind for the next one (its pipe
    drained), in this process and in a forked child."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    area = mmap.mmap(-1, 3 * page, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    area[:] = bytes(range(256)) * (3 * page // 256)
    base = ctypes.addressof(ctypes.c_char.from_buffer(area))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    native_lib.check_buffer_writable(base, 3 * page, "whole")  # all writable: no error
    for protection in (mmap.PROT_READ, 0):  # read-only, then PROT_NONE (unreadable too)
        assert libc.mprotect(base + 2 * page, page, protection) == 0
        with pytest.raises(ValueError, match=r"^half: the buffer is not writable memory .*nothing was written"):
            native_lib.check_buffer_writable(base + page // 2, 2 * page, "half")
        native_lib.check_buffer_writable(base, 2 * page, "first two pages")  # the pipe holds nothing stale
        assert libc.mprotect(base + 2 * page, page, mmap.PROT_READ | mmap.PROT_WRITE) == 0
    assert area[:] == bytes(range(256)) * (3 * page // 256)
    pid = os.fork()
    if pid == 0:  # the child probes through its own pipe
        try:
            native_lib.check_buffer_writable(base, 3 * page, "child")
            os._exit(0)
        except BaseException:
            os._exit(1)
    assert os.waitpid(pid, 0)[1] == 0
    native_lib.check_buffer_writable(base, 3 * page, "parent after fork")
