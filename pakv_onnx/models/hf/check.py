"""Generate with every runner and compare with transformers: what ``pakv-onnx generate`` runs.

One model step is exported once per (arch, block size, attention form); each runner is an ONNX
Runtime session over that file driving :func:`~pakv_onnx.models.hf.generate.generate_paged`: in the
``ort`` form (each layer one ``com.microsoft::PagedAttention``) ``plugin:native`` (the library's C
kernel; stock ORT has no CPU kernel for the op), in the ``pakv`` form ``plugin:<backend>`` with the
custom-op library for each backend and ``stock-ort`` through the graph's fallback functions. Each
runner's tokens must equal transformers' greedy ``generate`` on the same weights and prompts, and its
logits must be within :data:`LOGIT_ATOL`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from pakv_onnx import kernels, runtime_plugin
from pakv_onnx.models.hf import generate, mla
from pakv_onnx.models.hf.cache import PagedKVCache
from pakv_onnx.models.hf.configs import build_model, cache_geometry
from pakv_onnx.models.hf.step import ORT, PagedDecoderStep, export_step
from pakv_onnx.plans import GatherPlan
from pakv_onnx.validator import plan_gather

# fp32 everywhere; the paged path and transformers' dense eager path differ only in summation
# order (measured up to ~1e-6 on these models).
LOGIT_ATOL = 1e-4
# The bound per --precision: teacher-forced logits against float32 transformers (fp16 and bf16 measured
# 2026-12-04 on the sample models: <= 0.001 and <= 0.0045), and the reference's top-2 gap under which a
# flip of the argmax counts as a near tie.
PRECISION_LOGIT_ATOL = {"fp32": LOGIT_ATOL, "fp16": 0.005, "bf16": 0.02}
NEAR_TIE = 0.005
STOCK_ORT = "stock-ort"
PYPTO_CPU = "pypto-cpu"
# pypto-cpu compiles and interprets the kernel on every call (1-5 s each on the 2-core machine): run it only
# when the whole generation makes at most this many gather calls (steps x layers).
PYPTO_CPU_MAX_CALLS = 12
# What a backend needs to run a pakv op of a step's graph: Backend's attribute for that op's kernel.
KERNEL_OF_OP = {"ScatterPaKvCache": "scatter", "PagedAttention": "attention", "GatherPaKvCache": "gather"}


@dataclasses.dataclass(frozen=True)
class RunnerResult:
    """One runner's generation compared with transformers."""

    runner: str
    tokens_match: bool
    max_logit_err: float
    ms_per_token: float
    steps: int = 0
    error: str | None = None
    precision: str = "fp32"
    # fp16 / bf16: where the teacher-forced argmax flips (generate.Flip), and whether the greedy tokens
    # equal the reference's up to each sequence's first flip.
    flips: tuple = ()
    agree_to_flips: bool = False

    @property
    def passed(self) -> bool:
        if self.error is not None or self.max_logit_err > PRECISION_LOGIT_ATOL[self.precision]:
            return False
        if self.tokens_match:
            return True
        return self.precision != "fp32" and self.agree_to_flips and all(f.top2_gap <= NEAR_TIE for f in self.flips)


@dataclasses.dataclass(frozen=True)
class CheckReport:
    attention: str  # the step's form: "ort", "fused" or "gather" (PagedDecoderStep.attention)
    arch: str
    workload: generate.Workload
    block_size: int
    reference_ms_per_token: float
    results: list[RunnerResult]
    skipped: dict[str, str]

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)


def gather_calls(workload: generate.Workload, num_layers: int, *, per_sequence: bool = False) -> int:
    """Gather calls a generation makes: one per layer per step (steps = the longest budget), or with
    ``per_sequence`` (a step that gathers each sequence's rows itself: :func:`mla.gathers_per_sequence`)
    one per layer per live sequence per step, i.e. per generated token."""
    return (workload.generated_tokens if per_sequence else max(workload.budgets)) * num_layers


