"""com.microsoft::PagedAttention under attack (issue 35): each defect an adversarial user found, on
every path that reaches the op:

* ORT, one-node model: cache outputs bound to the pools (``ort-bound``), cache outputs ORT allocates
  (``ort-allocated``), a node without cache outputs writing its cache inputs in place (``ort-in-place``);
* the Python front with each backend (``api-native``, ``api-golden``, ``api-auto``) and with ``out=``;
* ``torch.ops.pakv.ort_paged_attention`` (in place) and ``..._functional``.

A refusal is the validator's typed error (an ORT error through a session) naming the input or the
attribute, with nothing written; a computed case is compared across paths. The long race runs in the
slow set (and inside ORT under ASan + UBSan: tests/native/ort_attention_session.py).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import numpy as np
import onnxruntime as ort
import pytest
import torch
from conftest import ORT_ERRORS
from ort_attention_cases import OrtCall, model_for, random_ort_call

import pakv_onnx
import pakv_onnx.export.ort_attention  # noqa: F401  (defines torch.ops.pakv.ort_paged_attention*)
from pakv_onnx import runtime_plugin
from pakv_onnx.spec import ORT_ATTENTION, bitwise_equal


# --------------------------------------------------------------------------------------------- #
# The paths
# --------------------------------------------------------------------------------------------- #
def _ort(call: OrtCall, outputs: tuple[str, ...], bound: bool) -> torch.Tensor:
    session = runtime_plugin.make_session(model_for(call, outputs))
    names = [o.name for o in session.get_outputs()]
    out = {}
    if bound:
        out = {"key_cache_out": call.inputs["key_cache"], "value_cache_out": call.inputs["value_cache"]}
        out = {k: v for k, v in out.items() if k in names and v is not None}
    feeds = {k: v for k, v in call.inputs.items() if v is not None}
    return runtime_plugin.run(session, feeds, names, out)["output"]


def _api(call: OrtCall, backend: str, with_out: bool = False) -> torch.Tensor:
    attributes = dict(call.attributes)
    heads, kv_heads = attributes.pop("num_heads"), attributes.pop("kv_num_heads")
    out = None
    if with_out:
        width = heads * (attributes.get("v_head_size") or call.inputs["key_cache"].shape[3])
        width = width if width < 4096 else 64  # an absurd head count: a small out (the validator refuses first)
        out = torch.empty(call.inputs["query"].shape[0], width, dtype=call.inputs["query"].dtype)
    args = [call.inputs[name] for name in ORT_ATTENTION.input_names]
    return pakv_onnx.ort_paged_attention(
        *args, num_heads=heads, kv_num_heads=kv_heads, backend=backend, out=out, **attributes
    )


def _torch_op(call: OrtCall, functional: bool) -> torch.Tensor:
    op = torch.ops.pakv.ort_paged_attention_functional if functional else torch.ops.pakv.ort_paged_attention
    result = op(**{name: call.inputs[name] for name in ORT_ATTENTION.input_names}, **call.attributes)
    if not functional:
        return result
    output, key_cache, value_cache = result
    call.inputs["key_cache"].copy_(key_cache)  # the functional op's updated caches, for comparisons
    if call.inputs["value_cache"] is not None:
        call.inputs["value_cache"].copy_(value_cache)
    return output


OUTPUTS = ("output", "key_cache_out", "value_cache_out")
PATHS: dict[str, Callable[[OrtCall], torch.Tensor]] = {
    "ort-bound": lambda c: _ort(c, OUTPUTS, bound=True),
    "ort-allocated": lambda c: _ort(c, OUTPUTS, bound=False),
    "ort-in-place": lambda c: _ort(c, ("output",), bound=False),
    "api-native": lambda c: _api(c, "native"),
    "api-golden": lambda c: _api(c, "golden"),
    "api-auto": lambda c: _api(c, "auto"),
    "api-native-out": lambda c: _api(c, "native", with_out=True),
    "api-golden-out": lambda c: _api(c, "golden", with_out=True),
    "torch-op": lambda c: _torch_op(c, functional=False),
    "torch-op-functional": lambda c: _torch_op(c, functional=True),
}
TORCH_PATHS = [p for p in PATHS if not p.startswith("ort")]  # the paths a meta tensor or a str can reach


def _refused_everywhere(path: str, call: OrtCall, pattern: str, error: type = ValueError) -> None:
    """``call`` through ``path`` is refused with ``pattern`` (an ORT error through a session) and no
    pool byte changes."""
    pools = {n: t for n in ("key_cache", "value_cache") if (t := call.inputs[n]) is not None}
    before = {n: t.clone() for n, t in pools.items()}
    with pytest.raises(ORT_ERRORS if path.startswith("ort") else error, match=pattern):
        PATHS[path](call)
    for name, tensor in pools.items():
        assert bitwise_equal(tensor, before[name]), f"{name} written"


# --------------------------------------------------------------------------------------------- #
# 1, 8: sums and products of user values, checked
# --------------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("path", PATHS)
def test_rotary_offset_near_int64_max_is_refused_not_a_heap_overflow(path: str) -> None:
    """rotary_offset + rotary_dim used to wrap negative, pass the width rule and rotate channels 2**63
    elements past the head ("double free or corruption")."""
    call = random_ort_call(350, dtype="float32", num_heads=1, kv_num_heads=1, sequences=((0, 1),), num_blocks=2)
    call.inputs.update(cos_cache=torch.ones(4, 4096), sin_cache=torch.zeros(4, 4096))
    call.attributes.update(do_rotary=1, rotary_offset=2**63 - 8)
    _refused_everywhere(
        path, call, re.escape("rotary_offset (9223372036854775800) + rotary_dim (2 x cos_cache's dim 1 = 2 x 4096)")
    )


@pytest.mark.parametrize("path", PATHS)
def test_packed_head_counts_that_overflow_are_refused_with_their_values(path: str) -> None:
    """num_heads + 2 x kv_num_heads of 2**62 each: refused before (as a wrong hidden size), but through a
    signed overflow (UBSan) and with a negative count in the message."""
    call = random_ort_call(351, dtype="float32")
    call.inputs.update(key=None, value=None)
    call.attributes.update(num_heads=2**62, kv_num_heads=2**62)
    _refused_everywhere(path, call, r"num_heads \(4611686018427387904\) \+ 2 x kv_num_heads \(4611686018427387904\) overflows int64")


@pytest.mark.parametrize("path", TORCH_PATHS)
def test_a_token_stride_that_overflows_byte_offsets_is_refused(path: str) -> None:
    """A one-token query view may carry any stride (it is never stepped): its byte stride is still formed."""
    call = random_ort_call(352, dtype="float32", sequences=((2, 1),))
    call.inputs["query"] = call.inputs["query"].as_strided((1, 64), (2**62, 1))
    _refused_everywhere(path, call, r"^query: a token stride of 4611686018427387904 elements overflows int64")


# --------------------------------------------------------------------------------------------- #
# 2: a LATENT node declaring value_cache_out
# --------------------------------------------------------------------------------------------- #
def _latent_model_with_value_output(call: OrtCall):
    model = model_for(call, ("output", "key_cache_out"))
    node, graph = model.graph.node[0], model.graph
    node.output.append("value_cache_out")
    graph.output.append(type(graph.output[0])(name="value_cache_out", type=graph.output[1].type))
    return model


def test_a_latent_node_declaring_value_cache_out_is_refused_at_session_creation() -> None:
    """The kernel never asked ORT for that output: session.run returned None for it and reading it
    through an IOBinding was a SIGSEGV in onnxruntime's binding. Now the node is refused by the rule."""
    call = random_ort_call(353, dtype="float32", latent=True, num_heads=1, head_size=8, v_head_size=4, scale=0.5)
    model = _latent_model_with_value_output(call)
    with pytest.raises(ORT_ERRORS, match=re.escape("value_cache_out has no place when kv_cache_layout is 'LATENT'")):
        runtime_plugin.make_session(model)
    options = ort.SessionOptions()  # a raw host: the same refusal, from the kernel's creation
    runtime_plugin.register(options)
    with pytest.raises(ORT_ERRORS, match=re.escape("value_cache_out has no place")):
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


