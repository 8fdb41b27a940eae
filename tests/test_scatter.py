"""ScatterPaKvCache (issue 20): every backend, the torch ops, the exporters, stock ORT and the plugin,
bit-exact against an independent per-token reference; every refusal worded once (the C validator)
and raised the same on every path with nothing written; the in-place routes in ORT shown by which
buffer was written."""

from __future__ import annotations

import re

import onnxruntime as ort
import pytest
import torch
from conftest import ORT_ERRORS
from onnx_graphs import graph_feeds, plugin_refusal
from per_token_reference import scatter_per_token

import pakv_onnx
from pakv_onnx import export as pe
from pakv_onnx import runtime_plugin
from pakv_onnx.cases import ScatterCase, random_cache, random_scatter_case
from pakv_onnx.export import make_scatter_model_for
from pakv_onnx.spec import CACHE_DTYPES, SCATTER, CacheMode, bitwise_equal

BACKENDS = ["golden", "native", "torch", "auto"]
ORT_MINOR = int(ort.__version__.split(".")[1])


def reference(case: ScatterCase) -> tuple[torch.Tensor, torch.Tensor]:
    return scatter_per_token(*case.inputs(), cache_mode=case.cache_mode)


def assert_caches(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], label: str) -> None:
    for name, g, w in zip(("key_cache", "value_cache"), got, want):
        assert bitwise_equal(g, w), f"{label}: {name} differs from the per-token reference"


# --------------------------------------------------------------------------- #
# Bytes
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_writes_the_reference_bytes(seed: int, backend: str) -> None:
    case = random_scatter_case(seed)
    want = reference(case)
    mine = case.fresh()
    got = pakv_onnx.scatter_pa_kv_cache(*mine.inputs(), cache_mode=case.cache_mode, backend=backend)
    assert got[0] is mine.key_cache and got[1] is mine.value_cache  # in place, the caller's tensors
    assert_caches(got, want, f"{backend} seed {seed}")


@pytest.mark.parametrize("mode", list(CacheMode))
@pytest.mark.parametrize("dtype", [d.torch_dtype for d in CACHE_DTYPES], ids=[d.name for d in CACHE_DTYPES])
def test_every_dtype_and_layout_on_every_backend(mode: CacheMode, dtype: torch.dtype) -> None:
    case = random_scatter_case(7, dtype=dtype, value_dtype=torch.bfloat16, cache_mode=mode, num_tokens=9)
    want = reference(case)
    for backend in BACKENDS:
        mine = case.fresh()
        assert_caches(pakv_onnx.scatter_pa_kv_cache(*mine.inputs(), cache_mode=mode, backend=backend), want, backend)


def test_the_reference_itself_on_a_hand_checked_case() -> None:
    """bs = 2: slot 3 is block 1 row 1, slot 0 block 0 row 0, -1 is padding (nothing written)."""
    cache = torch.zeros(3, 2, 1, 2, dtype=torch.int16)
    key = torch.tensor([[[1, 2]], [[3, 4]], [[5, 6]]], dtype=torch.int16)
    want_k, _ = scatter_per_token(key, key, cache, cache, torch.tensor([3, -1, 0]), cache_mode="Norm")
    assert want_k[1, 1].tolist() == [[1, 2]] and want_k[0, 0].tolist() == [[5, 6]] and int(want_k.abs().sum()) == 14


@pytest.mark.parametrize("mode", list(CacheMode))
@pytest.mark.parametrize("backend", BACKENDS)
def test_pool_views_are_written_in_place(mode: CacheMode, backend: str) -> None:
    """``pool[:, 0]`` / ``pool[:, 1]`` of one ``[nb, 2, ...]`` pool: the pool's own bytes change, only at the slots."""
    gen = torch.Generator().manual_seed(3)
    block = (4, 2, 8) if mode is CacheMode.NORM else (1, 4, 16)
    pool = random_cache((5, 2, *block), torch.bfloat16, gen)
    key_view, value_view = pool[:, 0], pool[:, 1]
    key = random_cache((3, 2, 8) if mode is CacheMode.NORM else (3, 1, 16), torch.bfloat16, gen)
    slots = torch.tensor([6, -1, 1])
    want = scatter_per_token(key, key, key_view, value_view, slots, cache_mode=mode)
    before = pool.clone()
    pakv_onnx.scatter_pa_kv_cache(key, key, key_view, value_view, slots, cache_mode=mode, backend=backend)
    assert_caches((pool[:, 0], pool[:, 1]), want, backend)
    assert key_view.data_ptr() == pool.data_ptr() and not bitwise_equal(pool, before)


