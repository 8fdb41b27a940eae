"""The ``ort`` decoder step (pakv_onnx/models/hf/ort_layer.py): each layer's attention one
com.microsoft::PagedAttention (packed QKV in; rotary, Qwen3's q/k norm, the cache write and attention
inside it; a sliding window as ``local_window_size``; DeepSeek-V3 absorbed over one LATENT pool).

Quick: every arch's step in eager torch against transformers' greedy ``generate`` (tokens identical,
logits within 1e-4), the window's exact width, the rotary tables (a scaled rope too), refusals, the
quantized caches' bounds, and one export of the Llama step run in ORT. Slow: every arch exported and
generating in ORT, its pools written in place; perturbed norm weights; int8 / fp8 exports.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import onnx
import pytest
import torch
from conftest import perturbed_norms
from onnx_graphs import assert_one_ort_attention_per_layer

from pakv_onnx.models.hf import (
    ARCHS,
    PagedDecoderStep,
    PagedKVCache,
    build_model,
    check,
    compare,
    export_step,
    generate_paged,
    generate_reference,
    make_workload,
    run_step,
    run_step_torch,
    session_step,
    step_inputs,
)
from pakv_onnx.models.hf import kv_quant, ort_layer, servable
from pakv_onnx.models.hf.configs import SAMPLE_WINDOW

SEED = 0
BLOCK_SIZE = 4
# DeepSeek-V3 beside the seed config: a q LoRA and non-interleaved rope (rotary_interleaved=0 in LATENT).
DEEPSEEK_VARIANT = {"q_lora_rank": 64, "rope_interleave": False}


def eager_generation(step: PagedDecoderStep, workload, block_size: int = BLOCK_SIZE):
    cache = check.step_cache(step, workload, block_size, SEED)
    pools = [*cache.key_pools, *cache.value_pools]
    result = generate_paged(lambda feeds: run_step_torch(step, feeds), cache, workload)
    assert [*cache.key_pools, *cache.value_pools] == pools, "the eager step replaced a pool instead of writing it"
    return result, cache


@pytest.mark.parametrize("arch, overrides", [*((a, {}) for a in ARCHS), ("deepseek", DEEPSEEK_VARIANT)],
                         ids=[*ARCHS, "deepseek-qlora-halves-rope"])  # fmt: skip
def test_eager_ort_step_generates_like_transformers(arch: str, overrides: dict) -> None:
    workload = make_workload(batch=3, new_tokens=5, vocab_size=256, seed=2)
    reference = generate_reference(build_model(arch, SEED, **overrides), workload)
    step = PagedDecoderStep(build_model(arch, SEED, **overrides))
    assert step.attention == "ort"
    result, cache = eager_generation(step, workload)
    same, err = compare(result, reference)
    assert same and err <= check.LOGIT_ATOL, f"{arch}: tokens same {same}, logit error {err:.3g}"
    assert any(bool(p.any()) for p in cache.key_pools)
    if arch == "deepseek":  # LATENT: the whole latent in the key pool, no value pool read
        assert cache.key_pools[0].shape[2:] == (1, 512 + 64) and cache.value_pools[0].numel() == 0


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_sliding_window_is_transformers_exactly(arch: str) -> None:
    """transformers' sliding window (keys at q - W < k <= q) is the op's local_window_size W: W gives
    transformers' tokens; W - 1, W + 1 and no window all differ (contexts run past the window)."""
    workload = make_workload(batch=3, new_tokens=5, vocab_size=256, seed=2)
    assert max(len(p) for p in workload.prompts) > 2 * SAMPLE_WINDOW
    reference = generate_reference(build_model(arch, SEED), workload)
    windows = {}
    for change in (0, -1, 1, None):
        step = PagedDecoderStep(build_model(arch, SEED))
        sliding = [layer.self_attn for layer in step.model.model.layers if layer.self_attn.window > 0]
        assert sliding and all(a.window == SAMPLE_WINDOW for a in sliding)
        for attention in sliding:
            attention.window = -1 if change is None else SAMPLE_WINDOW + change
        windows[change] = compare(eager_generation(step, workload)[0], reference)
    assert windows[0][0] and windows[0][1] <= check.LOGIT_ATOL
    for change in (-1, 1, None):
        assert windows[change][1] > 100 * check.LOGIT_ATOL, f"window {change} went unseen"


