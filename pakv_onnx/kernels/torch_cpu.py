"""The ``torch`` backend: one vectorised ``index_select`` per output, on any torch device.

The caches are viewed as rows of whole tokens (Norm) or of 32-byte fractals (PA_NZ) and
gathered by a precomputed int64 row index straight into the outputs, through a same-width
integer view so every contract dtype (fp8, uint16, ...) takes the same path.
"""

from __future__ import annotations

import torch

from pakv_onnx.kernels import Backend
from pakv_onnx.spec import CacheMode, GatherPlan, bits_view


def _gather_one(
    plan: GatherPlan, cache: torch.Tensor, out: torch.Tensor, block: torch.Tensor, slot: torch.Tensor
) -> None:
    src = bits_view(cache)
    dst = bits_view(out)
    bs = plan.block_size
    if plan.cache_mode is CacheMode.NORM:
        # [nb, bs, H, D] -> [nb*bs, H*D]; token row = block*bs + slot.
        rows = src.reshape(plan.num_blocks * bs, -1)
        index = block * bs + slot
        torch.index_select(rows, 0, index.to(rows.device), out=dst.view(plan.num_tokens, -1))
        return
    # [nb, F, bs, E] -> [nb*F*bs, E]; fractal f of a token is row (block*F + f)*bs + slot.
    fractals, last = cache.shape[1], cache.shape[3]
    rows = src.reshape(-1, last)
    f = torch.arange(fractals)
    index = ((block[:, None] * fractals + f[None, :]) * bs + slot[:, None]).reshape(-1)
    torch.index_select(rows, 0, index.to(rows.device), out=dst.view(plan.num_tokens * fractals, last))


def gather_torch(
    plan: GatherPlan,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_out: torch.Tensor,
    value_out: torch.Tensor,
) -> None:
    """Vectorised gather into ``key_out`` / ``value_out`` (shapes as in the plan)."""
    if plan.num_tokens == 0:
        return
    block, slot = plan.token_slots()
    _gather_one(plan, key_cache, key_out, block, slot)
    _gather_one(plan, value_cache, value_out, block, slot)


BACKEND = Backend(
    name="torch",
    description="vectorised torch index_select on a precomputed token index (any device)",
    gather=gather_torch,
)