def probe_plan(config, block_size: int) -> tuple[GatherPlan, torch.Tensor]:
    """A one-token plan over pools shaped like ``config``'s (fp32), to ask a backend whether it can run them."""
    geometry = cache_geometry(config)
    key = torch.zeros(1, block_size, *geometry.key_shape)
    value = torch.zeros(1, block_size, *geometry.value_shape)
    one = torch.tensor([0, 1], dtype=torch.int32)
    return plan_gather(key, value, torch.zeros(1, 1, dtype=torch.int32), one, torch.zeros(1, dtype=torch.int32)), key


def pakv_ops(path: Path) -> set[str]:
    """The ``pakv`` ops of the ONNX graph at ``path``, Loop bodies included."""
    import onnx

    found: set[str] = set()

    def walk(graph) -> None:
        for node in graph.node:
            if node.domain == "pakv":
                found.add(node.op_type)
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    walk(attribute.g)

    walk(onnx.load(str(path), load_external_data=False).graph)
    return found


def pypto_cpu_refusal(probe: tuple[GatherPlan, torch.Tensor] | None = None, ops: Sequence[str] = ()) -> str | None:
    """Why ``plugin:pypto-cpu`` cannot join a run here (``None``: it can): the backend is unavailable,
    has no kernel for one of ``ops`` (the graph's pakv ops), or refuses ``probe`` (a plan and key
    cache like the run's; its refusals include memory). Shared with :mod:`pakv_onnx.demo`, which adds
    the same row."""
    backend = kernels.get_backend(PYPTO_CPU)
    missing = [op for op in sorted(ops) if getattr(backend, KERNEL_OF_OP.get(op, "gather"), None) is None]
    if missing:
        return f"it has no {missing[0]} kernel, and this model's step runs {missing[0]}"
    return backend.unavailable_reason() or (backend.unsupported_reason(*probe) if probe else None)


def runner_names(
    backends: Sequence[str],
    workload: generate.Workload,
    num_layers: int,
    probe: tuple[GatherPlan, torch.Tensor] | None = None,
    *,
    per_sequence: bool = False,
    ops: Sequence[str] = (),
    add_pypto_cpu: bool = True,
) -> tuple[list[str], dict[str, str]]:
    """The runners to use (``plugin:<b>`` for each backend, ``stock-ort``, and ``plugin:pypto-cpu``
    when that backend is registered, has a kernel for each of ``ops`` (the step graph's pakv ops),
    can run ``probe`` (a plan and key pool like the model's) and the case is small:
    :func:`gather_calls`, ``per_sequence`` as there; the same count of PagedAttention calls for a
    step that attends with it; never without ``add_pypto_cpu``) and the ones skipped, with why."""
    names = [f"plugin:{b}" for b in backends]
    skipped: dict[str, str] = {}
    if add_pypto_cpu and PYPTO_CPU in kernels.backend_names() and PYPTO_CPU not in backends:
        calls = gather_calls(workload, num_layers, per_sequence=per_sequence)
        reason = pypto_cpu_refusal(probe, ops)
        if reason is not None:
            skipped[f"plugin:{PYPTO_CPU}"] = reason
        elif calls > PYPTO_CPU_MAX_CALLS:
            counted = "steps x live sequences x layers" if per_sequence else "steps x layers"
            what = "PagedAttention" if "PagedAttention" in ops else "gather"
            skipped[f"plugin:{PYPTO_CPU}"] = (
                f"{calls} {what} calls at seconds each (runs when {counted} <= {PYPTO_CPU_MAX_CALLS})"
            )
        else:
            names.append(f"plugin:{PYPTO_CPU}")
    names.append(STOCK_ORT)
    return names, skipped


