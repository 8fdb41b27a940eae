"""One model step over a paged cache, as a module that exports to one ONNX graph (ORT GenAI's
paged-model convention).

A step takes a batch of live sequences, each with ``n >= 1`` new tokens (a prompt chunk or one
decoded token: prefill and decode are the same graph), packed as ``input_ids [N]``. The graph
computes each token's position and cache slot from the step's inputs, and every layer writes its
new K/V rows into its pools with ScatterPaKvCache and reads past + new back through the updated
pools with GatherPaKvCache (:class:`~pakv_onnx.models.hf.cache.StepCache`), then attends per
sequence through :func:`paged_attention`, registered with transformers' ``AttentionInterface``
under :data:`ATTN_IMPLEMENTATION` — no transformers module is patched. No host write remains.
GQA decoders (Llama and the like: every model but MLA's) attend instead with one
``pakv::PagedAttention`` per layer over the updated pools, read in place through the block table
(:class:`~pakv_onnx.models.hf.cache.FusedStepCache`; ``attention=``:data:`FUSED` of
:class:`PagedDecoderStep`); DeepSeek-V3 (MLA) keeps the gather (:data:`GATHER`).
Llama's attention then runs token-major (:mod:`~pakv_onnx.models.hf.gqa`: q/k/v ``[N, H, D]`` as
the pakv ops read them, no transposes), and for the causal LMs of :data:`HEAD_OVER_HIDDEN` the
step applies the LM head to each sequence's last hidden row itself (one Gather).

Graph inputs (:func:`step_input_names`), the names og.Engine feeds: ``input_ids`` int64 ``[N]``,
``cumulative_sequence_lengths`` int32 ``[B+1]`` (cumulative new tokens), ``past_sequence_lengths``
int32 ``[B]`` (tokens already cached), ``block_table`` int32 ``[B, max_blocks]`` (-1 padded), then
``past_key_values.<l>.key`` / ``.value`` per layer ``[num_blocks, block_size, H, D]``.
Outputs (:func:`step_output_names`): ``logits`` fp32 ``[batch_size, vocab]`` (each sequence's last
new token; the dim is named ``batch_size``, which tells og.Engine the rows are per request) and
``present.<l>.key`` / ``.value``: the updated pools, which a host binds to the input pools'
buffers (:func:`present_bindings`) so they are written in place.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping

import onnx
import torch

from pakv_onnx import providers
from pakv_onnx.export import cap_ir_version, export
from pakv_onnx.spec import DOMAIN
from pakv_onnx.models.attention import cached_ragged_attention
from pakv_onnx.models.hf.cache import (
    FusedStepCache,
    PAST_KEY,
    PAST_VALUE,
    PRESENT_KEY,
    PRESENT_VALUE,
    PagedKVCache,
    StepCache,
    StepLayout,
    step_slots,
)
from pakv_onnx.models.hf.kwargs import ATTN_IMPLEMENTATION, FUSED_CACHE_KWARG, KV_SEQ_LENS_KWARG, QUERY_SEQ_LENS_KWARG

# How a step's layers attend: ORT's com.microsoft::PagedAttention (rotary, the write and attention in one
# op, slots derived inside it: every model of ort_layer.MODEL_TYPES, the default), or the pakv ops --
# ScatterPaKvCache, then one pakv::PagedAttention over the pools (GQA) or GatherPaKvCache + a Loop of
# standard ops per sequence (MLA) -- which stock ORT runs through their fallback functions.
ORT, FUSED, GATHER = "ort", "fused", "gather"
# The names `pakv-onnx export --attention` takes: "ort", or "pakv" (FUSED for GQA, GATHER for MLA).
PAKV = "pakv"
ATTENTION_CHOICES = (ORT, PAKV)
FIXED_INPUT_NAMES = ("input_ids", "cumulative_sequence_lengths", "past_sequence_lengths", "block_table")
LOGITS_BATCH_DIM = "batch_size"
# Causal LMs whose logits are exactly ``lm_head`` of the decoder's (``.model``) last hidden states:
# the step applies the head to each sequence's last row itself.
HEAD_OVER_HIDDEN = frozenset({"LlamaForCausalLM", "DeepseekV3ForCausalLM"})


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


def step_input_names(num_layers: int) -> list[str]:
    return [
        *FIXED_INPUT_NAMES,
        *(PAST_KEY.format(layer) for layer in range(num_layers)),
        *(PAST_VALUE.format(layer) for layer in range(num_layers)),
    ]


def step_output_names(num_layers: int) -> list[str]:
    return [
        "logits",
        *(PRESENT_KEY.format(layer) for layer in range(num_layers)),
        *(PRESENT_VALUE.format(layer) for layer in range(num_layers)),
    ]


class PagedDecoderStep(torch.nn.Module):
    """A transformers causal LM run for one step over paged pools (see the module docstring).

    The pools are two named list arguments (not ``*varargs``, whose flat dynamic shapes
    torch.export cannot match). The block size is the pools' (static) second dimension.

    ``attention``: :data:`ORT` (each layer one ``com.microsoft::PagedAttention``, rotary and the write
    inside it, no position or slot computed in the graph: :mod:`~pakv_onnx.models.hf.ort_layer`; the
    default for the models it serves), :data:`PAKV` (the pakv ops: :data:`FUSED` for GQA models,
    :data:`GATHER` for MLA ones), or :data:`FUSED` / :data:`GATHER` by name. ``kv_quant``
    (:data:`ORT` only): int8 / fp8 pools with fixed per-channel scales
    (:class:`~pakv_onnx.models.hf.ort_layer.KvQuant`). ``precision``: a name of
    :data:`pakv_onnx.providers.PRECISIONS` (fp16 and bf16: :data:`ORT` only); ``model`` (float32, as
    loaded) is cast to its compute dtype here, after the rotary tables are taken from it in float32.

    Raises:
        ValueError: an attention form this model has not, ``kv_quant`` outside :data:`ORT`, or a precision
            the form is not exported in.
    """

    def __init__(self, model: torch.nn.Module, attention: str | None = None, kv_quant=None,
                 precision: str = providers.DEFAULT_PRECISION) -> None:  # fmt: skip
        super().__init__()
        from pakv_onnx.models.hf import ort_layer

        mla = bool(getattr(model.config, "kv_lora_rank", None))
        if attention is None:
            supported = ort_layer.model_type(model.config) in ort_layer.MODEL_TYPES
            attention = ORT if supported else PAKV
        if attention == PAKV:
            attention = GATHER if mla else FUSED
        if attention not in (ORT, FUSED, GATHER) or (mla and attention == FUSED):
            allowed = (ORT, PAKV, GATHER) if mla else (ORT, PAKV, FUSED, GATHER)
            choices = ", ".join(map(repr, allowed))
            raise ValueError(f"attention must be one of {choices} for this model, got {attention!r}")
        if kv_quant is not None and attention != ORT:
            raise ValueError(
                f"a quantized KV cache needs attention {ORT!r} (com.microsoft::PagedAttention), got {attention!r}"
            )
        refusal = providers.precision_refusal(precision, PAKV if attention in (FUSED, GATHER) else attention)
        if refusal:
            raise ValueError(refusal)
        if attention != ORT:
            _refuse_windows(model)
        self.head_apart = type(model).__name__ in HEAD_OVER_HIDDEN
        self.kv_quant = kv_quant
        self.precision = providers.PRECISIONS[precision]
        if attention == ORT:
            attention_dtype = getattr(torch, self.precision.attention)
            cos, sin = ort_layer.rotary_tables(model)  # float32, before the model's cast
            model.to(getattr(torch, self.precision.compute))
            ort_layer.replace_attention(model, kv_quant, attention_dtype)
            self.register_buffer("rotary_cos", cos.to(attention_dtype), persistent=False)
            self.register_buffer("rotary_sin", sin.to(attention_dtype), persistent=False)
        else:
            from pakv_onnx.models.hf.mla import absorb_latent_attention  # (mla reads this module's kwarg names)

            register_attention()
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
            absorb_latent_attention(model)  # DeepSeek-V3: MLA in the absorbed form, over the latent as cached
            if attention == FUSED:
                from pakv_onnx.models.hf.gqa import token_major_attention

                token_major_attention(model)  # Llama: q/k/v token-major, as the pakv ops read them
        self.model = model.eval()
        self.num_layers = model.config.num_hidden_layers
        self.attention = attention

    def geometry(self, *, same_shape: bool = False):
        """The per-token shapes of the pools this step reads (:func:`~pakv_onnx.models.hf.configs.cache_geometry`
        of its model, LATENT's one pool in :data:`ORT` form)."""
        from pakv_onnx.models.hf.configs import cache_geometry

        return cache_geometry(self.model.config, same_shape=same_shape, latent_pool=self.latent)

    @property
    def pool_dtype(self) -> torch.dtype:
        """The pools' element type: the precision's attention dtype, or the quantized cache's (int8,
        float8_e4m3fn)."""
        return self.kv_quant.dtype if self.kv_quant is not None else getattr(torch, self.precision.attention)

    @property
    def latent(self) -> bool:
        """Whether the step's layers cache MLA's latent in one LATENT pool each (the value pools unused)."""
        return self.attention == ORT and bool(getattr(self.model.config, "kv_lora_rank", None))

    def forward(
        self,
        input_ids: torch.Tensor,
        cumulative_sequence_lengths: torch.Tensor,
        past_sequence_lengths: torch.Tensor,
        block_table: torch.Tensor,
        key_pools: list[torch.Tensor],
        value_pools: list[torch.Tensor],
    ) -> tuple[torch.Tensor, ...]:
        cu = cumulative_sequence_lengths
        if self.attention == ORT:
            return self._forward_ort(input_ids, cu, past_sequence_lengths, block_table, key_pools, value_pools)
        block_size = key_pools[0].shape[1]
        positions, slots = step_slots(input_ids.shape[0], cu, past_sequence_lengths, block_table, block_size)
        if self.attention == FUSED:
            cache = FusedStepCache(key_pools, value_pools, block_table, cu, past_sequence_lengths, slots)
            attention_kwargs = {FUSED_CACHE_KWARG: cache}
        else:
            new_counts = cu[1:] - cu[:-1]
            kv_seq_lens = torch.cat((cu[:1], (past_sequence_lengths + new_counts).cumsum(0).to(cu.dtype)))
            cache = StepCache(key_pools, value_pools, block_table, kv_seq_lens, slots)
            attention_kwargs = {QUERY_SEQ_LENS_KWARG: cu, KV_SEQ_LENS_KWARG: kv_seq_lens}
        inputs = {"input_ids": input_ids.unsqueeze(0), "position_ids": positions.unsqueeze(0), "cache": cache}
        last_rows = cu[1:] - 1  # each sequence's last new token
        if self.head_apart:  # the head of those rows: a Gather, where logits_to_keep's tensor index is four nodes
            hidden = self.model.model(**inputs, **attention_kwargs).last_hidden_state[0]
            # embedding() of the rows: one Gather by the int32 rows (index_select's export adds a Reshape and a Cast).
            logits = self.model.lm_head(torch.nn.functional.embedding(last_rows, hidden))
        else:
            logits = self.model(**inputs, logits_to_keep=last_rows.to(torch.int64), **attention_kwargs).logits[0]
        return (logits, *cache.key_pools, *cache.value_pools)

    def _forward_ort(self, input_ids, cu, past, block_table, key_pools, value_pools) -> tuple[torch.Tensor, ...]:
        from pakv_onnx.models.hf.ort_layer import OrtStepState, decode_layers

        tables = (self.rotary_cos, self.rotary_sin)
        state = OrtStepState(list(key_pools), list(value_pools), cu, past, block_table, *tables)
        hidden = decode_layers(self.model, input_ids, state)
        logits = self.model.lm_head(torch.nn.functional.embedding(cu[1:] - 1, hidden)).to(torch.float32)
        return (logits, *state.key_pools, *state.value_pools)


def _refuse_windows(model: torch.nn.Module) -> None:
    """The pakv ops attend over the whole context: a model with a sliding-window layer is refused."""
    from pakv_onnx.models.hf.ort_layer import sliding_window

    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "o_proj") and sliding_window(module):
            raise ValueError(
                f"layer {module.layer_idx} attends over a sliding window of {sliding_window(module)} tokens: the "
                f"pakv ops attend over the whole context; use attention {ORT!r} (its local_window_size)"
            )


