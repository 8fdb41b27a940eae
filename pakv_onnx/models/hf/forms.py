"""The attention replacement stage of a paged step: a transformers causal LM made ready to run over
paged pools, in one of the step's attention forms, before the step (:mod:`~pakv_onnx.models.hf.step`)
wraps it.

:func:`prepare_attention` decides the form (``ort``: each layer one com.microsoft::PagedAttention,
:mod:`~pakv_onnx.models.hf.ort_layer`; ``pakv``: :data:`FUSED` for GQA models, :data:`GATHER` for MLA),
checks what the form needs (a quantized cache and fp16 / bf16 only in ``ort``, no sliding window in the
pakv forms), and replaces the model's attention in place: ``ort``, the rotary tables taken in float32,
the model cast to the precision's compute dtype, every layer's attention module replaced; the pakv
forms, :func:`paged_attention` registered with transformers' ``AttentionInterface`` (no transformers
module is patched), DeepSeek-V3's attention absorbed (:mod:`~pakv_onnx.models.hf.mla`) and Llama's
made token-major (:mod:`~pakv_onnx.models.hf.gqa`). The :class:`PreparedModel` it returns is what
:class:`~pakv_onnx.models.hf.step.PagedDecoderStep` is built from.
"""

from __future__ import annotations

import dataclasses

import torch

from pakv_onnx import providers
from pakv_onnx.models.attention import cached_ragged_attention
from pakv_onnx.models.hf.kwargs import (
    ATTN_IMPLEMENTATION,
    FUSED,
    FUSED_CACHE_KWARG,
    GATHER,
    KV_SEQ_LENS_KWARG,
    ORT,
    PAKV,
    QUERY_SEQ_LENS_KWARG,
)
from pakv_onnx.models.hf.servable import MODEL_TYPES, check_supported, model_type


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: per-sequence causal attention over the cache's rows.

    Args:
        query: ``[1, Hq, N, Dqk]`` new tokens packed by ``kwargs[QUERY_SEQ_LENS_KWARG]``.
        key, value: ``[1, Hk, T, D]`` from :meth:`StepCache.update`: each sequence's past and new
            rows, one run per sequence packed by ``kwargs[KV_SEQ_LENS_KWARG]``. ``Hq`` a multiple
            of ``Hk`` (GQA).
        attention_mask: ignored (None: the model builds no mask for this implementation).

    Returns:
        ``([1, N, Hq, Dv], None)`` as transformers' attention functions do.

    With ``kwargs[FUSED_CACHE_KWARG]`` (a :class:`FusedStepCache`: the GQA step) ``key`` / ``value``
    are the new rows only, and the attention is the cache's one PagedAttention over the pools.
    """
    fused = kwargs.get(FUSED_CACHE_KWARG)
    if fused is not None:
        return fused.attend(module.layer_idx, query, scaling), None
    q, k, v = query[0], key[0], value[0]  # head-major [H, tokens, D], as transformers hands them
    groups = q.shape[0] // k.shape[0]
    if groups > 1:  # GQA: query head h uses KV head h // groups (transformers' repeat_kv)
        k = k.repeat_interleave(groups, dim=0)
        v = v.repeat_interleave(groups, dim=0)
    out = cached_ragged_attention(
        q, k, v, kwargs[QUERY_SEQ_LENS_KWARG], kwargs[KV_SEQ_LENS_KWARG], scaling, heads_first=True
    )
    return out.transpose(0, 1).unsqueeze(0), None


def register_attention() -> None:
    """Register :func:`paged_attention` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)


@dataclasses.dataclass
class PreparedModel:
    """A causal LM whose attention :func:`prepare_attention` replaced, and what the step reads of it.

    Attributes:
        model: the model (changed in place: its attention modules, and in ``ort`` its dtype).
        attention: :data:`ORT`, :data:`FUSED` or :data:`GATHER`.
        kv_quant: the quantized cache's :class:`~pakv_onnx.models.hf.ort_layer.KvQuant`, or None.
        precision: the :data:`pakv_onnx.providers.PRECISIONS` entry the model runs in.
        rotary: ``ort``: ``(cos, sin)`` ``[max_position_embeddings, rotary_dim / 2]`` in the op's dtype;
            else None.
    """

    model: torch.nn.Module
    attention: str
    kv_quant: object | None
    precision: providers.Precision
    rotary: tuple[torch.Tensor, torch.Tensor] | None


