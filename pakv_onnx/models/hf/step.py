"""One model step over a paged cache, as a module that exports to one ONNX graph.

A step takes a batch of live sequences, each with ``n >= 1`` new tokens (a prompt chunk or one
decoded token: prefill and decode are the same graph), packed as ``input_ids [1, N]``. Every layer
reads its past through GatherPaKvCache (:class:`~pakv_onnx.models.hf.cache.StepCache`) and attends
per sequence through :func:`paged_attention`, registered with transformers'
``AttentionInterface`` under :data:`ATTN_IMPLEMENTATION` — no transformers module is patched.

Graph inputs (:func:`step_input_names`): ``input_ids`` int64 ``[1, N]``, ``position_ids`` int64
``[1, N]``, ``query_seq_lens`` int32 ``[B+1]`` (cumulative new tokens), ``seq_lens`` int32 ``[B+1]``
(cumulative past tokens), ``seq_offset`` int32 ``[B]``, ``block_tables`` int32 ``[B, cols]``, then
``key_cache_<l>`` and ``value_cache_<l>`` per layer ``[num_blocks, block_size, H, D]``.
Outputs (:func:`step_output_names`): ``logits`` fp32 ``[B, vocab]`` (each sequence's last new
token) and ``new_key_<l>`` / ``new_value_<l>`` ``[N, H, D]`` (the rows the host writes into the pools).
"""

from __future__ import annotations

import os
import warnings

import onnx
import torch

from pakv_onnx.export import export
from pakv_onnx.models.attention import ragged_attention
from pakv_onnx.models.hf.cache import NEW_KEY_OUTPUT, NEW_VALUE_OUTPUT, PagedKVCache, StepCache, StepLayout

ATTN_IMPLEMENTATION = "pakv_paged"
QUERY_SEQ_LENS_KWARG = "pakv_query_seq_lens"
PAST_SEQ_LENS_KWARG = "pakv_past_seq_lens"
FIXED_INPUT_NAMES = ("input_ids", "position_ids", "query_seq_lens", "seq_lens", "seq_offset", "block_tables")


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: per-sequence causal attention over past-then-new rows.

    Args:
        query: ``[1, Hq, N, Dqk]`` new tokens packed by ``kwargs[QUERY_SEQ_LENS_KWARG]``.
        key, value: ``[1, Hk, P + N, D]`` from :meth:`StepCache.update` (past rows packed by
            ``kwargs[PAST_SEQ_LENS_KWARG]``, then the new rows). ``Hq`` a multiple of ``Hk`` (GQA).
        attention_mask: ignored (None: the model builds no mask for this implementation).

    Returns:
        ``([1, N, Hq, Dv], None)`` as transformers' attention functions do.
    """
    q, k, v = query[0], key[0], value[0]  # head-major [H, tokens, D], as transformers hands them
    groups = q.shape[0] // k.shape[0]
    if groups > 1:  # GQA: query head h uses KV head h // groups (transformers' repeat_kv)
        k = k.repeat_interleave(groups, dim=0)
        v = v.repeat_interleave(groups, dim=0)
    out = ragged_attention(
        q, k, v, kwargs[QUERY_SEQ_LENS_KWARG], kwargs[PAST_SEQ_LENS_KWARG], scaling, heads_first=True
    )
    return out.transpose(0, 1).unsqueeze(0), None


def register_attention() -> None:
    """Register :func:`paged_attention` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)


def step_input_names(num_layers: int) -> list[str]:
    return [
        *FIXED_INPUT_NAMES,
        *(f"key_cache_{layer}" for layer in range(num_layers)),
        *(f"value_cache_{layer}" for layer in range(num_layers)),
    ]


def step_output_names(num_layers: int) -> list[str]:
    return [
        "logits",
        *(NEW_KEY_OUTPUT.format(layer) for layer in range(num_layers)),
        *(NEW_VALUE_OUTPUT.format(layer) for layer in range(num_layers)),
    ]


class PagedDecoderStep(torch.nn.Module):
    """A transformers causal LM run for one step over paged pools (see the module docstring).

    The pools are two named list arguments (not ``*varargs``, whose flat dynamic shapes
    torch.export cannot match).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        register_attention()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model.eval()
        self.num_layers = model.config.num_hidden_layers

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        query_seq_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_offset: torch.Tensor,
        block_tables: torch.Tensor,
        key_pools: list[torch.Tensor],
        value_pools: list[torch.Tensor],
    ) -> tuple[torch.Tensor, ...]:
        cache = StepCache(list(key_pools), list(value_pools), block_tables, seq_lens, seq_offset)
        last_rows = query_seq_lens[1:].to(torch.int64) - 1  # each sequence's last new token
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            cache=cache,
            logits_to_keep=last_rows,
            **{QUERY_SEQ_LENS_KWARG: query_seq_lens, PAST_SEQ_LENS_KWARG: seq_lens},
        )
        return (out.logits[0], *cache.new_keys, *cache.new_values)


def step_feeds(
    cache: PagedKVCache, layout: StepLayout, input_ids: torch.Tensor, position_ids: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The graph's named inputs for one step (torch tensors; pools by reference, not copied)."""
    feeds = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "query_seq_lens": layout.query_seq_lens,
        "seq_lens": layout.seq_lens,
        "seq_offset": layout.seq_offset,
        "block_tables": layout.block_tables,
    }
    for layer, (k, v) in enumerate(zip(cache.key_pools, cache.value_pools)):
        feeds[f"key_cache_{layer}"] = k
        feeds[f"value_cache_{layer}"] = v
    return feeds


def run_step_torch(step: PagedDecoderStep, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The step in eager torch, outputs named like the graph's."""
    layers = step.num_layers
    args = [feeds[name] for name in FIXED_INPUT_NAMES]
    keys = [feeds[f"key_cache_{layer}"] for layer in range(layers)]
    values = [feeds[f"value_cache_{layer}"] for layer in range(layers)]
    with torch.no_grad():
        outputs = step(*args, keys, values)
    return dict(zip(step_output_names(layers), outputs))


def export_step(step: PagedDecoderStep, feeds: dict[str, torch.Tensor], path: str | os.PathLike) -> onnx.ModelProto:
    """Export ``step`` (traced on one step's ``feeds``) to ``path`` with the project's exporter.

    Dynamic: the packed token count N, the batch B, the block-table width and num_blocks.
    Static: block_size and every per-token width (a symbolic block size breaks the export of
    ``pos % block_size``).
    """
    dyn = torch.export.Dim.DYNAMIC
    layers = step.num_layers
    args = (
        *(feeds[name] for name in FIXED_INPUT_NAMES),
        [feeds[f"key_cache_{layer}"] for layer in range(layers)],
        [feeds[f"value_cache_{layer}"] for layer in range(layers)],
    )
    pool_shape = [{0: dyn} for _ in range(layers)]
    dynamic_shapes = (
        {1: dyn},
        {1: dyn},
        {0: dyn},
        {0: dyn},
        {0: dyn},
        {0: dyn, 1: dyn},
        pool_shape,
        list(pool_shape),
    )
    with torch.no_grad(), warnings.catch_warnings():
        # transformers' output-capturing global shows up as a traced side effect; it is not one of ours.
        warnings.filterwarnings("ignore", message="While compiling, we found certain side effects")
        return export(
            step.eval(),
            args,
            path,
            dynamic_shapes=dynamic_shapes,
            input_names=step_input_names(layers),
            output_names=step_output_names(layers),
        )