def test_padding_only_writes_nothing() -> None:
    case = random_scatter_case(11, num_tokens=6, cache_mode=CacheMode.NORM)
    case = ScatterCase(**{**case.__dict__, "slot_mapping": torch.full((6,), -1, dtype=torch.int64)})
    for backend in BACKENDS:
        mine = case.fresh()
        pakv_onnx.scatter_pa_kv_cache(*mine.inputs(), backend=backend)
        assert_caches((mine.key_cache, mine.value_cache), (case.key_cache, case.value_cache), backend)


def test_a_slice_of_a_fused_qkv_projection_is_read_in_place() -> None:
    """key with a token stride (``qkv[:, 1]`` of ``[T, 3, H, D]``) needs no copy."""
    gen = torch.Generator().manual_seed(4)
    qkv = random_cache((4, 3, 2, 8), torch.float16, gen)
    cache = random_cache((3, 4, 2, 8), torch.float16, gen)
    slots = torch.tensor([0, 5, 11, 2])
    want = scatter_per_token(qkv[:, 1], qkv[:, 2], cache, cache.clone(), slots, cache_mode="Norm")
    for backend in BACKENDS:
        k, v = cache.clone(), cache.clone()
        assert_caches(pakv_onnx.scatter_pa_kv_cache(qkv[:, 1], qkv[:, 2], k, v, slots, backend=backend), want, backend)


def test_torch_ops() -> None:
    from torch.library import opcheck

    case = random_scatter_case(5, dtype=torch.bfloat16, value_dtype=torch.bfloat16, cache_mode=CacheMode.NORM, num_tokens=5)
    want = reference(case)
    mine = case.fresh()
    assert torch.ops.pakv.scatter_pa_kv_cache(*mine.inputs(), cache_mode="Norm") is None
    assert_caches((mine.key_cache, mine.value_cache), want, "torch.ops in place")
    untouched = case.fresh()
    got = torch.ops.pakv.scatter_pa_kv_cache_functional(*untouched.inputs())
    assert_caches(got, want, "functional")
    assert_caches((untouched.key_cache, untouched.value_cache), (case.key_cache, case.value_cache), "functional input")
    for op in (torch.ops.pakv.scatter_pa_kv_cache, torch.ops.pakv.scatter_pa_kv_cache_functional):
        results = opcheck(op, case.fresh().inputs())
        assert all(v == "SUCCESS" for v in results.values()), results


# --------------------------------------------------------------------------- #
# Refusals: the validator's words on every path, nothing written
# --------------------------------------------------------------------------- #
def base_inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return {
        "key": random_cache((3, 2, 8), torch.bfloat16, gen),
        "value": random_cache((3, 1, 8), torch.bfloat16, gen),
        "key_cache": random_cache((4, 4, 2, 8), torch.bfloat16, gen),
        "value_cache": random_cache((4, 4, 1, 8), torch.bfloat16, gen),
        "slot_mapping": torch.tensor([5, -1, 9]),
    }


