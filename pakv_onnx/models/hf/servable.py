"""The first stage of a Hugging Face folder's export (:func:`~pakv_onnx.models.hf.genai.export_genai`):
what the model's config alone decides, before any weight is read.

:func:`judge_export` reads the config once, in this order: the attention form (:func:`resolve_attention`:
``ort`` for the model types with a com.microsoft::PagedAttention form, :data:`MODEL_TYPES`), the pools'
per-token geometry (the next stage, :func:`~pakv_onnx.models.hf.configs.cache_geometry`; og.Engine
allocates both pools of a layer as one shape: :func:`check_servable`) and what the execution provider
and precision allow (:func:`export_target`, judged by :func:`pakv_onnx.providers.export_refusal`). Every
refusal is an :class:`UnsupportedModelError`. The later stages (the attention replacement, the step,
the folder) read its answer and never come back here.
"""

from __future__ import annotations

import dataclasses

from pakv_onnx import providers
from pakv_onnx.models.hf.configs import CacheGeometry, cache_geometry
from pakv_onnx.models.hf.kwargs import ATTENTION_CHOICES, ORT, PAKV

# transformers model types whose layers have a com.microsoft::PagedAttention form (models/hf/ort_layer.py).
GQA_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral", "qwen3"})
LATENT_MODEL_TYPES = frozenset({"deepseek_v3"})
MODEL_TYPES = GQA_MODEL_TYPES | LATENT_MODEL_TYPES
# Rope types whose angles depend on the sequence length (transformers' dynamic_rope_update): no fixed table.
_LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


class UnsupportedModelError(ValueError):
    """The model cannot be exported as an og.Engine paged model (the message says why)."""


class UnsupportedAttentionError(ValueError):
    """The model's attention has no com.microsoft::PagedAttention form here (the message says why)."""


def model_type(config) -> str:
    return getattr(config, "model_type", type(config).__name__)


def check_supported(config) -> None:
    """Raise :class:`UnsupportedAttentionError` unless ``config``'s model has an op form (ort_layer.py)."""
    kind = model_type(config)
    if kind not in MODEL_TYPES:
        raise UnsupportedAttentionError(
            f"model type {kind!r} has no com.microsoft::PagedAttention form here (served: "
            f"{', '.join(sorted(MODEL_TYPES))}); export it with --attention pakv"
        )
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope in _LENGTH_DEPENDENT_ROPE:
        raise UnsupportedAttentionError(
            f"{kind}: rope_type {rope!r} changes its angles with the sequence length; the op reads one fixed "
            "cos/sin table"
        )


def check_servable(config, attention: str = ORT) -> tuple[int, int]:
    """``(num_key_value_heads, head_size)`` of the pools og.Engine will allocate for ``config``'s step
    in the ``attention`` form (``ort`` or ``pakv``).

    DeepSeek-V3 (MLA): ``ort``, the latent ``[c_kv | k_pe]`` whole in the key pool (LATENT; og.Engine
    allocates the value pool alike, and the graph never reads it); ``pakv``, the latent in two halves,
    one per pool (``cache_geometry``'s ``same_shape``).

    Raises:
        UnsupportedModelError: the model's key and value rows differ in shape (og.Engine gives both
            pools one shape), or it is not a decoder with a KV cache.
    """
    return _pool_geometry(config, attention).key_shape


def _pool_geometry(config, attention: str) -> CacheGeometry:
    """:func:`check_servable`'s geometry: both pools of a layer in one shape."""
    try:
        geometry = cache_geometry(config, same_shape=True, latent_pool=attention == ORT)
    except AttributeError as err:
        raise UnsupportedModelError(
            f"{config.model_type} ({type(config).__name__}): its config has no {err.name or err}; pakv-onnx export "
            "serves decoders with grouped-query attention whose config names num_key_value_heads (Llama, Qwen2, "
            "Mistral, ...) and DeepSeek-V3's latent attention (kv_lora_rank)"
        ) from None
    except ValueError as err:
        raise UnsupportedModelError(
            f"{config.model_type}: {err}; og.Engine allocates both pools of a layer as one shape"
        ) from None
    if geometry.key_shape != geometry.value_shape:
        raise UnsupportedModelError(
            f"{config.model_type}: one layer caches key rows {list(geometry.key_shape)} and value rows "
            f"{list(geometry.value_shape)} per token; og.Engine allocates both pools of a layer as "
            "[num_blocks, block_size, num_key_value_heads, head_size], so it cannot serve this model "
            "(pakv-onnx generate runs it over pools of each shape)"
        )
    return geometry


