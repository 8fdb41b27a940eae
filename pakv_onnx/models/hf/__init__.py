"""transformers decoders generating over a paged KV cache read through GatherPaKvCache.

- :mod:`~pakv_onnx.models.hf.configs`: small Llama (GQA) and DeepSeek-V3 (MLA) with seeded weights.
- :mod:`~pakv_onnx.models.hf.cache`: block allocator, per-layer pools, block tables laid out in
  ORT GenAI's paged convention, and the duck-typed ``cache=`` object whose ``update`` writes the
  step's rows with ScatterPaKvCache and reads past + new back with GatherPaKvCache.
- :mod:`~pakv_onnx.models.hf.step`: one step (prefill and decode share it) as an exportable module,
  with the per-sequence attention function registered in transformers' AttentionInterface.
- :mod:`~pakv_onnx.models.hf.generate`: greedy generation over any step runner, the per-step
  pieces a serving engine calls (:func:`step_inputs`, :func:`session_step`, :func:`run_step`), and
  transformers' own ``generate`` as the reference.

Needs the ``hf`` extra (transformers); importing this package does not import transformers.
"""

from pakv_onnx.models.hf.cache import (
    BlockAllocator,
    OutOfBlocksError,
    PagedKVCache,
    StepCache,
    StepLayout,
    step_slots,
)
from pakv_onnx.models.hf.configs import ARCHS, build_model, cache_geometry, make_config, save_sample_folder
from pakv_onnx.models.hf.forms import paged_attention, register_attention
from pakv_onnx.models.hf.generate import (
    Generation,
    Workload,
    compare,
    generate_paged,
    generate_reference,
    make_workload,
    new_cache,
    run_step,
    session_step,
    step_inputs,
)
from pakv_onnx.models.hf.kwargs import ATTN_IMPLEMENTATION
from pakv_onnx.models.hf.step import (
    PagedDecoderStep,
    export_step,
    present_bindings,
    run_step_torch,
    step_feeds,
    step_input_names,
    step_output_names,
)

__all__ = [
    "ARCHS",
    "ATTN_IMPLEMENTATION",
    "BlockAllocator",
    "Generation",
    "OutOfBlocksError",
    "PagedDecoderStep",
    "PagedKVCache",
    "StepCache",
    "StepLayout",
    "Workload",
    "build_model",
    "cache_geometry",
    "compare",
    "export_step",
    "generate_paged",
    "generate_reference",
    "make_config",
    "make_workload",
    "new_cache",
    "paged_attention",
    "present_bindings",
    "register_attention",
    "run_step",
    "run_step_torch",
    "save_sample_folder",
    "session_step",
    "step_feeds",
    "step_input_names",
    "step_inputs",
    "step_output_names",
    "step_slots",
]