def test_rotary_tables_are_the_models_own_angles_scaled_rope_too() -> None:
    """The op's cos/sin rows are the model's rotary embedding at each position (its first half); a
    llama3-scaled rope gives other rows, and that model still generates like transformers."""
    model = build_model("llama", SEED)
    cos, sin = ort_layer.rotary_tables(model)
    positions = torch.tensor([[0, 5, 1023]])
    want_cos, want_sin = model.model.rotary_emb(torch.zeros(1), positions)
    assert cos.shape == (1024, 16)
    assert torch.equal(cos[positions[0]], want_cos[0, :, :16]) and torch.equal(sin[positions[0]], want_sin[0, :, :16])
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    scaled = build_model("llama", SEED, rope_parameters=rope)
    assert not torch.equal(ort_layer.rotary_tables(scaled)[0], cos)
    workload = make_workload(batch=2, new_tokens=4, vocab_size=256, seed=4)
    reference = generate_reference(build_model("llama", SEED, rope_parameters=rope), workload)
    same, err = compare(eager_generation(PagedDecoderStep(scaled), workload)[0], reference)
    assert same and err <= check.LOGIT_ATOL


def test_models_without_an_ort_form_are_refused() -> None:
    from transformers import GPT2Config

    with pytest.raises(servable.UnsupportedAttentionError, match="model type 'gpt2' has no com.microsoft"):
        servable.check_supported(GPT2Config())
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(servable.UnsupportedAttentionError, match="rope_type 'dynamic' changes its angles"):
        PagedDecoderStep(build_model("llama", SEED, rope_parameters=rope), attention="ort")
    with pytest.raises(ValueError, match="sliding window of 8 tokens: the pakv ops attend over the whole context"):
        PagedDecoderStep(build_model("mistral", SEED), attention="pakv")
    with pytest.raises(ValueError, match="a quantized KV cache needs attention 'ort'"):
        PagedDecoderStep(build_model("llama", SEED), attention="pakv", kv_quant=object())
    with pytest.raises(ValueError, match="attention must be one of 'ort', 'pakv', 'gather'"):
        PagedDecoderStep(build_model("deepseek", SEED), attention="fused")


def test_rotary_pairs_turn_the_channels_the_op_turns() -> None:
    assert kv_quant.rotary_pairs(6, 0, 4, False).tolist() == [2, 3, 0, 1, 4, 5]  # halves, 2 channels pass
    assert kv_quant.rotary_pairs(6, 2, 4, True).tolist() == [0, 1, 3, 2, 5, 4]  # pairs after an offset
    rows = torch.tensor([[[3.0, 0.0, 4.0, -2.0]]])
    # channel 0 pairs with 2 (norm 5), 1 with 3 (norm 2); qmax 1
    assert kv_quant.channel_scales(rows, kv_quant.rotary_pairs(4, 0, 4, False), 1.0).flatten().tolist() == [5, 2, 5, 2]
    assert kv_quant.channel_scales(torch.zeros(2, 1, 3), None, 127.0).flatten().tolist() == [1, 1, 1]  # zero: 1