def resolve_attention(config, attention: str | None) -> str:
    """The form a step of ``config`` is exported in: ``attention`` as given, or ``ort`` for the models
    of :data:`MODEL_TYPES` and ``pakv`` for others.

    Raises:
        UnsupportedModelError: ``ort`` asked for a model it does not serve, or an unknown form.
    """
    if attention not in (None, *ATTENTION_CHOICES):
        raise UnsupportedModelError(f"attention must be one of {', '.join(ATTENTION_CHOICES)}, got {attention!r}")
    if attention is None:
        return ORT if model_type(config) in MODEL_TYPES else PAKV
    if attention == ORT:
        try:
            check_supported(config)
        except UnsupportedAttentionError as err:
            raise UnsupportedModelError(str(err)) from None
    return attention


def export_target(config, *, precision: str, attention: str | None, block_size: int, kv_cache: str | None,
                  rotary_dim: int | None = None) -> providers.ExportTarget:  # fmt: skip
    """What :func:`pakv_onnx.providers.export_refusal` judges, read off ``config`` (a transformers config)
    without its weights: head size and heads of the op, and the rotary span (``rotary_dim``: the step's
    exact one, 2 x its cos table's columns; default: from the config)."""
    if getattr(config, "kv_lora_rank", None):  # LATENT: [c_kv | k_pe], rotary over k_pe
        head_size, offset, rotary = config.kv_lora_rank + config.qk_rope_head_dim, config.kv_lora_rank, config.qk_rope_head_dim
    else:
        head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rope = getattr(config, "rope_parameters", None) or {}
        factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
        offset, rotary = 0, int(head_size * factor)
    return providers.ExportTarget(
        precision, attention, block_size, kv_cache, head_size, config.num_attention_heads,
        rotary if rotary_dim is None else rotary_dim, offset,
    )  # fmt: skip


def check_target(target: providers.ExportTarget, execution_provider: str) -> None:
    """Raise :class:`UnsupportedModelError` with :func:`pakv_onnx.providers.export_refusal`'s message."""
    refusal = providers.export_refusal(target, execution_provider)
    if refusal:
        raise UnsupportedModelError(refusal)


@dataclasses.dataclass(frozen=True)
class Judgement:
    """What :func:`judge_export` decided: the form (``ort`` or ``pakv``), the pools' one geometry and its
    per-token shape ``(num_key_value_heads, head_size)``, the target the provider accepted (its rotary
    span the config's; the step's exact one is checked once its table is taken)."""

    attention: str
    geometry: CacheGeometry
    pool_shape: tuple[int, int]
    target: providers.ExportTarget


def judge_export(config, *, attention: str | None, precision: str, block_size: int, kv_cache: str | None,
                 execution_provider: str) -> Judgement:  # fmt: skip
    """Everything the config decides about the export, in one pass (see the module docstring).

    Raises:
        UnsupportedModelError: an unknown or unserved form, ``kv_cache`` without ``ort``, pools og.Engine
            cannot allocate, or what ``execution_provider`` / ``precision`` refuse.
    """
    resolved = resolve_attention(config, attention)
    if kv_cache is not None and resolved != ORT:
        raise UnsupportedModelError(f"--kv-cache {kv_cache} needs --attention {ORT} (com.microsoft::PagedAttention)")
    geometry = _pool_geometry(config, resolved)
    target = export_target(config, precision=precision, attention=resolved, block_size=block_size, kv_cache=kv_cache)
    check_target(target, execution_provider)
    return Judgement(resolved, geometry, geometry.key_shape, target)
