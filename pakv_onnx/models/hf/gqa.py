"""Llama's attention written token-major for the fused paged step: q/k/v stay ``[N, H, D]`` end to end.

transformers' ``LlamaAttention`` turns each projection head-major (``view`` + ``transpose`` to
``[1, H, N, D]``), rotates it there, and the fused step then turns it back (``[N, H, D]``: what
ScatterPaKvCache and PagedAttention read), so every tensor pays a ``Transpose`` and a ``Gather``
each way: on a CPU at decode sizes each node costs microseconds whatever its work. Here the
projections are viewed ``[1, N, H, D]`` (a ``Reshape``), rotated there (cos / sin broadcast at
dim 2; :func:`~pakv_onnx.models.hf.fusion.fuse_step` turns it into one ``RotaryEmbedding`` on the
``[1, N, H * D]`` projection) and viewed ``[N, H, D]``; the attention's ``[N, Hq, Dv]`` is viewed
``[1, N, Hq * Dv]`` for ``o_proj``. Same weights, same arithmetic as ``LlamaAttention``.

:func:`token_major_attention` puts :class:`TokenMajorAttention` in place of each ``LlamaAttention``
(exactly that class: subclasses and other architectures, e.g. with q/k norms, keep theirs) of the
model a fused :class:`~pakv_onnx.models.hf.step.PagedDecoderStep` wraps (that model only).
"""

from __future__ import annotations

import torch

from pakv_onnx.models.hf.kwargs import FUSED_CACHE_KWARG


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's (non-interleaved) rotary embedding of ``x`` ``[1, N, H, D]`` by ``cos`` / ``sin`` ``[1, N, D]``."""
    from transformers.models.llama.modeling_llama import rotate_half

    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + rotate_half(x) * sin


class TokenMajorAttention(torch.nn.Module):
    """A ``LlamaAttention`` (its projections shared, not copied) over one fused paged step."""

    def __init__(self, attention: torch.nn.Module) -> None:
        super().__init__()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, getattr(attention, name))
        self.layer_idx, self.head_dim, self.scaling = attention.layer_idx, attention.head_dim, attention.scaling
        self.q_heads = attention.config.num_attention_heads
        self.kv_heads = attention.config.num_key_value_heads

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        """``hidden_states`` fp32 ``[1, N, hidden]`` (the step's packed tokens) -> ``([1, N, hidden], None)``.

        ``kwargs[FUSED_CACHE_KWARG]`` is the step's :class:`~pakv_onnx.models.hf.cache.FusedStepCache`:
        it writes the new K/V rows and attends over the updated pools. ``attention_mask`` is unused
        (the attention op is causal per sequence).
        """
        cache = kwargs[FUSED_CACHE_KWARG]
        tokens, dim = hidden_states.shape[1], self.head_dim
        cos, sin = position_embeddings
        query = _rotate(self.q_proj(hidden_states).view(1, tokens, self.q_heads, dim), cos, sin)
        key = _rotate(self.k_proj(hidden_states).view(1, tokens, self.kv_heads, dim), cos, sin)
        value = self.v_proj(hidden_states).view(tokens, self.kv_heads, dim)
        cache.write(key.view(tokens, self.kv_heads, dim), value, self.layer_idx)
        out = cache.attend_packed(self.layer_idx, query.view(tokens, self.q_heads, dim), self.scaling)
        return self.o_proj(out.to(hidden_states.dtype).view(1, tokens, -1)), None


def token_major_attention(model: torch.nn.Module) -> int:
    """Replace every ``LlamaAttention`` of ``model`` (in place, that exact class) by a
    :class:`TokenMajorAttention` over the same weights; returns how many were replaced."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is LlamaAttention:
                setattr(parent, name, TokenMajorAttention(child))
                replaced += 1
    return replaced