def step_feeds(cache: PagedKVCache, layout: StepLayout, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The graph's named inputs for one step (torch tensors; pools by reference, not copied).

    ``input_ids``: int64 ``[N]``, every live sequence's new tokens packed in batch order.
    """
    feeds = {
        "input_ids": input_ids,
        "cumulative_sequence_lengths": layout.cumulative_sequence_lengths,
        "past_sequence_lengths": layout.past_sequence_lengths,
        "block_table": layout.block_table,
    }
    for layer, (k, v) in enumerate(zip(cache.key_pools, cache.value_pools)):
        feeds[PAST_KEY.format(layer)] = k
        feeds[PAST_VALUE.format(layer)] = v
    return feeds


def present_bindings(feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{present.<l>.key: the past_key_values.<l>.key feed, ...}``: the outputs to bind to the
    input pools' buffers (IOBinding), so the step's write op writes only its rows into the pools."""
    out = {}
    for name, tensor in feeds.items():
        for past, present in ((PAST_KEY, PRESENT_KEY), (PAST_VALUE, PRESENT_VALUE)):
            prefix, suffix = past.split("{}")
            if name.startswith(prefix) and name.endswith(suffix):
                out[present.format(name[len(prefix) : len(name) - len(suffix)])] = tensor
    return out


def run_step_torch(step: PagedDecoderStep, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The step in eager torch, outputs named like the graph's (the pools are written in place:
    each ``present.<l>.*`` is its input pool)."""
    layers = step.num_layers
    args = [feeds[name] for name in FIXED_INPUT_NAMES]
    keys = [feeds[PAST_KEY.format(layer)] for layer in range(layers)]
    values = [feeds[PAST_VALUE.format(layer)] for layer in range(layers)]
    with torch.no_grad():
        outputs = step(*args, keys, values)
    return dict(zip(step_output_names(layers), outputs))


def export_step(
    step: PagedDecoderStep, feeds: dict[str, torch.Tensor], path: str | os.PathLike | None, *, fuse: bool = True
) -> onnx.ModelProto:
    """Export ``step`` (traced on one step's ``feeds``) with the project's exporter; saved to
    ``path`` unless it is ``None``.

    Dynamic: the packed token count N, the batch B, the block-table width and num_blocks.
    Static: block_size and every per-token width (a symbolic block size breaks the export of
    ``pos % block_size``). The logits' first dim is named ``batch_size`` (og.Engine reads that
    name as "one row per request"). ``fuse`` (default): residual + RMS norm and rotary
    embeddings become ORT's contrib ops (:func:`pakv_onnx.models.hf.fusion.fuse_step`; the
    attention and the ``pakv`` nodes are left as exported).
    """
    dyn = torch.export.Dim.DYNAMIC
    layers = step.num_layers
    values = [feeds[PAST_VALUE.format(layer)] for layer in range(layers)]
    value_shape = [{0: dyn} for _ in range(layers)]
    if step.latent and values[0].shape[-1] < 2:
        # LATENT reads no value pool: traced on an empty one (a host's own pools), its width stays
        # dynamic (any width runs; traced at 2: torch.export pins 0 and 1). og.Engine wants static
        # widths and allocates every pool alike: trace that export on pools of the key's width.
        values = [v.new_zeros(*v.shape[:-1], 2) for v in values]
        value_shape = [{0: dyn, 3: dyn} for _ in range(layers)]
    args = (
        *(feeds[name] for name in FIXED_INPUT_NAMES),
        [feeds[PAST_KEY.format(layer)] for layer in range(layers)],
        values,
    )
    pool_shape = [{0: dyn} for _ in range(layers)]
    dynamic_shapes = ({0: dyn}, {0: dyn}, {0: dyn}, {0: dyn, 1: dyn}, pool_shape, value_shape)
    with torch.no_grad(), warnings.catch_warnings():
        # transformers' output-capturing global shows up as a traced side effect; it is not one of ours.
        warnings.filterwarnings("ignore", message="While compiling, we found certain side effects")
        model = export(
            step.eval(),
            args,
            None,
            dynamic_shapes=dynamic_shapes,
            fallback=step.attention != ORT,  # the ort form has no pakv node to fall back from
            input_names=step_input_names(layers),
            output_names=step_output_names(layers),
        )
    if step.attention == ORT:  # nor a pakv opset to import
        kept = [o for o in model.opset_import if o.domain != DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(kept)
    if fuse:
        from pakv_onnx.models.hf.fusion import fuse_step

        model, _ = fuse_step(model)
    logits = next(o for o in model.graph.output if o.name == "logits")
    logits.type.tensor_type.shape.dim[0].dim_param = LOGITS_BATCH_DIM
    cap_ir_version(model)  # the fusion re-serializes the model
    if path is not None:
        onnx.save_model(model, os.fspath(path))
    return model
