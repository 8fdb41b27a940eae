"""transformers decoders over a paged cache in the ``pakv`` form (ScatterPaKvCache, then
pakv::PagedAttention or GatherPaKvCache per layer), exported and generating in ONNX Runtime on every
runner (plugin backends, stock ORT through the fallback functions). The ``ort`` form (each layer one
com.microsoft::PagedAttention, the default) is tested in tests/test_hf_ort_step.py.

Tests that use the ``exported`` fixture are marked slow: the step export of each arch takes
20-110 s on the shared machine (they run in the default suite).

Every runner's greedy tokens must equal transformers' own ``generate`` (dense cache) on the same
weights and prompts; the exported step has one GatherPaKvCache per layer; a wrong backend fails.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import onnx
import pytest
import torch
from conftest import perturbed_norms
from onnx_graphs import pakv_nodes

from pakv_onnx import cli, kernels
from pakv_onnx.models.hf import (
    Generation,
    PagedDecoderStep,
    build_model,
    check,
    compare,
    export_step,
    generate_paged,
    generate_reference,
    make_workload,
    new_cache,
    run_step_torch,
    session_step,
    step_inputs,
)

SEED = 0
PAKV = "pakv"
BLOCK_SIZE = 8  # small blocks: every prompt spans several, tables are long
RUNNERS = ("plugin:native", "plugin:golden", "plugin:torch", check.STOCK_ORT)


@pytest.fixture(scope="module", params=["llama", "deepseek"])
def exported(request, tmp_path_factory) -> tuple:
    """(arch, onnx path, workload, transformers reference) with the step exported once per arch."""
    arch = request.param
    reference_model = build_model(arch, SEED)
    workload = make_workload(batch=4, new_tokens=10, vocab_size=reference_model.config.vocab_size, seed=5)
    path = Path(tmp_path_factory.mktemp("hf")) / f"{arch}.onnx"
    check.export_for(arch, SEED, workload, BLOCK_SIZE, path, attention=PAKV)
    return arch, path, workload, generate_reference(reference_model, workload)


def test_workload_has_ragged_prompts_and_staggered_ends() -> None:
    workload = make_workload(batch=4, new_tokens=10, vocab_size=256, seed=5)
    assert len({len(p) for p in workload.prompts}) == 4
    assert len(set(workload.budgets)) > 1 and max(workload.budgets) == 10


@pytest.mark.slow  # shares the module's exports (20-110 s each on a busy machine)
def test_export_writes_then_reads_every_layer_inside_the_graph(exported) -> None:
    arch, path, _, _ = exported
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    layers = build_model(arch, SEED).config.num_hidden_layers
    pakv = pakv_nodes(model.graph)  # DeepSeek-V3 gathers each sequence's latent inside its attention Loop
    mla = arch == "deepseek"  # Llama (GQA) attends with one PagedAttention per layer over the pools
    reader = "GatherPaKvCache" if mla else "PagedAttention"
    assert [n.op_type for n in pakv] == ["ScatterPaKvCache", reader] * layers
    assert check.pakv_ops(path) == {"ScatterPaKvCache", reader}  # what decides whether pypto-cpu can join
    outputs = [o.name for o in model.graph.output]
    for layer, (scatter, read) in enumerate(zip(pakv[::2], pakv[1::2])):
        # the layer's pools in, the updated pools are the present outputs and feed the read
        assert list(scatter.input[2:4]) == [f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"]
        assert list(scatter.output) == [f"present.{layer}.key", f"present.{layer}.value"]
        assert list(read.input[:2] if mla else read.input[1:3]) == list(scatter.output)
    assert [i.name for i in model.graph.input][:4] == [
        "input_ids",
        "cumulative_sequence_lengths",
        "past_sequence_lengths",
        "block_table",
    ]
    types = {i.name: i.type.tensor_type for i in model.graph.input}
    assert [
        types[n].elem_type for n in ("input_ids", "cumulative_sequence_lengths", "past_sequence_lengths", "block_table")
    ] == [onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.INT32, onnx.TensorProto.INT32]
    assert len(types["input_ids"].shape.dim) == 1  # packed tokens [num_tokens]
    assert outputs[0] == "logits" and model.graph.output[0].type.tensor_type.shape.dim[0].dim_param == "batch_size"
    # Per-sequence attention: a Loop per layer for MLA (PagedAttention walks the sequences itself),
    # never a [T, T] mask over the packed batch.
    assert sum(n.op_type == "Loop" for n in model.graph.node) == (layers if mla else 0)


@pytest.mark.slow  # shares the module's exports (20-110 s each on a busy machine)
def test_plugin_writes_the_callers_pools_in_place(exported) -> None:
    """The present outputs bound to the input pools: every step's outputs are the cache's own pool
    tensors (never a copy), and each step changed exactly its new tokens' slots."""
    arch, path, workload, _ = exported
    config = build_model(arch, SEED).config
    session = check.make_runner_session("plugin:native", path)
    cache = new_cache(config, workload, BLOCK_SIZE, SEED)
    pools = [*cache.key_pools, *cache.value_pools]
    ids = list(range(len(workload.prompts)))
    for i in ids:
        cache.add_sequence(i)
    step = session_step(session)
    pending = [list(p) for p in workload.prompts]
    for _ in range(3):
        before = [p.clone() for p in pools]
        counts, layout, feeds = step_inputs(cache, ids, pending)
        outputs = step(feeds)
        for layer in range(config.num_hidden_layers):
            assert outputs[f"present.{layer}.key"] is cache.key_pools[layer]
            assert outputs[f"present.{layer}.value"] is cache.value_pools[layer]
        for pool, old in zip(pools, before):
            flat, flat_old = pool.view(-1, *pool.shape[2:]), old.view(-1, *old.shape[2:])
            changed = (flat != flat_old).flatten(1).any(dim=1).nonzero().flatten()
            assert set(changed.tolist()) <= set(layout.slots.tolist())  # only this step's rows
            assert len(changed) > 0.9 * len(layout.slots)
        cache.commit(ids, counts, outputs)
        pending = [[int(t)] for t in outputs["logits"].argmax(-1)]
    assert [*cache.key_pools, *cache.value_pools] == pools  # the same tensors throughout


