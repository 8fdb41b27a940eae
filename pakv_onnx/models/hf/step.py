"""One model step over a paged cache, as a module that exports to one ONNX graph (ORT GenAI's
paged-model convention).

A step takes a batch of live sequences, each with ``n >= 1`` new tokens (a prompt chunk or one
decoded token: prefill and decode are the same graph), packed as ``input_ids [N]``. The graph
computes each token's position and cache slot from the step's inputs, and every layer writes its
new K/V rows into its pools with ScatterPaKvCache and reads past + new back through the updated
pools with GatherPaKvCache (:class:`~pakv_onnx.models.hf.cache.StepCache`), then attends per
sequence through :func:`~pakv_onnx.models.hf.forms.paged_attention`, registered with transformers'
``AttentionInterface`` — no transformers module is patched. No host write remains. The model's
attention is replaced before the step wraps it (:func:`~pakv_onnx.models.hf.forms.prepare_attention`).
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
from pakv_onnx.models.hf.configs import CacheGeometry, cache_geometry
from pakv_onnx.models.hf.forms import PreparedModel, prepare_attention
from pakv_onnx.models.hf.kwargs import ATTENTION_CHOICES, GATHER, PAKV  # noqa: F401  (the forms' names, read from here too)
from pakv_onnx.models.hf.kwargs import FUSED, FUSED_CACHE_KWARG, KV_SEQ_LENS_KWARG, ORT, QUERY_SEQ_LENS_KWARG

FIXED_INPUT_NAMES = ("input_ids", "cumulative_sequence_lengths", "past_sequence_lengths", "block_table")
LOGITS_BATCH_DIM = "batch_size"
# Causal LMs whose logits are exactly ``lm_head`` of the decoder's (``.model``) last hidden states:
# the step applies the head to each sequence's last row itself.
HEAD_OVER_HIDDEN = frozenset({"LlamaForCausalLM", "DeepseekV3ForCausalLM"})


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

    ``model``: a transformers causal LM, whose attention is replaced here
    (:func:`~pakv_onnx.models.hf.forms.prepare_attention` with ``attention``, ``kv_quant``, ``precision``),
    or a :class:`~pakv_onnx.models.hf.forms.PreparedModel` (replaced already; the other arguments unused).

    Raises:
        ValueError: an attention form this model has not, ``kv_quant`` outside :data:`ORT`, or a precision
            the form is not exported in.
    """

    def __init__(self, model: torch.nn.Module | PreparedModel, attention: str | None = None, kv_quant=None,
                 precision: str = providers.DEFAULT_PRECISION) -> None:  # fmt: skip
        super().__init__()
        prepared = model if isinstance(model, PreparedModel) else prepare_attention(model, attention, kv_quant, precision)
        model = prepared.model
        self.head_apart = type(model).__name__ in HEAD_OVER_HIDDEN
        self.kv_quant = prepared.kv_quant
        self.precision = prepared.precision
        if prepared.rotary is not None:
            self.register_buffer("rotary_cos", prepared.rotary[0], persistent=False)
            self.register_buffer("rotary_sin", prepared.rotary[1], persistent=False)
        self.model = model.eval()
        self.num_layers = model.config.num_hidden_layers
        self.attention = prepared.attention

    def geometry(self, *, same_shape: bool = False) -> CacheGeometry:
        """The per-token shapes of the pools this step reads (:func:`~pakv_onnx.models.hf.configs.cache_geometry`
        of its model, LATENT's one pool in :data:`ORT` form)."""
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


def trace_feeds(step: PagedDecoderStep, block_size: int, geometry: CacheGeometry | None = None) -> dict[str, torch.Tensor]:
    """One step's feeds to trace ``step`` on: two sequences, the first with ``block_size + 1`` cached tokens
    and 2 new, the second with 2 cached and 3 new (every dim >= 2, so torch.export keeps them dynamic),
    over zero pools of 16 blocks (num_blocks is dynamic) shaped as og.Engine allocates them: one shape
    for every pool (``geometry``; default the step's own, ``same_shape``), in the step's element type."""
    geometry = geometry or step.geometry(same_shape=True)
    past, new = [block_size + 1, 2], [2, 3]
    blocks = [-(-(p + n) // block_size) for p, n in zip(past, new)]
    table = torch.full((len(blocks), max(blocks)), -1, dtype=torch.int32)
    first = 0
    for row, count in enumerate(blocks):
        table[row, :count] = torch.arange(first, first + count, dtype=torch.int32)
        first += count
    feeds = {
        "input_ids": torch.arange(4, 4 + sum(new), dtype=torch.int64),
        "cumulative_sequence_lengths": torch.tensor([0, *new], dtype=torch.int32).cumsum(0).to(torch.int32),
        "past_sequence_lengths": torch.tensor(past, dtype=torch.int32),
        "block_table": table,
    }
    num_blocks = max(16, first)
    for layer in range(step.num_layers):
        feeds[PAST_KEY.format(layer)] = torch.zeros(num_blocks, block_size, *geometry.key_shape, dtype=step.pool_dtype)
        feeds[PAST_VALUE.format(layer)] = torch.zeros(num_blocks, block_size, *geometry.value_shape, dtype=step.pool_dtype)
    return feeds


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