def ort_runner_names(backends: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The runners of a step in the ``ort`` form: ``plugin:native`` only, the others skipped with why
    (com.microsoft::PagedAttention always runs the library's C kernel; stock ORT has none on a CPU)."""
    skipped = {
        f"plugin:{b}": "com.microsoft::PagedAttention runs the library's C kernel whatever the backend "
        "(backends serve the pakv ops: --attention pakv)"
        for b in backends
        if b != "native"
    }
    skipped[STOCK_ORT] = "stock ORT has no CPU kernel for com.microsoft::PagedAttention (--attention pakv runs there)"
    return ["plugin:native"], skipped


def make_runner_session(runner: str, path: Path, intra_op_threads: int = 0):
    """An ORT session for ``runner`` over the exported step at ``path``.

    ORT's worker threads do not spin between runs: a generation loop does host work between
    steps, and spinning threads would take those cores from it (and from torch).
    ``intra_op_threads`` 0 lets ORT choose.
    """
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.intra_op_num_threads = intra_op_threads
    if runner == STOCK_ORT:
        return onnxruntime.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
    return runtime_plugin.make_session(path, backend=runner.removeprefix("plugin:"), sess_options=options)


session_step = generate.session_step  # (kept here for callers of check.session_step)


def step_cache(step: PagedDecoderStep, workload: generate.Workload, block_size: int, seed: int) -> PagedKVCache:
    """Fresh pools for ``workload`` as ``step`` reads them (its geometry and element type)."""
    return generate.new_cache(
        step.model.config, workload, block_size, seed, geometry=step.geometry(), dtype=step.pool_dtype
    )


def export_for(
    arch: str,
    seed: int,
    workload: generate.Workload,
    block_size: int,
    path: Path,
    *,
    attention: str | None = None,
    kv_quant=None,
    precision: str = "fp32",
) -> PagedDecoderStep:
    """Build the paged model of ``arch`` (``attention``, ``kv_quant``, ``precision``: :class:`PagedDecoderStep`'s)
    and export its step (traced on the workload's prefill) to ``path``; returns the step module."""
    step = PagedDecoderStep(build_model(arch, seed), attention=attention, kv_quant=kv_quant, precision=precision)
    cache = step_cache(step, workload, block_size, seed)
    ids = list(range(len(workload.prompts)))
    for i in ids:
        cache.add_sequence(i)
    _, _, feeds = generate.step_inputs(cache, ids, workload.prompts)
    export_step(step, feeds, path)
    return step


def run_runner(
    runner: str,
    path: Path,
    config,
    workload: generate.Workload,
    block_size: int,
    seed: int,
    reference: generate.Generation,
    *,
    step: PagedDecoderStep | None = None,
) -> RunnerResult:
    """Generate ``workload`` on ``runner`` and compare with ``reference``; an exception is a FAIL row.
    ``step``: the exported step module, whose pools the graph reads (default: the pakv form's, fp32). A
    fp16 / bf16 step is also run teacher-forced on the reference's tokens (:func:`generate.teacher_forced`):
    its logits error is that run's, and greedy tokens may part from the reference's at near ties."""
    precision = step.precision.name if step is not None else "fp32"

    def fresh_cache() -> PagedKVCache:
        if step is not None:
            return step_cache(step, workload, block_size, seed)
        return generate.new_cache(config, workload, block_size, seed)

    try:
        run = session_step(make_runner_session(runner, path))
        result = generate.generate_paged(run, fresh_cache(), workload)
        forced = None if precision == "fp32" else generate.teacher_forced(run, fresh_cache(), workload.prompts,
                                                                           reference.tokens)  # fmt: skip
    except Exception as err:  # a failing runner is a FAIL row, not a crash of the command
        return RunnerResult(runner, False, float("inf"), float("nan"), error=f"{type(err).__name__}: {err}")
    same, err = generate.compare(result, reference)
    ms = result.seconds * 1e3 / workload.generated_tokens
    if forced is None:
        return RunnerResult(runner, same, err, ms, result.steps)
    err, flipped = generate.flips(forced, reference)
    first = {}
    for flip in flipped:
        first.setdefault(flip.sequence, flip.position)
    agree = all(mine[: first.get(i, len(ref))] == ref[: first.get(i, len(ref))]
                for i, (mine, ref) in enumerate(zip(result.tokens, reference.tokens)))  # fmt: skip
    return RunnerResult(runner, same, err, ms, result.steps, precision=precision, flips=tuple(flipped),
                        agree_to_flips=agree)  # fmt: skip


def run_check(
    *,
    arch: str,
    batch: int,
    new_tokens: int,
    block_size: int,
    seed: int,
    backends: Sequence[str],
    out_dir: Path,
    attention: str | None = None,
    progress: Callable[[str], None] = lambda message: None,
    add_pypto_cpu: bool = True,
    precision: str = "fp32",
) -> CheckReport:
    """Export ``arch``'s step (``attention``: :class:`PagedDecoderStep`'s; default ``ort``) into
    ``out_dir``, generate on every runner, compare with transformers. ``add_pypto_cpu``:
    :func:`runner_names`'s (``pakv-onnx generate`` without ``--backend``; the ``pakv`` form only)."""
    reference_model = build_model(arch, seed)
    config = reference_model.config
    workload = generate.make_workload(batch=batch, new_tokens=new_tokens, vocab_size=config.vocab_size, seed=seed)
    progress(f"{arch}: transformers generate (dense cache) for {batch} prompts ...")
    reference = generate.generate_reference(reference_model, workload)
    path = out_dir / f"{arch}_step_bs{block_size}{'' if precision == 'fp32' else '_' + precision}.onnx"
    progress(f"{arch}: exporting one step to {path} ...")
    start = time.perf_counter()
    step = export_for(arch, seed, workload, block_size, path, attention=attention, precision=precision)
    progress(f"{arch}: exported in {time.perf_counter() - start:.1f}s ({step.attention} attention)")
    if step.attention == ORT:
        names, skipped = ort_runner_names(backends)
    else:
        names, skipped = runner_names(
            backends,
            workload,
            config.num_hidden_layers,
            probe_plan(config, block_size),
            per_sequence=mla.gathers_per_sequence(config),
            ops=pakv_ops(path),
            add_pypto_cpu=add_pypto_cpu,
        )
    for runner, why in skipped.items():
        progress(f"{arch}: {runner} skipped: {why}")
    results = []
    for runner in names:
        progress(f"{arch}: generating on {runner} ...")
        results.append(run_runner(runner, path, config, workload, block_size, seed, reference, step=step))
    return CheckReport(
        attention=step.attention,
        arch=arch,
        workload=workload,
        block_size=block_size,
        reference_ms_per_token=reference.seconds * 1e3 / workload.generated_tokens,
        results=results,
        skipped=skipped,
    )


ATTENTION_LABELS = {
    "ort": "attention: com.microsoft::PagedAttention",
    "fused": "attention: pakv ScatterPaKvCache + PagedAttention",
    "gather": "attention: pakv ScatterPaKvCache + GatherPaKvCache",
}


def format_table(report: CheckReport) -> str:
    """Plain-text table: runner, tokens identical, max logit error, ms per generated token, verdict."""
    w = report.workload
    lines = [
        f"{report.arch}: batch {len(w.prompts)}, prompt lengths {[len(p) for p in w.prompts]}, "
        f"new tokens {w.budgets}, block size {report.block_size}, {ATTENTION_LABELS[report.attention]}",
        f"  {'runner':<18} {'tokens':<7} {'max logit err':>13} {'ms/token':>9} {'steps':>6}  result",
        f"  {'transformers':<18} {'(ref)':<7} {'':>13} {report.reference_ms_per_token:>9.3f} {'':>6}"
        "  (generate(), one prompt at a time)",
    ]
    for r in report.results:
        lines.append(
            f"  {r.runner:<18} {'same' if r.tokens_match else 'DIFF':<7} {r.max_logit_err:>13.3g} "
            f"{r.ms_per_token:>9.3f} {r.steps:>6}  {'PASS' if r.passed else 'FAIL'}"
        )
        if r.error:
            lines.append(f"    error: {r.error}")
        for flip in r.flips:
            lines.append(f"    {r.precision}: sequence {flip.sequence} flips at token {flip.position} (float32's top-2 gap "
                         f"{flip.top2_gap:.2g}, logits within {flip.logit_diff:.2g} there)")  # fmt: skip
    for runner, why in report.skipped.items():
        lines.append(f"  {runner:<18} skipped: {why}")
    return "\n".join(lines)


def json_entry(result: RunnerResult) -> dict:
    """``{"tokens_match", "max_logit_err", "ms_per_token"}``; non-finite numbers (a runner that
    raised) become ``null`` so the output stays strict JSON."""

    def finite(x: float) -> float | None:
        return x if x == x and abs(x) != float("inf") else None

    return {
        "tokens_match": result.tokens_match,
        "max_logit_err": finite(result.max_logit_err),
        "ms_per_token": finite(result.ms_per_token),
    }