def refusals() -> dict[str, tuple[dict, type, str]]:
    base = base_inputs()
    pool = torch.zeros(4, 2, 4, 2, 8, dtype=torch.bfloat16)
    return {
        "key dtype": ({"key": base["key"].half()}, TypeError, r"^key must have key_cache's dtype bfloat16, got float16$"),
        "key heads": ({"key": base["key"][:, :1]}, ValueError, r"^key rows must be \[2, 8\] \(heads, head_dim\) for key_cache of shape \[4, 4, 2, 8\], got shape \[3, 1, 8\]$"),
        "value rows": ({"value": base["value"][:2]}, ValueError, r"^value must have T = 3 rows \(key's\), got shape \[2, 1, 8\]$"),
        "key rank": ({"key": base["key"].reshape(3, 16)}, ValueError, r"^key must have rank 3 \(\[T, heads, head_dim\]\), got shape \[3, 16\]$"),
        "key layout": ({"key": base["key"].transpose(1, 2).contiguous().transpose(1, 2)}, ValueError, r"^key must be row-major contiguous within each token"),
        "slot dtype": ({"slot_mapping": torch.tensor([5.0, -1.0, 9.0])}, TypeError, r"^slot_mapping must be int32 or int64, got float32$"),
        "slot count": ({"slot_mapping": torch.tensor([5, 9])}, ValueError, r"^slot_mapping must have T = 3 entries \(key's rows\), got shape \[2\]$"),
        "slot range": ({"slot_mapping": torch.tensor([5, 16, 9])}, ValueError, r"^slot_mapping\[1\] = 16 is outside \[0, 16\) \(num_blocks x block_size of key_cache; a negative slot is padding\)$"),
        "slot twice": ({"slot_mapping": torch.tensor([9, 5, 9])}, ValueError, r"^slot_mapping\[2\] = 9 repeats slot_mapping\[0\]: two tokens cannot write one slot$"),
        "cache dtype": ({"key_cache": base["key_cache"].double(), "key": base["key"].double()}, TypeError, r"^key_cache dtype float64 is not in the contract"),
        "blocks overlap": ({"key_cache": base["key_cache"][:1].expand(4, 4, 2, 8)}, ValueError, r"^key_cache: block stride 0 bytes is less than one block \(128 bytes\)"),
        "caches share bytes": ({"key_cache": pool[:, 0], "value_cache": pool[:, 0, :, :1]}, ValueError, r"^value_cache must be row-major|^key_cache and value_cache share bytes"),
        "same cache twice": ({"key_cache": pool[:, 0], "value_cache": pool[:, 0], "value": base["key"]}, ValueError, r"^key_cache and value_cache share bytes: a scatter would write one into the other$"),
        "key inside the cache": ({"key": "key_cache[0, :3]"}, ValueError, r"^key overlaps key_cache in memory"),
        "not a tensor": ({"slot_mapping": [5, -1, 9]}, TypeError, r"^slot_mapping must be a torch.Tensor, got list$"),
        "cache_mode": ({"cache_mode": "NZ"}, ValueError, r"^cache_mode must be 'Norm' or 'PA_NZ', got 'NZ'$"),
    }


def _ort_refusal(inputs: dict, mode: str, backend: str) -> str | None:
    """The ORT error of a one-node ScatterPaKvCache session, or None when ORT cannot express the call."""
    tensors = graph_feeds(inputs, SCATTER.input_names)
    if tensors is None or mode not in ("Norm", "PA_NZ"):
        return None
    if len({t.data_ptr() for t in tensors[2:4]}) < 2:
        return None  # two graph inputs cannot be one buffer through the Python API
    return plugin_refusal(make_scatter_model_for, SCATTER.input_names, tensors, backend, cache_mode=mode)


@pytest.mark.parametrize("name", list(refusals()))
def test_every_refusal_is_the_validators_on_every_path(name: str) -> None:
    overrides, error, pattern = refusals()[name]
    inputs = base_inputs()
    for key, value in overrides.items():  # a string override is a view of the call's own inputs
        if key != "cache_mode":
            inputs[key] = eval(value, {}, dict(inputs)) if isinstance(value, str) else value  # noqa: S307
    mode = overrides.get("cache_mode", "Norm")
    before = {n: t.clone() for n, t in inputs.items() if isinstance(t, torch.Tensor)}
    with pytest.raises(error, match=pattern) as refused:
        pakv_onnx.plan_scatter(*(inputs[n] for n in SCATTER.input_names), cache_mode=mode)
    message = str(refused.value)
    for backend in BACKENDS:
        with pytest.raises(error) as got:
            pakv_onnx.scatter_pa_kv_cache(*(inputs[n] for n in SCATTER.input_names), cache_mode=mode, backend=backend)
        assert str(got.value) == message, backend
    if all(isinstance(t, torch.Tensor) for t in inputs.values()):
        with pytest.raises(error) as got:
            torch.ops.pakv.scatter_pa_kv_cache(*(inputs[n] for n in SCATTER.input_names), cache_mode=mode)
        assert str(got.value) == message, "torch.ops"
    for backend in ("native", "golden"):
        ort_message = _ort_refusal(inputs, mode, backend)
        if ort_message is not None:
            assert f"{error.__name__}: {message}" in ort_message, f"ORT {backend}: {ort_message}"
    for n, t in before.items():
        assert bitwise_equal(inputs[n], t), f"{n} was written before the refusal"


