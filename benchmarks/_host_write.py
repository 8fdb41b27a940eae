"""The host-write step that the in-graph write replaced, kept here as the benchmark's baseline.

Same inputs as the paged step (ORT GenAI's convention) and the same model; the differences are
only where the cache write happens: this graph gathers each sequence's *past* from the pools (no
ScatterPaKvCache), attends over past-then-new rows, and outputs the step's new rows
``new_key_<l>`` / ``new_value_<l>``; the host then copies them into their slots
(``pool.view(-1, H, D).index_copy_``), as the decoders did before issue 21.
"""

from __future__ import annotations

import warnings

import onnx
import torch

from pakv_onnx import runtime_plugin
from pakv_onnx.export import export
from pakv_onnx.models.attention import ragged_attention
from pakv_onnx.models.hf import PagedDecoderStep, PagedKVCache, step_inputs, step_slots
from pakv_onnx.models.hf.step import FIXED_INPUT_NAMES, GATHER, QUERY_SEQ_LENS_KWARG, step_input_names

ATTN = "pakv_host_write"
# The archs this baseline exists for, and why the others have none: it attends over past-then-new rows
# through transformers' AttentionInterface; DeepSeek-V3's absorbed MLA reads the step's new latent rows
# back from the pools it has just written, so its only form is the in-graph write.
BASELINE_ARCHS = ("llama",)
NO_BASELINE = "MLA's absorbed form reads the step's new rows from the pools it writes: no host-write form"
PAST_SEQ_LENS_KWARG = "pakv_past_seq_lens"


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    q, k, v = query[0], key[0], value[0]
    groups = q.shape[0] // k.shape[0]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
    out = ragged_attention(q, k, v, kwargs[QUERY_SEQ_LENS_KWARG], kwargs[PAST_SEQ_LENS_KWARG], scaling, heads_first=True)
    return out.transpose(0, 1).unsqueeze(0), None


class _PastOnlyCache:
    def __init__(self, key_pools, value_pools, block_table, past_seq_lens) -> None:
        self.key_pools, self.value_pools = key_pools, value_pools
        self.block_table, self.past_seq_lens = block_table, past_seq_lens
        self.new_keys = [None] * len(key_pools)
        self.new_values = [None] * len(key_pools)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.new_keys[layer_idx] = key_states[0].transpose(0, 1)
        self.new_values[layer_idx] = value_states[0].transpose(0, 1)
        past_k, past_v = torch.ops.pakv.gather_pa_kv_cache(
            self.key_pools[layer_idx], self.value_pools[layer_idx], self.block_table, self.past_seq_lens, None,
            "Norm", True,
        )  # fmt: skip
        keys = torch.cat((past_k.to(key_states.dtype).transpose(0, 1).unsqueeze(0), key_states), dim=2)
        values = torch.cat((past_v.to(value_states.dtype).transpose(0, 1).unsqueeze(0), value_states), dim=2)
        return keys, values


class HostWriteStep(PagedDecoderStep):
    """The paged step without the in-graph write (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from transformers import AttentionInterface

        super().__init__(model, attention=GATHER)  # its own attention function, not the fused op
        AttentionInterface.register(ATTN, _attention)
        self.model.set_attn_implementation(ATTN)

    def forward(self, input_ids, cumulative_sequence_lengths, past_sequence_lengths, block_table, key_pools, value_pools):
        cu = cumulative_sequence_lengths
        positions, _ = step_slots(input_ids.shape[0], cu, past_sequence_lengths, block_table, key_pools[0].shape[1])
        past_cu = torch.cat((cu[:1], past_sequence_lengths.cumsum(0).to(cu.dtype)))
        cache = _PastOnlyCache(list(key_pools), list(value_pools), block_table, past_cu)
        out = self.model(
            input_ids=input_ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            cache=cache,
            logits_to_keep=cu[1:].to(torch.int64) - 1,
            **{QUERY_SEQ_LENS_KWARG: cu, PAST_SEQ_LENS_KWARG: past_cu},
        )
        return (out.logits[0], *cache.new_keys, *cache.new_values)


def output_names(layers: int) -> list[str]:
    return ["logits", *(f"new_key_{i}" for i in range(layers)), *(f"new_value_{i}" for i in range(layers))]


def export_host_write(model: torch.nn.Module, feeds: dict, path) -> None:
    step = HostWriteStep(model)
    layers = step.num_layers
    dyn = torch.export.Dim.DYNAMIC
    args = (
        *(feeds[n] for n in FIXED_INPUT_NAMES),
        [feeds[f"past_key_values.{i}.key"] for i in range(layers)],
        [feeds[f"past_key_values.{i}.value"] for i in range(layers)],
    )
    pools = [{0: dyn} for _ in range(layers)]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="While compiling, we found certain side effects")
        export(
            step.eval(), args, path, dynamic_shapes=({0: dyn}, {0: dyn}, {0: dyn}, {0: dyn, 1: dyn}, pools, list(pools)),
            input_names=step_input_names(layers), output_names=output_names(layers),
        )  # fmt: skip
    # ORT's optimizer fuses Sigmoid x Mul into com.microsoft's QuickGelu at load, and fails ("QuickGelu(-1)
    # is not a registered function/op") in a model that does not import that domain: import it.
    graph = onnx.load(str(path))
    if all(opset.domain != "com.microsoft" for opset in graph.opset_import):
        graph.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
        onnx.save(graph, str(path))


def host_write_step(session, cache: PagedKVCache, seq_ids: list[int], tokens: list[list[int]]) -> dict:
    """One step of the baseline: run, then copy each layer's new rows into their slots on the host."""
    counts, layout, feeds = step_inputs(cache, seq_ids, tokens)
    outputs = runtime_plugin.run(session, feeds)
    for layer in range(len(cache.key_pools)):
        for pool, rows in ((cache.key_pools[layer], outputs[f"new_key_{layer}"]), (cache.value_pools[layer], outputs[f"new_value_{layer}"])):
            pool.view(-1, *pool.shape[2:]).index_copy_(0, layout.slots, rows.to(pool.dtype))
    cache.commit(seq_ids, counts, {})
    return outputs
