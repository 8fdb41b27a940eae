"""Each decoder layer's attention as one ONNX Runtime ``com.microsoft::PagedAttention``: rotary, the
cache write and attention in one op, its slots derived inside it from the block table.

This is the form ORT GenAI's own paged models take (its builder writes the same op, a packed QKV
projection feeding it). Here transformers' decoder layers stay as they are and only each attention
module is replaced (same weights):

- :class:`OrtGqaAttention` (Llama, Qwen2, Mistral, Qwen3): one packed QKV projection (q, k, v weights
  side by side, Qwen2's biases too) ``[N, (Hq + 2 Hk) D]`` straight into the op, rotary inside it
  (``do_rotary=1``, cos/sin tables from the model's own rotary embedding, so every rope scaling of it
  is kept), Qwen3's q/k RMSNorm inside it (``q_norm_weight`` / ``k_norm_weight``), a sliding window
  as ``local_window_size`` (transformers' ``kv_idx > q_idx - W``: the W positions ending at the
  token, the op's convention), then ``o_proj``.
- :class:`OrtLatentAttention` (DeepSeek-V3): MLA's absorbed form (:mod:`~pakv_onnx.models.hf.mla`)
  over ``kv_cache_layout="LATENT"``: one cache per layer ``[nb, bs, 1, kv_lora_rank + rope]`` holding
  ``[c_kv | k_pe]``, V its leading ``kv_lora_rank`` channels, rotary at ``rotary_offset =
  kv_lora_rank`` (interleaved pairs when ``config.rope_interleave``), the model's explicit scale.

The step (:class:`~pakv_onnx.models.hf.step.PagedDecoderStep` with ``attention="ort"``) runs the
embedding, these layers over the packed tokens ``[N, hidden]`` (2-D: no reshapes), the final norm
and the LM head of each sequence's last row; no position or slot is computed in the graph. Each
layer's op gets the step's own inputs (``cumulative_sequence_lengths``, ``past_sequence_lengths``,
``block_table``) and its pools; traced, it is ``torch.ops.pakv.ort_paged_attention_functional``
(one node whose cache outputs are the step's ``present.<l>.*``), eager the in-place op.

Quantized caches (:class:`KvQuant`): int8 or float8e4m3fn pools with per-channel scales
``[Hk, 1, D]`` (LATENT: ``[1, 1, D]``, keys only), fixed in the graph as initializers.
"""

from __future__ import annotations

import dataclasses

import torch

import pakv_onnx.export  # noqa: F401  registers torch.ops.pakv.ort_paged_attention*
from pakv_onnx.models.hf.kwargs import ORT_STATE_KWARG
from pakv_onnx.models.hf.servable import UnsupportedAttentionError

# The op's cache element types, by the --kv-cache name, and the largest magnitude each stores.
KV_CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
KV_CACHE_QMAX = {"int8": 127.0, "fp8": 448.0}
KV_CACHE_OP_DTYPE = {"int8": "int8", "fp8": "float8e4m3fn"}


@dataclasses.dataclass(frozen=True)
class KvQuant:
    """A quantized KV cache: element type and fixed per-channel scales, one pair per layer.

    Attributes:
        kind: ``"int8"`` or ``"fp8"`` (float8e4m3fn).
        key_scales / value_scales: per layer fp32 ``[Hk, 1, D]`` (PER_CHANNEL: the op stores
            ``x / scale`` rounded, reads ``e * scale``); LATENT has no value scales (empty list).
    """

    kind: str
    key_scales: list[torch.Tensor]
    value_scales: list[torch.Tensor]

    @property
    def dtype(self) -> torch.dtype:
        return KV_CACHE_DTYPES[self.kind]