# --------------------------------------------------------------------------- #
# In place in ORT: which buffer was written shows which route ran
# --------------------------------------------------------------------------- #
def _written_rows_only(before: torch.Tensor, after: torch.Tensor, want: torch.Tensor) -> bool:
    """``after`` is the reference, and every byte the reference leaves alone is still ``before``'s."""
    return bitwise_equal(after, want) and bitwise_equal(torch.where(want == before, after, before), before)


@pytest.mark.parametrize("mode", list(CacheMode))
@pytest.mark.parametrize("backend", ["native", "golden"])
def test_the_in_place_routes_in_ort(mode: CacheMode, backend: str) -> None:
    case = random_scatter_case(21, dtype=torch.float32, value_dtype=torch.float32, cache_mode=mode, num_tokens=6)
    want = reference(case)
    feeds = lambda c: dict(zip(SCATTER.input_names, c.inputs()))  # noqa: E731
    one = runtime_plugin.make_session(make_scatter_model_for(*case.inputs(), cache_mode=mode, fallback=False, opset_version=17), backend=backend)

    # 1. An unbound graph output: the cache is copied to ORT's output, then written there.
    copied = case.fresh()
    out = runtime_plugin.run(one, feeds(copied))
    assert_caches((out["key_cache_out"], out["value_cache_out"]), want, "copy route")
    assert out["key_cache_out"].data_ptr() != copied.key_cache.data_ptr()
    assert_caches((copied.key_cache, copied.value_cache), (case.key_cache, case.value_cache), "copy route's inputs")

    # 2. Bound to the input's buffer (ORT GenAI's way): one buffer, only the T rows written.
    bound = case.fresh()
    out = runtime_plugin.run(one, feeds(bound), out={"key_cache_out": bound.key_cache, "value_cache_out": bound.value_cache})
    assert out["key_cache_out"] is bound.key_cache and out["value_cache_out"] is bound.value_cache
    assert _written_rows_only(case.key_cache, bound.key_cache, want[0])
    assert _written_rows_only(case.value_cache, bound.value_cache, want[1])

    # 3. Feeding a later node (the decoder step's shape): ORT >= 1.18 aliases the updated caches to
    # the input pools (the plugin's alias map), so the graph input itself is written.
    model = make_scatter_model_for(*case.inputs(), cache_mode=mode, then_gather=True, fallback=False, opset_version=17)
    fed = runtime_plugin.make_session(model, backend=backend)
    pools = case.fresh()
    tables = torch.arange(case.key_cache.shape[0], dtype=torch.int64)[None]
    tokens = case.key_cache.shape[0] * case.key_cache.shape[2 if mode is CacheMode.PA_NZ else 1]
    gathered = runtime_plugin.run(fed, {**feeds(pools), "block_tables": tables, "seq_lens": torch.tensor([0, tokens])})
    golden = pakv_onnx.gather_pa_kv_cache(*want, tables, torch.tensor([0, tokens]), cache_mode=mode, backend="golden")
    assert bitwise_equal(gathered["key_all"], golden[0]) and bitwise_equal(gathered["value_all"], golden[1])
    aliased = bitwise_equal(pools.key_cache, want[0])
    assert aliased == (ORT_MINOR >= 18), f"onnxruntime {ort.__version__}: alias route {'taken' if aliased else 'not taken'}"
    if aliased:
        assert _written_rows_only(case.key_cache, pools.key_cache, want[0])


# --------------------------------------------------------------------------- #
# Export and stock ORT
# --------------------------------------------------------------------------- #
class _Step(torch.nn.Module):
    """Write a step's rows, then read every token back through the updated pools (a decode step's shape)."""

    def forward(self, key, value, key_cache, value_cache, slot_mapping, block_tables, seq_lens):
        key_cache, value_cache = torch.ops.pakv.scatter_pa_kv_cache_functional(key, value, key_cache, value_cache, slot_mapping)
        return torch.ops.pakv.gather_pa_kv_cache(key_cache, value_cache, block_tables, seq_lens)


