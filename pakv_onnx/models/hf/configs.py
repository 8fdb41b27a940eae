"""Small transformers decoders with seeded random weights (nothing is downloaded).

Grouped-query attention: ``llama`` (``LlamaForCausalLM``), ``qwen2`` (q/k/v biases; its second layer
slides a window of :data:`SAMPLE_WINDOW` tokens), ``mistral`` (every layer slides that window) and
``qwen3`` (per-head q/k RMSNorm before rotary); and DeepSeek-V3 multi-head latent attention
(``deepseek``: ``DeepseekV3ForCausalLM``) with the seed's latent widths (kv_lora_rank 512 + rope 64),
so its cache read is exactly the seed's GatherPaKvCache shape: key ``[T, 1, 512]``, value ``[T, 1, 64]``.
Every GQA family has 4 query / 2 KV heads of 32.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import torch

ARCHS = ("llama", "qwen2", "mistral", "qwen3", "deepseek")
# The sliding window of the sample Qwen2 / Mistral: shorter than most sample prompts, so every
# generation attends past it.
SAMPLE_WINDOW = 8


@dataclasses.dataclass(frozen=True)
class CacheGeometry:
    """Per-token shapes of one layer's two paged pools: ``[num_blocks, block_size, *shape]``."""

    key_shape: tuple[int, int]
    value_shape: tuple[int, int]


# The trunk both families share: a tiny vocabulary and width, two layers, four query heads.
_TRUNK = {
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}


def _llama_config(**overrides):
    from transformers import LlamaConfig

    return LlamaConfig(**{**_TRUNK, "num_key_value_heads": 2, "head_dim": 32, **overrides})


def _qwen2_config(**overrides):
    from transformers import Qwen2Config

    # Layer 0 full attention, layer 1 a sliding window (Qwen2: layers >= max_window_layers slide).
    window = {"use_sliding_window": True, "sliding_window": SAMPLE_WINDOW, "max_window_layers": 1}
    return Qwen2Config(**{**_TRUNK, "num_key_value_heads": 2, **window, **overrides})


def _mistral_config(**overrides):
    from transformers import MistralConfig

    return MistralConfig(**{**_TRUNK, "num_key_value_heads": 2, "head_dim": 32, "sliding_window": SAMPLE_WINDOW,
                            **overrides})  # fmt: skip


def _qwen3_config(**overrides):
    from transformers import Qwen3Config

    return Qwen3Config(**{**_TRUNK, "num_key_value_heads": 2, "head_dim": 32, **overrides})


def _deepseek_config(**overrides):
    from transformers import DeepseekV3Config

    # The seed's MLA widths: latent 512 + rope 64; every layer dense (no MoE routing).
    attention = {"q_lora_rank": None, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32}
    fields = {"v_head_dim": 32, "num_key_value_heads": 4, "moe_intermediate_size": 64, "first_k_dense_replace": 2}
    return DeepseekV3Config(**{**_TRUNK, **attention, **fields, **overrides})


CONFIGS: dict[str, Callable] = {
    "llama": _llama_config,
    "qwen2": _qwen2_config,
    "mistral": _mistral_config,
    "qwen3": _qwen3_config,
    "deepseek": _deepseek_config,
}


def make_config(arch: str, **overrides):
    """The small ``transformers`` config of ``arch`` (one of :data:`ARCHS`); ``overrides``
    replace its fields (e.g. ``vocab_size``)."""
    if arch not in CONFIGS:
        raise ValueError(f"arch {arch!r} is unknown (choices: {', '.join(ARCHS)})")
    return CONFIGS[arch](**overrides)


def build_model(arch: str, seed: int = 0, attn_implementation: str = "eager", **overrides) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config`` with weights drawn after ``torch.manual_seed(seed)``, fp32, eval.

    The same (arch, seed, overrides) gives bit-identical weights on every call, so a reference
    model (dense cache, eager attention) and a paged model can be built separately.
    ``overrides``: config fields (:func:`make_config`).
    """
    from transformers import AutoModelForCausalLM

    config = make_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    return model.eval()


def cache_geometry(config, *, same_shape: bool = False, latent_pool: bool = False) -> CacheGeometry:
    """What one layer caches per token: GQA K and V ``[kv_heads, head_dim]``; DeepSeek-V3 the latent
    ``[c_kv | k_pe]`` (the normalized ``c_kv``, kv_lora_rank wide, then the RoPE'd shared key,
    rope_dim wide, as DeepseekV3Attention hands them to ``cache.update``).

    With ``latent_pool`` (com.microsoft::PagedAttention's LATENT layout) the key pool holds the whole
    latent ``[1, kv_lora_rank + rope_dim]`` and the value pool is unused: ``[1, 0]``, or with
    ``same_shape`` the key's shape (og.Engine allocates every pool alike). Otherwise (the pakv ops)
    its leading columns lie in the key pool and the rest in the value pool: ``c_kv``
    ``[1, kv_lora_rank]`` | ``k_pe`` ``[1, rope_dim]``, or with ``same_shape`` two halves
    ``[1, (kv_lora_rank + rope_dim) / 2]``. (models/hf/mla.py reads the split off the pools.)

    Raises:
        ValueError: ``same_shape`` and an odd latent width (no two equal halves, pakv form).
    """
    if getattr(config, "kv_lora_rank", None):
        rank, rope = config.kv_lora_rank, config.qk_rope_head_dim
        if latent_pool:
            return CacheGeometry((1, rank + rope), (1, rank + rope) if same_shape else (1, 0))
        if not same_shape:
            return CacheGeometry((1, rank), (1, rope))
        if (rank + rope) % 2:
            raise ValueError(
                f"the latent is kv_lora_rank {rank} + qk_rope_head_dim {rope} = {rank + rope} wide per token: "
                "odd, so it has no two equal halves for two pools of one shape"
            )
        return CacheGeometry((1, (rank + rope) // 2), (1, (rank + rope) // 2))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return CacheGeometry((config.num_key_value_heads, head_dim), (config.num_key_value_heads, head_dim))


# The sample folders' chat template: each message as its role's marker token, its content, and t4 (end
# of turn); the generation prompt is the assistant's marker. Markers are words of the sample vocabulary.
SAMPLE_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ {'system': 't5', 'user': 't6', 'assistant': 't7'}.get(m['role'], 't8') }} "
    "{{ m['content'] }} t4 {% endfor %}{% if add_generation_prompt %}t7{% endif %}"
)


def save_sample_folder(
    path: str | os.PathLike,
    arch: str = "llama",
    seed: int = 0,
    *,
    chat_template: str | None = SAMPLE_CHAT_TEMPLATE,
    **overrides,
) -> Path:
    """Write :func:`build_model`'s model as ``save_pretrained`` writes it, plus a word-level
    tokenizer over its vocabulary (``tokenizer.json``; ORT GenAI's model builder wants tokenizer
    files; ``t<i>`` is token i, words split at whitespace, decoded joined by spaces) with
    ``chat_template`` (None: none): a Hugging Face folder without a hub. Returns ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = build_model(arch, seed, **overrides)
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    return Path(path)