def rotary_tables(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` fp32 ``[max_position_embeddings, rotary_dim / 2]``: the model's own rotary embedding
    (``model.model.rotary_emb``, its scaling and attention factor included) at every position, the
    first half of its ``cat(freqs, freqs)`` columns (what the op reads per pair).

    Raises:
        UnsupportedAttentionError: the embedding's two halves differ (not a rotate-half / pair rotary).
    """
    rotary = model.model.rotary_emb
    positions = torch.arange(model.config.max_position_embeddings).unsqueeze(0)
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = cos[0].to(torch.float32), sin[0].to(torch.float32)
    half = cos.shape[-1] // 2
    for table in (cos, sin):
        if not torch.equal(table[:, :half], table[:, half:]):
            raise UnsupportedAttentionError("the rotary embedding is not cat(freqs, freqs): no pair table for the op")
    return cos[:, :half].contiguous(), sin[:, :half].contiguous()


@dataclasses.dataclass
class OrtStepState:
    """One step's inputs every layer's op reads, and the pools it updates (traced: the functional op's
    cache outputs replace :attr:`key_pools` / :attr:`value_pools` entries; they are the step's outputs)."""

    key_pools: list[torch.Tensor]
    value_pools: list[torch.Tensor]
    cumulative_sequence_lengths: torch.Tensor
    past_sequence_lengths: torch.Tensor
    block_table: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    def attend(self, layer: int, query: torch.Tensor, *, latent: bool = False, **inputs_and_attributes) -> torch.Tensor:
        """Layer ``layer``'s com.microsoft::PagedAttention of ``query`` (packed QKV, or LATENT's query
        with ``key=``) over its pools; returns the op's output ``[N, Hq * Dv]`` in ``query``'s dtype.

        The op's T is the rotary tables' dtype: a query (and key) of another dtype (the bf16 precision's
        float32 activations) is cast to it, and the output back."""
        inputs = {name: inputs_and_attributes.pop(name, None) for name in _OPTIONAL_INPUTS}
        activations, attention_dtype = query.dtype, self.cos.dtype
        query = query.to(attention_dtype)
        if inputs["key"] is not None:
            inputs["key"] = inputs["key"].to(attention_dtype)
        key_pool = self.key_pools[layer]
        value_pool = None if latent else self.value_pools[layer]
        args = (
            query, inputs["key"], None, key_pool, value_pool, self.cumulative_sequence_lengths,
            self.past_sequence_lengths, self.block_table, self.cos, self.sin, None, None,
            inputs["q_norm_weight"], inputs["k_norm_weight"], inputs["k_scale"], inputs["v_scale"], None,
        )  # fmt: skip
        if torch.compiler.is_exporting() or torch.compiler.is_compiling():
            out, key_pool, value_pool = torch.ops.pakv.ort_paged_attention_functional(*args, **inputs_and_attributes)
            self.key_pools[layer] = key_pool
            if not latent:
                self.value_pools[layer] = value_pool
            return out.to(activations)
        return torch.ops.pakv.ort_paged_attention(*args, **inputs_and_attributes).to(activations)


_OPTIONAL_INPUTS = ("key", "q_norm_weight", "k_norm_weight", "k_scale", "v_scale")


def _register_quant(module: torch.nn.Module, quant: KvQuant | None, layer: int, latent: bool) -> None:
    """Keep layer ``layer``'s cache scales as buffers of ``module`` (initializers of the exported graph)
    and the op's quantization attributes in ``module.quant_attributes``."""
    module.quant_attributes = {}
    if quant is None:
        return
    dtype = KV_CACHE_OP_DTYPE[quant.kind]
    module.register_buffer("k_scale", quant.key_scales[layer].to(torch.float32).contiguous(), persistent=False)
    module.quant_attributes.update(k_quant_type="PER_CHANNEL", k_cache_dtype=dtype)
    if not latent:
        module.register_buffer("v_scale", quant.value_scales[layer].to(torch.float32).contiguous(), persistent=False)
        module.quant_attributes.update(v_quant_type="PER_CHANNEL", v_cache_dtype=dtype)


def _quant_inputs(module: torch.nn.Module) -> dict:
    """The op's scale inputs and quantization attributes of ``module`` (see :func:`_register_quant`)."""
    inputs = dict(module.quant_attributes)
    for name in ("k_scale", "v_scale"):
        if hasattr(module, name):
            inputs[name] = getattr(module, name)
    return inputs


def sliding_window(attention: torch.nn.Module) -> int | None:
    """The layer's sliding window W (keys at positions ``q - W < k <= q``), or None: Qwen2/Qwen3 set
    ``attention.sliding_window`` per layer (None on full layers); Mistral's attention has none and its
    mask follows ``config.sliding_window`` on every layer."""
    if hasattr(attention, "sliding_window"):
        return attention.sliding_window
    return getattr(attention.config, "sliding_window", None)


class OrtGqaAttention(torch.nn.Module):
    """A GQA attention module (Llama, Qwen2, Mistral, Qwen3; its weights packed once, o_proj shared) as
    one com.microsoft::PagedAttention over the step's pools (see the module docstring)."""

    def __init__(self, attention: torch.nn.Module, quant: KvQuant | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        config = attention.config
        self.layer_idx, self.scaling = attention.layer_idx, float(attention.scaling)
        self.q_heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = attention.head_dim
        projections = [attention.q_proj, attention.k_proj, attention.v_proj]
        biased = [p.bias is not None for p in projections]
        if any(biased) and not all(biased):
            raise UnsupportedAttentionError(f"layer {self.layer_idx}: q/k/v projections differ in having a bias")
        width = sum(p.out_features for p in projections)
        weights = attention.q_proj.weight  # the packed projection keeps the model's dtype
        self.qkv = torch.nn.Linear(attention.q_proj.in_features, width, bias=all(biased), dtype=weights.dtype)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([p.weight for p in projections]))
            if all(biased):
                self.qkv.bias.copy_(torch.cat([p.bias for p in projections]))
        self.o_proj = attention.o_proj
        norms = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
        self.qk_norm_epsilon = float(norms[0].variance_epsilon) if norms[0] is not None else None
        if self.qk_norm_epsilon is not None:
            dtype = dtype or norms[0].weight.dtype  # the op's T
            self.register_buffer("q_norm_weight", norms[0].weight.detach().to(dtype).clone(), persistent=False)
            self.register_buffer("k_norm_weight", norms[1].weight.detach().to(dtype).clone(), persistent=False)
        window = sliding_window(attention)
        self.window = int(window) if window else -1
        _register_quant(self, quant, self.layer_idx, latent=False)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        """``hidden_states`` ``[N, hidden]`` (the model's dtype; the step's packed tokens) -> ``([N, hidden], None)``;
        ``kwargs[ORT_STATE_KWARG]`` is the step's :class:`OrtStepState`."""
        state: OrtStepState = kwargs[ORT_STATE_KWARG]
        extra = _quant_inputs(self)
        if self.qk_norm_epsilon is not None:
            extra.update(q_norm_weight=self.q_norm_weight, k_norm_weight=self.k_norm_weight,
                         qk_norm_epsilon=self.qk_norm_epsilon)  # fmt: skip
        out = state.attend(
            self.layer_idx, self.qkv(hidden_states), num_heads=self.q_heads, kv_num_heads=self.kv_heads,
            scale=self.scaling, do_rotary=1, local_window_size=self.window, **extra,
        )  # fmt: skip
        return self.o_proj(out), None


class OrtLatentAttention(torch.nn.Module):
    """A ``DeepseekV3Attention`` in MLA's absorbed form over one LATENT cache (see the module docstring)."""

    def __init__(self, attention: torch.nn.Module, quant: KvQuant | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        from pakv_onnx.models.hf.mla import AbsorbedLatentAttention

        absorbed = AbsorbedLatentAttention(attention)  # its weights and W_UK / W_UV cut per head
        shared = ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "o_proj")
        for name in shared:
            setattr(self, name, getattr(absorbed, name))
        self.k_absorb, self.v_absorb = absorbed.k_absorb, absorbed.v_absorb
        self.layer_idx, self.num_heads, self.scaling = absorbed.layer_idx, absorbed.num_heads, float(absorbed.scaling)
        self.rank, self.rope, self.nope, self.v_dim = absorbed.rank, absorbed.rope, absorbed.nope, absorbed.v_dim
        self.interleaved = int(absorbed.rope_interleave)
        _register_quant(self, quant, self.layer_idx, latent=True)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        """``hidden_states`` ``[N, hidden]`` (the model's dtype) -> ``([N, hidden], None)`` (see :class:`OrtGqaAttention`)."""
        state: OrtStepState = kwargs[ORT_STATE_KWARG]
        tokens, heads = hidden_states.shape[0], self.num_heads
        if self.q_proj is not None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q_nope, q_pe = q.view(tokens, heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([self.rank, self.rope], dim=-1)
        latent = torch.cat((self.kv_a_layernorm(c_kv), k_pe), dim=-1)  # [N, rank + rope], k_pe rotated by the op
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.k_absorb).transpose(0, 1)  # [N, H, rank]
        query = torch.cat((q_latent, q_pe), dim=-1).reshape(tokens, heads * (self.rank + self.rope))
        out = state.attend(
            self.layer_idx, query, latent=True, key=latent, num_heads=heads, kv_num_heads=1, scale=self.scaling,
            do_rotary=1, rotary_interleaved=self.interleaved, rotary_offset=self.rank, kv_cache_layout="LATENT",
            v_head_size=self.rank, **_quant_inputs(self),
        )  # fmt: skip
        out = torch.bmm(out.view(tokens, heads, self.rank).transpose(0, 1), self.v_absorb)  # [H, N, v_dim]
        return self.o_proj(out.transpose(0, 1).reshape(tokens, heads * self.v_dim)), None


def replace_attention(model: torch.nn.Module, quant: KvQuant | None = None, dtype: torch.dtype | None = None) -> int:
    """Put :class:`OrtGqaAttention` (GQA) / :class:`OrtLatentAttention` (MLA: a config with ``kv_lora_rank``)
    in place of every decoder layer's ``self_attn`` of ``model`` (in place; that model only); returns how
    many were replaced. ``dtype``: the op's T (the q/k norm weights'), default the model's. The model's
    type is one :func:`~pakv_onnx.models.hf.servable.check_supported` accepts (the caller checked:
    :func:`~pakv_onnx.models.hf.forms.prepare_attention`)."""
    wrap = OrtLatentAttention if getattr(model.config, "kv_lora_rank", None) else OrtGqaAttention
    for layer in model.model.layers:
        layer.self_attn = wrap(layer.self_attn, quant, dtype)
    return len(model.model.layers)


def decode_layers(model: torch.nn.Module, input_ids: torch.Tensor, state: OrtStepState) -> torch.Tensor:
    """The decoder over the step's packed tokens: embedding, every layer (attention replaced), final norm;
    ``input_ids`` int64 ``[N]`` -> ``[N, hidden]`` (the model's dtype). transformers' model forward (positions, masks,
    its rotary embedding) is not run: the op reads positions from the step's inputs."""
    hidden = model.model.embed_tokens(input_ids)
    for layer in model.model.layers:
        hidden = layer(hidden, **{ORT_STATE_KWARG: state})
    return model.model.norm(hidden)
