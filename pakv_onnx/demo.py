"""The end-to-end demo: export each sample model, run its ONNX graph every way, compare.

For every sample graph: build the model and a random paged batch (shuffled block ids, ragged
lengths, non-zero ``seq_offset``), laid out as one step that writes the last tokens of every
sequence (ScatterPaKvCache) before it reads past + new back (GatherPaKvCache), export it with the
project's exporter, then run the graph in ONNX Runtime with the plugin (each requested backend)
and on stock ORT through the fallback function bodies, and compare each run's outputs with the
model's torch reference forward (the golden gather of the whole batch + fp32 attention):
gathered key/value bit-exact, attention output within :data:`ATTENTION_ATOL`. Every runner
starts from fresh caches with the step's rows missing, so a write that does not happen fails.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import onnxruntime
import torch

from pakv_onnx import runtime_plugin
from pakv_onnx.models import GqaPagedAttention, MlaContextAttention, PagedAttentionModel
from pakv_onnx.models.batch import ragged_lengths
from pakv_onnx.models.hf.check import PYPTO_CPU, pakv_ops, pypto_cpu_refusal
from pakv_onnx.models.paged_model import MODEL_INPUT_NAMES, MODEL_OUTPUT_NAMES
from pakv_onnx.spec import bitwise_equal
from pakv_onnx.validator import plan_gather

# fp32 attention in ORT vs torch differs only by summation order: about 1e-6 at these sizes.
ATTENTION_ATOL = 1e-4
STOCK_ORT = "stock-ort"


@dataclasses.dataclass(frozen=True)
class SampleGraph:
    """One sample model configuration the demo exports and runs."""

    name: str
    description: str
    build: Callable[[int], PagedAttentionModel]
    num_seqs: int


SAMPLE_GRAPHS: dict[str, SampleGraph] = {
    "mla": SampleGraph(
        "mla",
        "DeepSeek-style MLA context attention, latent 512 + rope 64, block 128",
        lambda seed: MlaContextAttention(seed=seed),
        num_seqs=4,
    ),
    "gqa": SampleGraph(
        "gqa",
        "GQA 32 query / 8 KV heads x 128, block 16",
        lambda seed: GqaPagedAttention(block_size=16, seed=seed),
        num_seqs=5,
    ),
    "gqa-bs128": SampleGraph(
        "gqa-bs128",
        "GQA 32 query / 8 KV heads x 128, block 128",
        lambda seed: GqaPagedAttention(block_size=128, seed=seed),
        num_seqs=3,
    ),
}
MODEL_CHOICES = {"mla": ("mla",), "gqa": ("gqa", "gqa-bs128"), "all": tuple(SAMPLE_GRAPHS)}


# Peak resident bytes per (head x L x L) fp32 score of the longest sequence L: attention runs one
# sequence at a time (an ONNX Loop), keeping a few [H, L, L] intermediates alive in torch and in
# each ORT session. (Measured when attention was dense over the packed batch, L = T: 6.8 GB for
# GQA, 32 heads, T = 2048; per sequence, one ORT run of GQA at T = 1024 in 5 sequences, longest
# 448, went from +493 MB to +181 MB.)
PEAK_BYTES_PER_SCORE = 13 * 4


def estimated_peak_bytes(graph_names: Sequence[str], num_tokens: int, seed: int = 0) -> int:
    """Rough peak memory of the demo for these graphs at ``num_tokens`` (dominated by attention over
    the longest sequence of the random batch that ``seed`` draws)."""
    peak = 0
    for name in graph_names:
        graph = SAMPLE_GRAPHS[name]
        longest = max(ragged_lengths(num_tokens, graph.num_seqs, random.Random(seed)))
        peak = max(peak, PEAK_BYTES_PER_SCORE * graph.build(0).num_heads * longest * longest)
    return peak


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One way of running one graph, compared with the torch reference."""

    runner: str
    key_exact: bool
    value_exact: bool
    max_abs_error: float
    latency_ms: float
    error: str | None = None
    skipped: str | None = None  # why a runner the demo added on its own did not run (it fails nothing)

    @property
    def passed(self) -> bool:
        if self.skipped is not None:
            return True
        return self.error is None and self.key_exact and self.value_exact and self.max_abs_error <= ATTENTION_ATOL


def _timed_runs(run: Callable[[], dict[str, torch.Tensor]], repeats: int) -> tuple[dict[str, torch.Tensor], float]:
    outputs = run()  # warm-up (first-run allocations), also the outputs we check
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return outputs, statistics.median(times) * 1e3 if times else float("nan")


def compare(
    runner: str, outputs: dict[str, torch.Tensor], reference: Sequence[torch.Tensor], latency_ms: float
) -> RunResult:
    """Check one run's outputs against the reference ``(output, key, value)``."""
    ref_out, ref_key, ref_value = reference
    return RunResult(
        runner=runner,
        key_exact=bitwise_equal(outputs["key"], ref_key),
        value_exact=bitwise_equal(outputs["value"], ref_value),
        max_abs_error=float((outputs["output"] - ref_out).abs().max()) if ref_out.numel() else 0.0,
        latency_ms=latency_ms,
    )


