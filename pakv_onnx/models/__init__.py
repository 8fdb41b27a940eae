"""Sample attention graphs that exercise GatherPaKvCache end to end.

- :class:`~pakv_onnx.models.mla.MlaContextAttention`: DeepSeek-style MLA over a paged latent cache
- :class:`~pakv_onnx.models.gqa.GqaPagedAttention`: grouped-query attention over paged K/V
"""

from pakv_onnx.models.gqa import GqaPagedAttention
from pakv_onnx.models.mla import MlaContextAttention
from pakv_onnx.models.paged_model import MODEL_INPUT_NAMES, MODEL_OUTPUT_NAMES, PagedAttentionModel

__all__ = ["MODEL_INPUT_NAMES", "MODEL_OUTPUT_NAMES", "GqaPagedAttention", "MlaContextAttention", "PagedAttentionModel"]