@pytest.mark.parametrize("arch", ["qwen3", "deepseek"])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_pools_hold_the_fp32_rows_within_one_rounding(arch: str, kind: str) -> None:
    """The calibrated scales cover every cached row of a prefill of the calibration prompts: the
    int8 pool's rows dequantize to the fp32 step's within half a scale step, the float8e4m3fn pool's
    within half a unit in its last place (relative 2^-4; 2^-10 scale below its normal range). Layer 0
    (its rows depend on the embeddings alone; later layers read a quantized cache before theirs)."""
    prompts = kv_quant.calibration_prompts(256, count=3, length=20)
    model = build_model(arch, SEED)
    quant = kv_quant.calibrate(model, kind, prompts=prompts, block_size=BLOCK_SIZE)
    steps = {"fp32": PagedDecoderStep(build_model(arch, SEED)), kind: PagedDecoderStep(model, kv_quant=quant)}
    pools = {}
    for name, step in steps.items():
        cache = PagedKVCache(num_layers=step.num_layers, geometry=step.geometry(), num_blocks=16,
                             block_size=BLOCK_SIZE, dtype=step.pool_dtype)  # fmt: skip
        for i in range(len(prompts)):
            cache.add_sequence(i)
        run_step(lambda feeds, step=step: run_step_torch(step, feeds), cache, [0, 1, 2], prompts)
        pools[name] = cache
    for layer in [0]:
        pairs = [(pools["fp32"].key_pools[layer], pools[kind].key_pools[layer], quant.key_scales[layer])]
        if arch != "deepseek":
            pairs.append((pools["fp32"].value_pools[layer], pools[kind].value_pools[layer], quant.value_scales[layer]))
        for exact, stored, scale in pairs:
            assert stored.dtype == ort_layer.KV_CACHE_DTYPES[kind]
            scale = scale.squeeze(1)  # [H, D]
            error = (stored.to(torch.float32) * scale - exact).abs()
            bound = scale / 2 if kind == "int8" else torch.maximum(exact.abs() * 2.0**-4, scale * 2.0**-10)
            assert bool((error <= bound * (1 + 1e-6)).all()), f"layer {layer}: {float((error / bound).max()):.3f}x"
            assert bool((stored.to(torch.float32) != 0).any())


def test_one_export_of_the_llama_step_runs_in_ort(tmp_path: Path) -> None:
    """The ort-form Llama step exported (quick set: a few seconds): one com.microsoft::PagedAttention
    per layer, no position or slot prologue, tokens equal to transformers' through ORT."""
    workload = make_workload(batch=3, new_tokens=4, vocab_size=256, seed=3)
    reference = generate_reference(build_model("llama", SEED), workload)
    path = tmp_path / "llama.onnx"
    step = check.export_for("llama", SEED, workload, BLOCK_SIZE, path)
    assert_one_ort_attention_per_layer(onnx.load(str(path)), 2, latent=False)
    result = check.run_runner("plugin:native", path, step.model.config, workload, BLOCK_SIZE, SEED, reference,
                              step=step)  # fmt: skip
    assert result.passed, result


@pytest.fixture(scope="module", params=ARCHS)
def exported(request, tmp_path_factory) -> tuple:
    """(arch, step module, onnx path, workload, transformers reference), one ort-form export per arch."""
    arch = request.param
    workload = make_workload(batch=4, new_tokens=8, vocab_size=256, seed=5)
    path = Path(tmp_path_factory.mktemp("ort")) / f"{arch}.onnx"
    step = check.export_for(arch, SEED, workload, BLOCK_SIZE, path)
    return arch, step, path, workload, generate_reference(build_model(arch, SEED), workload)


@pytest.mark.slow  # the module's exports
def test_every_arch_exported_generates_like_transformers_in_ort(exported) -> None:
    arch, step, path, workload, reference = exported
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    assert_one_ort_attention_per_layer(model, 2, latent=arch == "deepseek")
    assert not [o for o in model.opset_import if o.domain == "pakv"] and not model.functions
    result = check.run_runner("plugin:native", path, step.model.config, workload, BLOCK_SIZE, SEED, reference,
                              step=step)  # fmt: skip
    assert result.passed and result.steps == max(workload.budgets), result


@pytest.mark.slow  # the module's exports
def test_exported_step_writes_the_callers_pools_in_place(exported) -> None:
    """Every step's present outputs are the cache's own pools, and only the step's slots changed."""
    arch, step, path, workload, _ = exported
    session = check.make_runner_session("plugin:native", path)
    cache = check.step_cache(step, workload, BLOCK_SIZE, SEED)
    pools = [*cache.key_pools, *cache.value_pools]
    ids = list(range(len(workload.prompts)))
    for i in ids:
        cache.add_sequence(i)
    pending = [list(p) for p in workload.prompts]
    for _ in range(3):
        before = [p.clone() for p in cache.key_pools]
        counts, layout, feeds = step_inputs(cache, ids, pending)
        outputs = session_step(session)(feeds)
        for layer in range(2):
            assert outputs[f"present.{layer}.key"] is cache.key_pools[layer]
            assert outputs[f"present.{layer}.value"] is cache.value_pools[layer]
        for pool, old in zip(cache.key_pools, before):
            changed = (pool != old).flatten(2).any(dim=2).flatten().nonzero().flatten()
            assert set(changed.tolist()) <= set(layout.slots.tolist()) and len(changed) > 0.9 * len(layout.slots)
        cache.commit(ids, counts, outputs)
        pending = [[int(t)] for t in outputs["logits"].argmax(-1)]
    assert [*cache.key_pools, *cache.value_pools] == pools