_FAKE_LATENT = """
import ctypes, sys
from fake_ort_api import FakeOrtError, FakeRuntime
from pakv_onnx import native_lib

runtime = FakeRuntime(api_version=17)
ops = runtime.register(native_lib.load())
op = next(a for a in ops if runtime.op(a).GetName(a) == b"PagedAttention"
          and runtime.op(a).GetInputType(a, 0) == 1 and runtime.op(a).GetInputType(a, 3) == 1)
attributes = {"num_heads": 1, "kv_num_heads": 1, "kv_cache_layout": "LATENT", "v_head_size": 4, "scale": 0.5}
nodes = (
    {**attributes, "(outputs)": ("output", "key_cache_out", "")},
    {**attributes, "(outputs)": ("output", "key_cache_out", "value_cache_out")},
    {**attributes, "(outputs)": ("output",), "(constants)": (3,)},  # in place, key_cache an initializer
)
for node in nodes:
    try:
        runtime.destroy_kernel(op, runtime.create_kernel(op, node))
        print("CREATED")
    except FakeOrtError as exc:
        print("REFUSED", exc)
"""


def test_the_kernel_reads_its_nodes_declared_outputs_at_creation() -> None:
    """Any host (here the fake runtime of tests/fake_ort_api.py): a LATENT node whose third output is
    absent ("") is created; one that names it is refused by the rule, before any run; one without cache
    outputs whose key_cache is a constant initializer is refused naming the node and the input."""
    from conftest import run_python

    result = run_python(_FAKE_LATENT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("CREATED"), result.stdout
    assert lines[1].startswith("REFUSED") and "value_cache_out has no place" in lines[1], result.stdout
    assert lines[2].startswith("REFUSED") and "node 'node': key_cache 'input_3' is an initializer" in lines[2]


# --------------------------------------------------------------------------------------------- #
# 3: the slots come from the table value the validator checked
# --------------------------------------------------------------------------------------------- #
BATCH, BLOCKS, RACED_BLOCK = 1 << 20, 16, 6


def _race_call() -> OrtCall:
    """One decode token (sequence 0, position 0, block RACED_BLOCK) in a batch of BATCH sequences, the
    others idle: the validator's pass over the batch after it checked sequence 0's table entry and
    before it derives its slot takes about a millisecond, a window another thread's change can fall in."""
    table = torch.full((BATCH, 1), -1, dtype=torch.int64)  # idle sequences read no entry
    table[0, 0] = RACED_BLOCK
    cu = torch.ones(BATCH + 1, dtype=torch.int64)
    cu[0] = 0
    inputs = dict.fromkeys(ORT_ATTENTION.input_names)
    inputs.update(
        query=torch.ones(1, 16),
        key=torch.ones(1, 16),
        value=torch.ones(1, 16),
        key_cache=torch.zeros(BLOCKS, 16, 1, 16),
        value_cache=torch.zeros(BLOCKS, 16, 1, 16),
        cumulative_sequence_length=cu,
        past_seqlens=torch.zeros(BATCH, dtype=torch.int64),
        block_table=table,
    )
    return OrtCall(inputs, {"num_heads": 1, "kv_num_heads": 1})


def race_block_table(seconds: float) -> dict[str, int]:
    """Another thread (tests/table_flipper.py: native, without the GIL) flips block_table[0, 0] between
    2**62 (x block_size overflows int64, and used to wrap to slot 0) and RACED_BLOCK while a node without
    cache outputs runs in ORT (its pools written in place, every input bound in place); returns the
    counts. Fails on the first run that wrote a block no table names."""
    from table_flipper import Flipping

    call = _race_call()
    options = ort.SessionOptions()
    options.log_severity_level = 4  # the refusals are counted, not logged
    session = runtime_plugin.make_session(model_for(call, ("output",)), sess_options=options)
    feeds = {k: v for k, v in call.inputs.items() if v is not None}
    counts = {"ran": 0, "refused": 0}
    with Flipping(call.inputs["block_table"].data_ptr(), 2**62, RACED_BLOCK):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                runtime_plugin.run(session, feeds, ["output"])
                counts["ran"] += 1
            except ORT_ERRORS as exc:  # the value read was 2**62: refused by name
                # by the validator naming the entry, or by the attention core re-reading it
                assert re.search(r"block_table\[0, 0\] = 4611686018427387904|block_tables changed (after validation|while the attention ran)", str(exc)), str(exc)
                counts["refused"] += 1
            for cache in (call.inputs["key_cache"], call.inputs["value_cache"]):
                written = cache.reshape(BLOCKS, -1).any(dim=1)
                written[RACED_BLOCK] = False
                assert not bool(written.any()), f"blocks {written.nonzero().flatten().tolist()} written: no table names them"
    return counts


def test_a_block_table_changed_during_the_call_never_sends_a_row_to_an_unnamed_block() -> None:
    """Seconds of the race (block 0 got the row within 2-4 s before): every call runs, or is refused
    naming the entry; no block but the named one is written."""
    counts = race_block_table(4.0)
    assert counts["ran"] + counts["refused"] > 0, counts


@pytest.mark.slow
def test_a_block_table_changed_during_the_call_long() -> None:
    counts = race_block_table(30.0)
    assert counts["ran"] > 0 and counts["refused"] > 0, counts


# --------------------------------------------------------------------------------------------- #
# 4: golden follows the documented non-finite rules
# --------------------------------------------------------------------------------------------- #
NON_FINITE = ("nan-query", "all-minus-inf-no-sink", "all-minus-inf-finite-sink", "nan-sink")


def _non_finite_call(case: str) -> OrtCall:
    call = random_ort_call(354, dtype="float32", sink=case.endswith("sink") and "no-sink" not in case)
    if case == "nan-query":
        call.inputs["query"][0, :16] = float("nan")  # token 0, head 0
    if case.startswith("all-minus-inf"):  # -inf keys x positive query -> -inf scores for kv head 0
        call.inputs["query"][0, :32] = 1.0  # token 0's query heads 0 and 1 (kv head 0's)
        call.inputs["key_cache"][..., 0, :] = float("-inf")
        call.inputs["key"][:, :16] = float("-inf")
    if case == "all-minus-inf-finite-sink":
        call.inputs["head_sink"][:] = 0.0
    if case == "nan-sink":
        call.inputs["head_sink"][0] = float("nan")
    return call


@pytest.mark.parametrize("case", NON_FINITE)
def test_golden_and_native_agree_on_the_non_finite_rules(case: str) -> None:
    """docs/reliability.md: a NaN score, or a head whose every visible score is -inf with no sink, gives
    a NaN row (golden gave 0); with a finite sink, 0. Bit-for-bit NaN placement equal on every path."""
    results = {}
    for path in ("api-native", "api-golden", "ort-bound", "torch-op"):
        call = _non_finite_call(case)
        results[path] = PATHS[path](call).view(9, 4, 16)
    want_nan = results["api-native"].isnan()
    if case == "nan-query" or case == "nan-sink":
        assert bool(want_nan[0, 0].all())
    if case == "all-minus-inf-no-sink":
        assert bool(want_nan[0, :2].all())  # query heads 0 and 1 read kv head 0
    if case == "all-minus-inf-finite-sink":
        assert not bool(want_nan[0, :2].any()) and bool((results["api-native"][0, :2] == 0).all())
    for path, got in results.items():
        assert torch.equal(got.isnan(), want_nan), path


# --------------------------------------------------------------------------------------------- #
# 5, 6: meta tensors and embedded NULs through the torch paths
# --------------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("name", ["query", "key", "key_cache", "block_table", "cos_cache"])
@pytest.mark.parametrize("path", TORCH_PATHS)
def test_a_meta_tensor_among_cpu_ones_is_refused_by_name(path: str, name: str) -> None:
    """torch.ops used to run the fake kernel (an uninitialised output, nothing written); the API named
    the wrong input ("key must be on the caches' device meta") when query was the meta one."""
    call = random_ort_call(355, dtype="float32", rotary="half" if name == "cos_cache" else None)
    call.inputs[name] = call.inputs[name].to("meta")
    pools = {n: t for n in ("key_cache", "value_cache") if (t := call.inputs[n]) is not None and not t.is_meta}
    before = {n: t.clone() for n, t in pools.items()}
    with pytest.raises(ValueError, match=rf"^{name} is on the meta device"):
        PATHS[path](call)
    assert all(bitwise_equal(t, before[n]) for n, t in pools.items())


@pytest.mark.parametrize("attribute", ["k_quant_type", "v_quant_type", "kv_cache_layout", "k_cache_dtype"])
@pytest.mark.parametrize("path", PATHS)
def test_an_embedded_nul_in_a_string_attribute_is_refused_by_name(path: str, attribute: str) -> None:
    """"NONE\\0X" ran as NONE on the API and torch.ops; the ONNX path refused it. One reader now (C)."""
    call = random_ort_call(356, dtype="float32")
    call.attributes[attribute] = {"kv_cache_layout": "SEPARATE", "k_cache_dtype": ""}.get(attribute, "NONE") + "\x00X"
    _refused_everywhere(path, call, rf"{attribute} must be .*got '\(a NUL at byte \d\)'")


# --------------------------------------------------------------------------------------------- #
# 7: inputs stored inside the pools the call writes
# --------------------------------------------------------------------------------------------- #
def _inside(pool: torch.Tensor, like: torch.Tensor, row: int = 0) -> torch.Tensor:
    """A copy of ``like`` stored in ``pool``'s bytes from block ``row`` on (a view of the pool)."""
    start = row * pool[0].nbytes
    view = pool.view(torch.uint8).reshape(-1)[start : start + like.nbytes].view(like.dtype).view(like.shape)
    return view.copy_(like)


def _aliased_call(name: str) -> OrtCall:
    call = random_ort_call(357, dtype="float32", rotary="half", norm=True)
    written = int(call.inputs["block_table"][0, 0])  # sequence 0 writes this block (its row 3)
    call.inputs[name] = _inside(call.inputs["value_cache" if name == "q_norm_weight" else "key_cache"], call.inputs[name], written)
    return call


@pytest.mark.parametrize("name", ["cos_cache", "q_norm_weight", "block_table", "cumulative_sequence_length"])
@pytest.mark.parametrize("path", PATHS)
def test_an_input_stored_in_a_pool_the_call_writes_is_refused_up_front(path: str, name: str) -> None:
    """The result depended on the write order, or the caches were written and then "block tables changed
    while the attention ran" was raised, or golden raised IndexError."""
    call = _aliased_call(name)
    _refused_everywhere(path, call, rf"^{name} overlaps (key|value)_cache in memory|{name} overlaps")


# --------------------------------------------------------------------------------------------- #
# The contract questions: initializers, read-only numpy pools, unknown attributes
# --------------------------------------------------------------------------------------------- #
def _initializer_pool_model(call: OrtCall):
    from onnx import numpy_helper

    model = model_for(call, ("output",))
    model.graph.node[0].name = "attend"
    model.graph.initializer.append(numpy_helper.from_array(call.inputs["key_cache"].numpy(), "key_cache"))
    del model.graph.input[[i.name for i in model.graph.input].index("key_cache")]
    return model


def test_a_node_without_cache_outputs_never_modifies_an_initializer_pool() -> None:
    """ORT's contract writes a node's cache inputs in place when it has no cache outputs: a constant pool
    would hold the last run's rows at the next run. make_session refuses by node and input; a raw host's
    session is refused at kernel creation by the same C check (constant initializers)."""
    call = random_ort_call(358, dtype="float32")
    model = _initializer_pool_model(call)
    with pytest.raises(ValueError, match=r"PagedAttention node 'attend': key_cache 'key_cache' is an initializer .* no cache outputs"):
        runtime_plugin.make_session(model)
    options = ort.SessionOptions()
    runtime_plugin.register(options)
    with pytest.raises(ORT_ERRORS, match=r"PagedAttention node 'attend': key_cache 'key_cache' is an initializer .* no cache outputs"):
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def test_an_overridable_initializer_pool_is_refused_by_make_session() -> None:
    """An initializer that is also a graph input is not a constant to ORT (the kernel cannot tell it from
    a feed), but a run that does not feed it writes the model's own tensor: make_session refuses it."""
    from onnx import helper

    call = random_ort_call(359, dtype="float32")
    model = _initializer_pool_model(call)
    model.graph.input.append(helper.make_tensor_value_info("key_cache", 1, None))
    with pytest.raises(ValueError, match=r"key_cache 'key_cache' is an initializer"):
        runtime_plugin.make_session(model)


def test_a_read_only_numpy_pool_is_refused_by_the_session_make_session_returns() -> None:
    """numpy pools with writeable=False were written in place (the kernel sees an address, not the flag)."""
    call = random_ort_call(360, dtype="float32")
    session = runtime_plugin.make_session(model_for(call, ("output",)))
    feeds = {n: t.numpy().copy() for n, t in call.inputs.items() if t is not None}
    feeds["value_cache"].setflags(write=False)
    before = feeds["value_cache"].copy()
    with pytest.raises(ValueError, match=r"^value_cache is a read-only numpy array \(writeable=False\), and PagedAttention node"):
        session.run(None, feeds)
    np.testing.assert_array_equal(feeds["value_cache"], before)
    feeds["value_cache"] = feeds["value_cache"].copy()  # writable: runs
    assert session.run(None, feeds)[0].shape == (9, 64)


def test_an_unknown_attribute_is_refused_by_name() -> None:
    call = random_ort_call(361, dtype="float32")
    call.attributes["rotary_base"] = 10000
    model = model_for(call)
    model.graph.node[0].name = "attend"
    with pytest.raises(ValueError, match=r"^PagedAttention node 'attend': unknown attribute 'rotary_base'"):
        runtime_plugin.make_session(model)
    with pytest.raises(TypeError, match=r"unknown attribute 'rotary_base'"):
        _api(call, "native")
