"""Thread safety: ORT_PARALLEL with several plugin nodes, and 8 Python threads sharing one session,
for the native kernel and a Python backend; every result bit-exact."""

from __future__ import annotations

import threading

import onnxruntime as ort
import pytest
import torch
from onnx_graphs import feeds_for_case, model_for_case, plugin_model_for

from pakv_onnx import runtime_plugin
from pakv_onnx.cases import random_case
from pakv_onnx.spec import INPUT_NAMES, OUTPUT_NAMES, CacheMode, bitwise_equal

NODES = 4


def _parallel_options() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    options.inter_op_num_threads = NODES
    options.intra_op_num_threads = 1
    return options


@pytest.mark.parametrize("backend", ["native", "golden"])
def test_ort_parallel_several_nodes_and_eight_python_threads(backend: str) -> None:
    # Same dtypes/attributes for every node (one model), different data per node.
    cases = [
        random_case(
            300 + i,
            dtype=torch.bfloat16,
            cache_mode=CacheMode.PA_NZ,
            is_seq_lens_cumsum=False,
            index_dtypes=(torch.int32, torch.int64, torch.int32),
            with_seq_offset=True,
        )
        for i in range(NODES)
    ]
    model = model_for_case(cases[0], num_nodes=NODES)
    session = runtime_plugin.make_session(model, backend=backend, sess_options=_parallel_options())
    feeds = {}
    for i, case in enumerate(cases):
        feeds.update(feeds_for_case(case, suffix=f"_{i}"))
    expected = {
        f"{name}_{i}": out for i, case in enumerate(cases) for name, out in zip(OUTPUT_NAMES, case.golden())
    }
    failures: list[str] = []
    runs_per_thread = 40 if backend == "native" else 15

    def worker(thread: int) -> None:
        try:
            for _ in range(runs_per_thread):
                outputs = runtime_plugin.run(session, feeds)
                for name, want in expected.items():
                    if not bitwise_equal(outputs[name], want):
                        failures.append(f"thread {thread}: {name} differs")
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(f"thread {thread}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_large_copies_take_the_threaded_path_bit_exact(monkeypatch) -> None:
    """Above the size threshold the native kernel splits the rows over threads; same bytes."""
    from pakv_onnx import gather_pa_kv_cache

    # 256 blocks of 16 tokens x 8 heads x 128 bf16 = 8 MiB per output: above the 4 MiB threshold.
    nb, bs = 256, 16
    gen = torch.Generator().manual_seed(5)
    key_cache = torch.randn(nb, bs, 8, 128, generator=gen).to(torch.bfloat16)
    value_cache = torch.randn(nb, bs, 8, 128, generator=gen).to(torch.bfloat16)
    block_tables = torch.randint(0, nb, (4, 100), generator=gen, dtype=torch.int32)
    seq_lens = torch.tensor([0, 1000, 1001, 2500, 4000], dtype=torch.int32)
    args = (key_cache, value_cache, block_tables, seq_lens)
    golden = gather_pa_kv_cache(*args, backend="torch")
    native = gather_pa_kv_cache(*args, backend="native")
    assert all(bitwise_equal(a, b) for a, b in zip(golden, native))
    case_session = runtime_plugin.make_session(plugin_model_for(*args))
    out = runtime_plugin.run(case_session, dict(zip(INPUT_NAMES, args)))
    assert bitwise_equal(out["key"], golden[0]) and bitwise_equal(out["value"], golden[1])