@pytest.mark.slow  # shares the module's exports (20-110 s each on a busy machine)
@pytest.mark.parametrize("runner", RUNNERS)
def test_tokens_equal_transformers(exported, runner: str) -> None:
    arch, path, workload, reference = exported
    config = build_model(arch, SEED).config
    result = check.run_runner(runner, path, config, workload, BLOCK_SIZE, SEED, reference)
    assert result.error is None, result.error
    assert result.tokens_match, f"{arch} {runner}: tokens differ from transformers"
    assert result.max_logit_err <= check.LOGIT_ATOL, f"{arch} {runner}: logit error {result.max_logit_err:.3g}"
    assert result.steps == max(workload.budgets)


@pytest.mark.slow  # shares the module's exports (20-110 s each on a busy machine)
def test_eager_paged_step_equals_transformers(exported) -> None:
    """The same step module in eager torch (no ONNX): the paged math itself matches."""
    arch, _, workload, reference = exported
    step = PagedDecoderStep(build_model(arch, SEED), attention=PAKV)
    cache = new_cache(step.model.config, workload, BLOCK_SIZE, SEED)
    result = generate_paged(lambda feeds: run_step_torch(step, feeds), cache, workload)
    same, err = compare(result, reference)
    assert same and err <= check.LOGIT_ATOL


