"""DeepSeek-V3 over paged pools in the absorbed form (pakv_onnx/models/hf/mla.py), eager (quick).

The paged attention is checked against an independent dense reference (the latent concatenated,
one masked softmax per sequence) for both pool layouts; whole models against transformers'
greedy ``generate`` (tokens identical, logits within 1e-4) for the seed config and for
q_lora + non-interleaved RoPE, over the default layout and og.Engine's halves. The exported step
on every runner is in tests/test_hf_generate.py, og.Engine in tests/test_genai_export.py.
"""

from __future__ import annotations

import pytest
import torch

from pakv_onnx import kernels
from pakv_onnx.models.hf import (
    PagedDecoderStep,
    PagedKVCache,
    StepCache,
    build_model,
    cache_geometry,
    check,
    compare,
    generate_paged,
    generate_reference,
    make_config,
    make_workload,
    mla,
    run_step_torch,
)
from pakv_onnx.models.hf.configs import CacheGeometry
from pakv_onnx.models.hf.generate import blocks_needed

SEED = 0
RANK, ROPE = 512, 64  # the seed config's latent


def seeded_model(config):
    """``AutoModelForCausalLM.from_config`` after ``torch.manual_seed(SEED)``: the same weights every call."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()


def variant_config(name: str):
    config = make_config("deepseek")
    if name == "q_lora, rope not interleaved":
        config.q_lora_rank, config.rope_interleave = 48, False
    return config


def test_the_step_swaps_in_the_absorbed_attention_and_folds_kv_b_proj() -> None:
    model = build_model("deepseek", SEED)
    original = model.model.layers[1].self_attn
    kv_b = original.kv_b_proj.weight.detach().clone()  # [H * (nope + v), rank]
    step = PagedDecoderStep(model, attention="pakv")
    attention = step.model.model.layers[1].self_attn
    assert all(isinstance(layer.self_attn, mla.AbsorbedLatentAttention) for layer in step.model.model.layers)
    assert attention.q_proj is original.q_proj and attention.o_proj is original.o_proj  # shared, not copied
    per_head = kv_b.view(4, 32 + 32, RANK)
    assert torch.equal(attention.k_absorb, per_head[:, :32])  # W_UK [H, nope, rank]
    assert torch.equal(attention.v_absorb, per_head[:, 32:].transpose(1, 2))  # W_UV^T [H, rank, v]
    assert mla.absorb_latent_attention(build_model("llama", SEED)) == 0  # nothing to absorb in GQA


def test_a_biased_kv_b_proj_is_refused() -> None:
    model = build_model("deepseek", SEED)
    attention = model.model.layers[0].self_attn
    attention.kv_b_proj.bias = torch.nn.Parameter(torch.zeros(attention.kv_b_proj.out_features))
    with pytest.raises(ValueError, match="layer 0: kv_b_proj has a bias"):
        mla.AbsorbedLatentAttention(attention)


def test_cache_geometry_lays_the_latent_out() -> None:
    config = make_config("deepseek")
    assert cache_geometry(config) == CacheGeometry((1, RANK), (1, ROPE))  # c_kv | k_pe
    assert cache_geometry(config, same_shape=True) == CacheGeometry((1, 288), (1, 288))  # two halves
    assert cache_geometry(make_config("llama"), same_shape=True) == cache_geometry(make_config("llama"))
    config.kv_lora_rank = 511
    with pytest.raises(ValueError, match="511 \\+ qk_rope_head_dim 64 = 575 wide per token: odd"):
        cache_geometry(config, same_shape=True)


@pytest.mark.parametrize("key, value", [((1, 500), (1, 64)), ((2, 256), (1, 64)), ((1, 512), (2, 32))])
def test_pools_that_do_not_hold_the_latent_are_refused(key, value) -> None:
    attention = PagedDecoderStep(build_model("deepseek", SEED), attention="pakv").model.model.layers[0].self_attn
    pools = ([torch.zeros(2, 4, *key)], [torch.zeros(2, 4, *value)])
    cache = StepCache(*pools, torch.zeros(1, 1, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), torch.zeros(0))
    message = f"layer 0: the pools hold rows \\[{key[0]}, {key[1]}\\] and \\[{value[0]}, {value[1]}\\]"
    with pytest.raises(mla.LatentLayoutError, match=message):
        attention.latent_split(cache)


def dense_latent_attention(query, latents, new_counts, scale):
    """The reference: per sequence, scores over the whole latent [len, rank + rope] at once, a
    causal mask, softmax, then the value columns. ``query`` fp32 [H, N, rank + rope]; returns [N, H, rank]."""
    out, start = [], 0
    for latent, new in zip(latents, new_counts):
        q = query[:, start : start + new]  # [H, new, rank + rope]
        scores = torch.einsum("hjc,tc->hjt", q, latent) * scale
        past = latent.shape[0] - new
        allowed = torch.arange(latent.shape[0])[None, :] <= (torch.arange(new)[:, None] + past)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out.append(torch.einsum("hjt,tc->jhc", probs, latent[:, :RANK]))
        start += new
    return torch.cat(out)


@pytest.mark.parametrize("split", [RANK, 288, 530])
def test_paged_latent_attention_equals_a_dense_reference(split: int) -> None:
    """Ragged sequences (a prompt chunk with past, a fresh prompt, decode tokens, one sequence with no
    new token) over shuffled blocks, the latent cut at ``split`` columns between the two pools."""
    generator = torch.Generator().manual_seed(3)
    lengths, new_counts, heads, scale = [13, 9, 30, 6], [4, 9, 1, 0], 3, 0.17
    cache = PagedKVCache(
        num_layers=1, geometry=CacheGeometry((1, split), (1, RANK + ROPE - split)), num_blocks=20, block_size=4, seed=5
    )
    latents = [torch.randn(n, RANK + ROPE, generator=generator) for n in lengths]
    for seq, latent in enumerate(latents):
        cache.add_sequence(seq)
        layout = cache.prepare_step([seq], [len(latent)])
        cache.key_pools[0].view(-1, split)[layout.slots] = latent[:, :split]
        cache.value_pools[0].view(-1, RANK + ROPE - split)[layout.slots] = latent[:, split:]
        cache.commit([seq], [len(latent)], {})
    layout = cache.prepare_step(list(range(4)), [0] * 4)
    query = torch.randn(heads, sum(new_counts), RANK + ROPE, generator=generator)
    query_seq_lens = torch.tensor([0, *new_counts]).cumsum(0).to(torch.int32)
    kv_seq_lens = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    got = mla.paged_latent_attention(
        query[..., :split].clone(),
        query[..., split:].clone(),
        cache.key_pools[0],
        cache.value_pools[0],
        layout.block_table,
        query_seq_lens,
        kv_seq_lens,
        scale,
        RANK,
    )
    want = dense_latent_attention(
        query, [x for x, n in zip(latents, new_counts) if n], [n for n in new_counts if n], scale
    )
    assert got.shape == (sum(new_counts), heads, RANK)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("same_shape", [False, True], ids=["c_kv|k_pe pools", "halves"])
@pytest.mark.parametrize("variant", ["seed config", "q_lora, rope not interleaved"])
def test_absorbed_step_generates_like_transformers(variant: str, same_shape: bool) -> None:
    """Eager step (no export): ragged prompts, staggered ends, blocks of 4 in shuffled order."""
    config = variant_config(variant)
    workload = make_workload(batch=3, new_tokens=5, vocab_size=config.vocab_size, seed=4)
    reference = generate_reference(seeded_model(config), workload)
    step = PagedDecoderStep(seeded_model(config), attention="pakv")
    cache = PagedKVCache(
        num_layers=config.num_hidden_layers,
        geometry=cache_geometry(config, same_shape=same_shape),
        num_blocks=blocks_needed(workload, 4) + 3,
        block_size=4,
    )
    result = generate_paged(lambda feeds: run_step_torch(step, feeds), cache, workload)
    same, err = compare(result, reference)
    assert same and err <= check.LOGIT_ATOL, (same, err)


def test_dropping_the_rope_scores_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above can fail: attention without the q_pe . k_pe part of the scores changes
    the logits far beyond the tolerance."""
    real = mla.paged_latent_attention

    def without_rope(query_a, query_b, *args):
        return real(query_a, torch.zeros_like(query_b), *args)  # default layout: query_b is q_pe

    monkeypatch.setattr(mla, "paged_latent_attention", without_rope)
    workload = make_workload(batch=2, new_tokens=3, vocab_size=256, seed=4)
    reference = generate_reference(build_model("deepseek", SEED), workload)
    step = PagedDecoderStep(build_model("deepseek", SEED), attention="pakv")
    cache = PagedKVCache(
        num_layers=2,
        geometry=cache_geometry(step.model.config),
        num_blocks=blocks_needed(workload, 4) + 3,
        block_size=4,
    )
    _, err = compare(generate_paged(lambda feeds: run_step_torch(step, feeds), cache, workload), reference)
    assert err > 100 * check.LOGIT_ATOL


def test_the_pypto_cpu_guard_counts_a_gather_per_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek-V3's step gathers each live sequence's latent (inside its Loop): a generation makes
    one call per layer per generated token, which is what the pypto-cpu time guard must count."""
    monkeypatch.setitem(kernels.BACKEND_MODULES, "pypto-cpu", "broken_backend")
    assert mla.gathers_per_sequence(make_config("deepseek")) and not mla.gathers_per_sequence(make_config("llama"))
    workload = make_workload(batch=2, new_tokens=3, vocab_size=256, seed=0)  # budgets [3, 2]
    assert check.gather_calls(workload, 2) == 6 and check.gather_calls(workload, 2, per_sequence=True) == 10
    names, _ = check.runner_names(["native"], workload, 2, per_sequence=True)
    assert "plugin:pypto-cpu" in names
    bigger = make_workload(batch=4, new_tokens=4, vocab_size=256, seed=0)  # 13 tokens
    names, skipped = check.runner_names(["native"], bigger, 2, per_sequence=True)
    assert skipped["plugin:pypto-cpu"].startswith(f"{2 * bigger.generated_tokens} gather calls")
    assert "steps x live sequences x layers <= 12" in skipped["plugin:pypto-cpu"]