def run_graph(
    graph: SampleGraph,
    *,
    out_dir: Path,
    backends: Sequence[str],
    num_tokens: int,
    seed: int,
    repeats: int,
    progress: Callable[[str], None],
    on_data: Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], None] | None = None,
    add_pypto_cpu: bool = False,
) -> list[RunResult]:
    """Export ``graph`` into ``out_dir`` and run it every requested way; one result per way.

    ``on_data(inputs, expected)``, if given, receives the graph's input feeds and the torch
    reference outputs by graph name (``pakv-onnx demo --out`` saves them next to the model).
    ``add_pypto_cpu``: also run ``plugin:pypto-cpu`` where pypto is installed (a skipped row, with
    why, where it refuses the graph); the demo's default, not when the caller names the backends.
    """
    model = graph.build(seed).eval()
    batch = model.random_batch(num_tokens, graph.num_seqs, seed)
    hidden = model.random_hidden_states(num_tokens, seed)

    def fresh_inputs() -> tuple[torch.Tensor, ...]:  # the step's rows not yet in the caches
        return (hidden, *batch.step_inputs())

    inputs = fresh_inputs()
    reference = model.reference_forward(hidden, batch)

    path = out_dir / f"{graph.name}.onnx"
    progress(f"exporting {graph.name} to {path} ...")
    start = time.perf_counter()
    model.export_onnx(inputs, path)
    progress(f"exported {graph.name} in {time.perf_counter() - start:.1f}s")
    if on_data is not None:
        on_data(dict(zip(MODEL_INPUT_NAMES, fresh_inputs())), dict(zip(MODEL_OUTPUT_NAMES, reference)))

    with torch.no_grad():
        eager_outputs, eager_ms = _timed_runs(lambda: dict(zip(MODEL_OUTPUT_NAMES, model(*inputs))), repeats)
    results = [compare("torch eager", eager_outputs, reference, eager_ms)]
    # With add_pypto_cpu, plugin:pypto-cpu joins every graph where pypto can run (listed as skipped,
    # with why, for a graph it refuses; left out altogether where pypto is not installed).
    names, skipped = list(backends), []
    if add_pypto_cpu and PYPTO_CPU not in backends and pypto_cpu_refusal() is None:
        plan = plan_gather(*batch.gather_inputs(), cache_mode="Norm", is_seq_lens_cumsum=True)  # as forward calls it
        refusal = pypto_cpu_refusal((plan, batch.key_cache), pakv_ops(path))
        if refusal is None:
            names.append(PYPTO_CPU)
        else:
            skipped.append(RunResult(f"plugin:{PYPTO_CPU}", False, False, float("nan"), float("nan"), skipped=refusal))
    sessions = [
        (
            f"plugin:{name}",
            lambda name=name: runtime_plugin.make_session(path, backend=name),
            1 if name == PYPTO_CPU else repeats,  # seconds per call: one timed run
        )
        for name in names
    ]
    sessions.append(
        (STOCK_ORT, lambda: onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]), repeats)
    )
    for runner, make, timed_runs in sessions:
        progress(f"running {graph.name} on {runner} ...")
        try:
            session = make()
            feeds = dict(zip(MODEL_INPUT_NAMES, fresh_inputs()))
            outputs, ms = _timed_runs(lambda feeds=feeds: runtime_plugin.run(session, feeds), timed_runs)
            results.append(compare(runner, outputs, reference, ms))
        except Exception as err:  # a failing runner is a FAIL row, not a crash of the demo
            results.append(
                RunResult(runner, False, False, float("inf"), float("nan"), error=f"{type(err).__name__}: {err}")
            )
    return results + skipped


def format_table(graph: SampleGraph, num_tokens: int, results: Sequence[RunResult]) -> str:
    """A plain-text table: runner, gathered K/V bit-exact, max abs error, latency."""
    lines = [
        f"{graph.name}: {graph.description}; T={num_tokens}, Q={graph.num_seqs}",
        f"  {'runner':<16} {'K exact':<8} {'V exact':<8} {'max abs err':>12} {'ms/run':>9}  result",
    ]
    for r in results:
        if r.skipped is not None:
            lines.append(f"  {r.runner:<16} skipped: {r.skipped}")
            continue
        verdict = "PASS" if r.passed else "FAIL"
        lines.append(
            f"  {r.runner:<16} {'yes' if r.key_exact else 'no':<8} {'yes' if r.value_exact else 'no':<8} "
            f"{r.max_abs_error:>12.3g} {r.latency_ms:>9.3f}  {verdict}"
        )
        if r.error:
            lines.append(f"    error: {r.error}")
    return "\n".join(lines)