@pytest.mark.slow  # shares the module's exports (20-110 s each on a busy machine)
def test_broken_backend_fails(exported, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(kernels.BACKEND_MODULES, "broken", "broken_backend")
    arch, path, workload, reference = exported
    config = build_model(arch, SEED).config
    result = check.run_runner("plugin:broken", path, config, workload, BLOCK_SIZE, SEED, reference)
    assert not result.passed
    assert result.max_logit_err > check.LOGIT_ATOL


@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek"])
def test_eager_step_generates_like_transformers(arch: str) -> None:
    """No export: the pakv-form step module in eager torch, writing the pools in place (quick set)."""
    workload = make_workload(batch=3, new_tokens=4, vocab_size=256, seed=2)
    reference = generate_reference(build_model(arch, SEED), workload)
    step = PagedDecoderStep(build_model(arch, SEED), attention=PAKV)
    cache = new_cache(step.model.config, workload, 4, SEED)
    pools = [*cache.key_pools, *cache.value_pools]
    result = generate_paged(lambda feeds: run_step_torch(step, feeds), cache, workload)
    assert compare(result, reference)[0] and compare(result, reference)[1] <= check.LOGIT_ATOL
    assert [*cache.key_pools, *cache.value_pools] == pools and any(bool(p.any()) for p in pools)


def test_compare_sees_one_wrong_token() -> None:
    workload = make_workload(batch=2, new_tokens=3, vocab_size=256, seed=1)
    reference = generate_reference(build_model("llama", SEED), workload)
    altered = Generation([list(t) for t in reference.tokens], [x.clone() for x in reference.logits])
    altered.tokens[1][-1] = (altered.tokens[1][-1] + 1) % 256
    assert compare(altered, reference) == (False, 0.0)


def test_pypto_cpu_runner_is_skipped_where_it_has_no_kernel_for_the_graphs_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama's step attends with PagedAttention: a pypto-cpu without that kernel is skipped, saying so
    (it joined, and failed, before); with the kernel, the count names the op the step calls."""
    small = make_workload(batch=2, new_tokens=3, vocab_size=256, seed=0)
    big = make_workload(batch=2, new_tokens=30, vocab_size=256, seed=0)
    llama_ops = {"ScatterPaKvCache", "PagedAttention"}
    noop = lambda plan, tensors: None  # noqa: E731 (never called: only whether a kernel exists matters)
    without = kernels.Backend(name="pypto-cpu", description="test", gather=noop, scatter=noop)
    monkeypatch.setattr(kernels, "get_backend", lambda name: without)
    names, skipped = check.runner_names(["native"], small, num_layers=2, ops=llama_ops)
    assert "plugin:pypto-cpu" not in names
    assert skipped["plugin:pypto-cpu"] == "it has no PagedAttention kernel, and this model's step runs PagedAttention"
    names, skipped = check.runner_names(["native"], small, num_layers=2, ops={"ScatterPaKvCache", "GatherPaKvCache"})
    assert "plugin:pypto-cpu" in names and not skipped  # the MLA step's ops: it has both kernels
    with_attention = dataclasses.replace(without, attention=noop)
    monkeypatch.setattr(kernels, "get_backend", lambda name: with_attention)
    names, skipped = check.runner_names(["native"], big, num_layers=2, ops=llama_ops)
    assert skipped["plugin:pypto-cpu"].startswith("60 PagedAttention calls at seconds each")


def test_generate_runs_the_backends_given_and_adds_pypto_cpu_only_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from pakv_onnx import cli

    class Stop(Exception):
        pass

    calls = []

    def fake_run_check(**options):
        calls.append((list(options["backends"]), options["add_pypto_cpu"]))
        raise Stop

    monkeypatch.setattr(check, "run_check", fake_run_check)
    for argv in (["--backend", "native,golden"], []):
        with pytest.raises(Stop):
            cli.main(["generate", "--arch", "llama", *argv])
    assert calls == [(["native", "golden"], False), (["native", "golden"], True)]


def test_pypto_cpu_runner_is_picked_up_by_name_when_small(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend registered as "pypto-cpu" joins the runners for small cases and is skipped, with why, for big ones."""
    monkeypatch.setitem(kernels.BACKEND_MODULES, "pypto-cpu", "broken_backend")
    small = make_workload(batch=2, new_tokens=3, vocab_size=256, seed=0)
    names, skipped = check.runner_names(["native"], small, num_layers=2)
    assert names == ["plugin:native", "plugin:pypto-cpu", check.STOCK_ORT] and not skipped
    big = make_workload(batch=2, new_tokens=30, vocab_size=256, seed=0)
    names, skipped = check.runner_names(["native"], big, num_layers=2)
    assert "plugin:pypto-cpu" not in names and "60 gather calls" in skipped["plugin:pypto-cpu"]
    # A registered pypto-cpu that cannot run the model's pools is skipped with its own reason.
    refusing = kernels.Backend(
        name="pypto-cpu", description="test", gather=None, unsupported_reason=lambda plan, cache: "no fp32 here"
    )
    monkeypatch.setattr(kernels, "get_backend", lambda name: refusing)
    probe = check.probe_plan(build_model("deepseek", SEED).config, 16)
    assert probe[0].num_tokens == 1 and probe[1].shape == (1, 16, 1, 512)
    names, skipped = check.runner_names(["native"], small, num_layers=2, probe=probe)
    assert "plugin:pypto-cpu" not in names and skipped["plugin:pypto-cpu"] == "no fp32 here"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--arch", "gpt2"], "invalid choice"),
        (["--arch", "llama", "--batch", "0"], "must be in 1..32"),
        (["--arch", "llama", "--new-tokens", "-3"], "must be in 1..512"),
        (["--arch", "llama", "--block-size", "x"], "want an integer, got 'x'"),
        (["--arch", "llama", "--backend", "native,nope"], "backend 'nope' is unknown"),
        (["--arch", "llama", "--block-size", "2048"], "must be in 1..1024"),
    ],
)
def test_generate_refuses_bad_arguments(argv, message, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["generate", *argv]) == 2  # argparse's refusal, returned as the exit code
    assert message in capsys.readouterr().err


def test_generate_offers_every_arch_and_form() -> None:
    from pakv_onnx.commands import export as export_command
    from pakv_onnx.commands import generate as generate_command
    from pakv_onnx.models.hf.configs import ARCHS
    from pakv_onnx.models.hf.kv_quant import CALIBRATION_PROMPTS, CALIBRATION_TOKENS
    from pakv_onnx.models.hf.ort_layer import KV_CACHE_DTYPES
    from pakv_onnx.models.hf.step import ATTENTION_CHOICES

    assert generate_command.ARCH_CHOICES == ARCHS
    assert generate_command.ATTENTION_CHOICES == export_command.ATTENTION_CHOICES == ATTENTION_CHOICES
    assert export_command.KV_CACHE_CHOICES == tuple(KV_CACHE_DTYPES)
    assert (export_command.CALIBRATION_PROMPTS, export_command.CALIBRATION_TOKENS) == (
        CALIBRATION_PROMPTS,
        CALIBRATION_TOKENS,
    )


