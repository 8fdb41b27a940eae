"""The names a paged decoder step passes to its layers' attention through transformers' ``**kwargs``
(and the attention implementation it registers), shared by the step (:mod:`~pakv_onnx.models.hf.step`)
and the attention modules it installs (:mod:`~pakv_onnx.models.hf.gqa`, :mod:`~pakv_onnx.models.hf.mla`,
:mod:`~pakv_onnx.models.hf.ort_layer`), none of which imports the step back."""

from __future__ import annotations

ATTN_IMPLEMENTATION = "pakv_paged"  # transformers' attn_implementation name of the pakv form
QUERY_SEQ_LENS_KWARG = "pakv_query_seq_lens"  # [B + 1] cumulative new-token counts of the step
KV_SEQ_LENS_KWARG = "pakv_kv_seq_lens"  # [B + 1] cumulative past + new lengths
FUSED_CACHE_KWARG = "pakv_fused_cache"  # the step's FusedStepCache (GQA's pakv form)
ORT_STATE_KWARG = "pakv_ort_state"  # the step's OrtStepState (the ort form)
