"""The names a paged decoder step is built and run with, shared by every stage of its export, none of
which imports a later one back: the attention forms a step takes (:data:`ORT`, :data:`PAKV`, ...), and
what the step passes to its layers' attention through transformers' ``**kwargs`` (and the attention
implementation it registers), read by the step (:mod:`~pakv_onnx.models.hf.step`) and the attention
modules installed before it (:mod:`~pakv_onnx.models.hf.forms`, :mod:`~pakv_onnx.models.hf.gqa`,
:mod:`~pakv_onnx.models.hf.mla`, :mod:`~pakv_onnx.models.hf.ort_layer`)."""

from __future__ import annotations

# How a step's layers attend: ORT's com.microsoft::PagedAttention (rotary, the write and attention in one
# op, slots derived inside it: every model of servable.MODEL_TYPES, the default), or the pakv ops --
# ScatterPaKvCache, then one pakv::PagedAttention over the pools (GQA) or GatherPaKvCache + a Loop of
# standard ops per sequence (MLA) -- which stock ORT runs through their fallback functions.
ORT, FUSED, GATHER = "ort", "fused", "gather"
# The names `pakv-onnx export --attention` takes: "ort", or "pakv" (FUSED for GQA, GATHER for MLA).
PAKV = "pakv"
ATTENTION_CHOICES = (ORT, PAKV)

ATTN_IMPLEMENTATION = "pakv_paged"  # transformers' attn_implementation name of the pakv form
QUERY_SEQ_LENS_KWARG = "pakv_query_seq_lens"  # [B + 1] cumulative new-token counts of the step
KV_SEQ_LENS_KWARG = "pakv_kv_seq_lens"  # [B + 1] cumulative past + new lengths
FUSED_CACHE_KWARG = "pakv_fused_cache"  # the step's FusedStepCache (GQA's pakv form)
ORT_STATE_KWARG = "pakv_ort_state"  # the step's OrtStepState (the ort form)