def _form(model: torch.nn.Module, attention: str | None) -> str:
    """The form ``attention`` names for ``model``: None -> ``ort`` where served, else ``pakv``; ``pakv`` ->
    :data:`GATHER` for MLA, :data:`FUSED` for GQA. ``ValueError`` for a form this model has not."""
    mla = bool(getattr(model.config, "kv_lora_rank", None))
    if attention is None:
        attention = ORT if model_type(model.config) in MODEL_TYPES else PAKV
    if attention == PAKV:
        attention = GATHER if mla else FUSED
    if attention not in (ORT, FUSED, GATHER) or (mla and attention == FUSED):
        allowed = (ORT, PAKV, GATHER) if mla else (ORT, PAKV, FUSED, GATHER)
        choices = ", ".join(map(repr, allowed))
        raise ValueError(f"attention must be one of {choices} for this model, got {attention!r}")
    return attention


def prepare_attention(model: torch.nn.Module, attention: str | None = None, kv_quant=None,
                      precision: str = providers.DEFAULT_PRECISION, *, judged: bool = False) -> PreparedModel:  # fmt: skip
    """Replace ``model``'s attention (in place) for a paged step in the ``attention`` form (see the module
    docstring); ``model`` is float32 as loaded (``ort`` casts it to the precision's compute dtype after
    taking the rotary tables). ``judged``: ``attention`` is the form
    :func:`~pakv_onnx.models.hf.servable.judge_export` resolved for this model's config, which checked
    that the model has it (the export's one pass does not go back to the config stage).

    Raises:
        ValueError: a form this model has not (``ort``: :class:`~pakv_onnx.models.hf.servable.UnsupportedAttentionError`),
            ``kv_quant`` outside :data:`ORT`, a precision the form is not exported in, or (pakv forms) a
            sliding-window layer.
    """
    attention = _form(model, attention)
    if attention == ORT and not judged:
        check_supported(model.config)
    if kv_quant is not None and attention != ORT:
        raise ValueError(
            f"a quantized KV cache needs attention {ORT!r} (com.microsoft::PagedAttention), got {attention!r}"
        )
    refusal = providers.precision_refusal(precision, PAKV if attention in (FUSED, GATHER) else attention)
    if refusal:
        raise ValueError(refusal)
    spec = providers.PRECISIONS[precision]
    if attention == ORT:
        from pakv_onnx.models.hf import ort_layer

        attention_dtype = getattr(torch, spec.attention)
        cos, sin = ort_layer.rotary_tables(model)  # float32, before the model's cast
        model.to(getattr(torch, spec.compute))
        ort_layer.replace_attention(model, kv_quant, attention_dtype)
        return PreparedModel(model, attention, kv_quant, spec, (cos.to(attention_dtype), sin.to(attention_dtype)))
    _refuse_windows(model)
    from pakv_onnx.models.hf.mla import absorb_latent_attention

    register_attention()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    absorb_latent_attention(model)  # DeepSeek-V3: MLA in the absorbed form, over the latent as cached
    if attention == FUSED:
        from pakv_onnx.models.hf.gqa import token_major_attention

        token_major_attention(model)  # Llama: q/k/v token-major, as the pakv ops read them
    return PreparedModel(model, attention, None, spec, None)


def _refuse_windows(model: torch.nn.Module) -> None:
    """The pakv ops attend over the whole context: a model with a sliding-window layer is refused."""
    from pakv_onnx.models.hf.ort_layer import sliding_window

    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "o_proj") and sliding_window(module):
            raise ValueError(
                f"layer {module.layer_idx} attends over a sliding window of {sliding_window(module)} tokens: the "
                f"pakv ops attend over the whole context; use attention {ORT!r} (its local_window_size)"
            )