@pytest.mark.slow  # one export per arch
@pytest.mark.parametrize("arch", ["qwen3", "deepseek"])
def test_exported_norms_read_their_own_weights(arch: str, tmp_path: Path) -> None:
    workload = make_workload(batch=3, new_tokens=6, vocab_size=256, seed=7)
    reference = generate_reference(perturbed_norms(build_model(arch, SEED)), workload)
    step = PagedDecoderStep(perturbed_norms(build_model(arch, SEED)))
    cache = check.step_cache(step, workload, BLOCK_SIZE, SEED)
    for i in range(len(workload.prompts)):
        cache.add_sequence(i)
    path = tmp_path / "step.onnx"
    export_step(step, step_inputs(cache, list(range(len(workload.prompts))), workload.prompts)[2], path)
    result = check.run_runner("plugin:native", path, step.model.config, workload, BLOCK_SIZE, SEED, reference,
                              step=step)  # fmt: skip
    assert result.passed, result


@pytest.mark.slow  # two exports
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_export_runs_in_ort_like_its_eager_step(kind: str, tmp_path: Path) -> None:
    """The exported int8 / fp8 step: pools of that type, per-channel [Hk, 1, D] scales as initializers,
    and in ORT the tokens and pools of the eager step (the same op, the same bytes)."""
    workload = make_workload(batch=3, new_tokens=6, vocab_size=256, seed=8)
    model = build_model("llama", SEED)
    quant = kv_quant.calibrate(model, kind, block_size=BLOCK_SIZE)
    step = PagedDecoderStep(model, kv_quant=quant)
    eager, eager_cache = eager_generation(step, workload)
    path = tmp_path / "step.onnx"
    cache = check.step_cache(step, workload, BLOCK_SIZE, SEED)
    for i in range(len(workload.prompts)):
        cache.add_sequence(i)
    graph = export_step(step, step_inputs(cache, list(range(len(workload.prompts))), workload.prompts)[2], path)
    pool = next(i for i in graph.graph.input if i.name == "past_key_values.0.key").type.tensor_type.elem_type
    assert pool == {"int8": onnx.TensorProto.INT8, "fp8": onnx.TensorProto.FLOAT8E4M3FN}[kind]
    scales = [i for i in graph.graph.initializer if i.name.endswith(("k_scale", "v_scale"))]
    assert len(scales) == 4 and all(list(s.dims) == [2, 1, 32] for s in scales)
    session = check.make_runner_session("plugin:native", path)
    cache = check.step_cache(step, workload, BLOCK_SIZE, SEED)
    ran = generate_paged(session_step(session), cache, workload)
    assert ran.tokens == eager.tokens
    for mine, theirs in zip([*cache.key_pools, *cache.value_pools], [*eager_cache.key_pools, *eager_cache.value_pools]):
        assert mine.view(torch.uint8).equal(theirs.view(torch.uint8))


@pytest.mark.slow
def test_generate_cli_runs_the_ort_form(tmp_path: Path) -> None:
    result = subprocess.run(
        ["pakv-onnx", "generate", "--arch", "mistral", "--batch", "3", "--new-tokens", "5", "--block-size", "4",
         "--json", "--out", str(tmp_path)],
        check=False, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert list(report["runners"]) == ["plugin:native"] and report["runners"]["plugin:native"]["tokens_match"]
    assert "stock ORT has no CPU kernel for com.microsoft::PagedAttention" in result.stderr
    assert_one_ort_attention_per_layer(onnx.load(str(tmp_path / "mistral_step_bs4.onnx")), 2, latent=False)