@pytest.mark.slow
def test_generate_cli_json_passes(tmp_path) -> None:
    result = subprocess.run(
        [
            "pakv-onnx",
            "generate",
            "--arch",
            "deepseek",
            "--attention",
            "pakv",
            "--batch",
            "3",
            "--new-tokens",
            "5",
            "--block-size",
            "4",
            "--json",
            "--out",
            str(tmp_path),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["arch"] == "deepseek"
    assert set(report["runners"]) >= {"plugin:native", "plugin:golden", "stock-ort"}
    for name, entry in report["runners"].items():
        assert set(entry) == {"tokens_match", "max_logit_err", "ms_per_token"}, name
        assert entry["tokens_match"] is True and entry["max_logit_err"] <= check.LOGIT_ATOL
        assert entry["ms_per_token"] > 0
    assert (tmp_path / "deepseek_step_bs4.onnx").is_file()
    assert "exporting one step" in result.stderr  # progress on stderr, stdout is only the JSON


@pytest.mark.slow
def test_generate_cli_fails_on_a_broken_backend(capsys: pytest.CaptureFixture, monkeypatch) -> None:
    monkeypatch.setitem(kernels.BACKEND_MODULES, "broken", "broken_backend")
    code = cli.main(
        ["generate", "--arch", "llama", "--attention", "pakv", "--batch", "2", "--new-tokens", "3",
         "--backend", "native,broken"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1, out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  plugin:")}
    assert rows["plugin:native"].rstrip().endswith("PASS")
    assert rows["plugin:broken"].rstrip().endswith("FAIL")
    assert out.rstrip().endswith("FAIL")


@pytest.mark.slow  # one export per arch
@pytest.mark.parametrize("arch", ["llama", "deepseek"])
def test_fused_norms_read_their_own_weights(arch: str, tmp_path) -> None:
    """The exported (fused) step of a model whose norm weights all differ generates like transformers."""
    workload = make_workload(batch=3, new_tokens=6, vocab_size=build_model(arch, SEED).config.vocab_size, seed=7)
    reference = generate_reference(perturbed_norms(build_model(arch, SEED)), workload)
    step = PagedDecoderStep(perturbed_norms(build_model(arch, SEED)), attention=PAKV)
    cache = new_cache(step.model.config, workload, BLOCK_SIZE, SEED)
    for i in range(len(workload.prompts)):
        cache.add_sequence(i)
    _, _, feeds = step_inputs(cache, list(range(len(workload.prompts))), workload.prompts)
    path = tmp_path / "step.onnx"
    export_step(step, feeds, path)
    session = check.make_runner_session("plugin:native", path)
    result = generate_paged(session_step(session), new_cache(step.model.config, workload, BLOCK_SIZE, SEED), workload)
    same, err = compare(result, reference)
    assert same and err <= check.LOGIT_ATOL, f"{arch}: tokens same {same}, logit error {err:.3g}"


@pytest.mark.slow  # one export
def test_the_gather_form_of_a_gqa_step_generates_like_transformers(tmp_path) -> None:
    """``attention="gather"`` (GatherPaKvCache, then a Loop of standard ops per sequence: the form the
    fused PagedAttention replaced, kept for comparison) in eager torch and exported to ORT."""
    workload = make_workload(batch=3, new_tokens=4, vocab_size=256, seed=3)
    reference = generate_reference(build_model("llama", SEED), workload)
    step = PagedDecoderStep(build_model("llama", SEED), attention="gather")
    eager = generate_paged(
        lambda feeds: run_step_torch(step, feeds), new_cache(step.model.config, workload, 4, SEED), workload
    )
    cache = new_cache(step.model.config, workload, 4, SEED)
    for i in range(len(workload.prompts)):
        cache.add_sequence(i)
    _, _, feeds = step_inputs(cache, list(range(len(workload.prompts))), workload.prompts)
    path = tmp_path / "step.onnx"
    model = export_step(step, feeds, path)
    assert [n.op_type for n in pakv_nodes(model.graph)] == ["ScatterPaKvCache", "GatherPaKvCache"] * 2
    session = check.make_runner_session("plugin:native", path)
    exported = generate_paged(session_step(session), new_cache(step.model.config, workload, 4, SEED), workload)
    for result in (eager, exported):
        same, err = compare(result, reference)
        assert same and err <= check.LOGIT_ATOL, f"tokens same {same}, logit error {err:.3g}"