@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_exported_step_runs_in_the_plugin_in_place_and_on_stock_ort(exporter: str) -> None:
    case = random_scatter_case(8, dtype=torch.bfloat16, value_dtype=torch.bfloat16, cache_mode=CacheMode.NORM, num_tokens=4)
    tables = torch.arange(case.key_cache.shape[0], dtype=torch.int64)[None]
    lens = torch.tensor([0, case.key_cache.shape[0] * case.key_cache.shape[1]])
    args = (*case.inputs(), tables, lens)
    want = _Step()(*case.fresh().inputs(), tables, lens)
    step = _Step().eval()  # as a user exports: in eval mode (torch warns otherwise)
    model = pe.export(step, args) if exporter == "dynamo" else pe.export_legacy(step, args)
    assert [n.op_type for n in model.graph.node if n.domain == "pakv"] == ["ScatterPaKvCache", "GatherPaKvCache"]
    names = [i.name for i in model.graph.input]
    pools = case.fresh()
    out = runtime_plugin.run(runtime_plugin.make_session(model), dict(zip(names, (*pools.inputs(), tables, lens))))
    assert bitwise_equal(out[model.graph.output[0].name], want[0]) and bitwise_equal(out[model.graph.output[1].name], want[1])
    assert bitwise_equal(pools.key_cache, reference(case)[0]) == (ORT_MINOR >= 18)  # written in place
    stock = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out = runtime_plugin.run(stock, dict(zip(names, (*case.fresh().inputs(), tables, lens))))
    assert bitwise_equal(out[model.graph.output[0].name], want[0]) and bitwise_equal(out[model.graph.output[1].name], want[1])


# Cache dtypes stock ORT's ScatterND / Gather / Transpose have CPU kernels for (float8 has none).
STOCK_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16, torch.int32]


@pytest.mark.parametrize("mode", list(CacheMode))
@pytest.mark.parametrize("dtype", STOCK_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_the_fallback_function_on_stock_ort(mode: CacheMode, dtype: torch.dtype) -> None:
    case = random_scatter_case(13, dtype=dtype, value_dtype=dtype, cache_mode=mode, num_tokens=7)
    session = ort.InferenceSession(
        make_scatter_model_for(*case.inputs(), cache_mode=mode).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    out = runtime_plugin.run(session, dict(zip(SCATTER.input_names, case.fresh().inputs())))
    assert_caches((out["key_cache_out"], out["value_cache_out"]), reference(case), f"stock {dtype}")


@pytest.mark.parametrize(
    "slots, rule",
    [([5, 5, 9], "none twice"), ([5, 999, 9], "every slot below"), ([5, 9], "value and slot_mapping must have key's T")],
)
def test_the_fallback_refuses_what_the_contract_refuses(slots: list[int], rule: str) -> None:
    inputs = base_inputs()
    session = ort.InferenceSession(make_scatter_model_for(*inputs.values()).SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(ORT_ERRORS, match=re.escape(rule)):
        runtime_plugin.run(session, {**inputs, "slot_mapping": torch.tensor(slots)})


def test_ort_parallel_execution_takes_the_copy_route() -> None:
    """ORT_PARALLEL disables the planner's aliasing: the updated caches are copies, still exact."""
    case = random_scatter_case(22, dtype=torch.float32, value_dtype=torch.float32, cache_mode=CacheMode.NORM, num_tokens=5)
    model = make_scatter_model_for(*case.inputs(), then_gather=True, fallback=False, opset_version=17)
    options = ort.SessionOptions()
    options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    session = runtime_plugin.make_session(model, sess_options=options)
    pools = case.fresh()
    tokens = case.key_cache.shape[0] * case.key_cache.shape[1]
    tables = torch.arange(case.key_cache.shape[0], dtype=torch.int64)[None]
    out = runtime_plugin.run(
        session, {**dict(zip(SCATTER.input_names, pools.inputs())), "block_tables": tables, "seq_lens": torch.tensor([0, tokens])}
    )
    want = reference(case)
    golden = pakv_onnx.gather_pa_kv_cache(*want, tables, torch.tensor([0, tokens]), backend="golden")
    assert bitwise_equal(out["key_all"], golden[0]) and bitwise_equal(out["value_all"], golden[1])
    assert_caches((pools.key_cache, pools.value_cache), (case.key_cache, case.value_cache), "ORT_PARALLEL inputs")
