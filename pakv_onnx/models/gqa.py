"""Grouped-query attention over a paged K/V cache (Llama-style: 32 query heads, 8 KV heads).

Gathers K and V ``[T, 8, 128]`` (BF16) with GatherPaKvCache, repeats each KV head for its
group of query heads, runs causal attention per sequence in fp32 and projects the output.
"""

from __future__ import annotations

import torch

from pakv_onnx.models.attention import ragged_attention, seeded_linear
from pakv_onnx.models.batch import PagedBatch, random_paged_batch
from pakv_onnx.models.paged_model import PagedAttentionModel


class GqaPagedAttention(PagedAttentionModel):
    """GQA over paged caches ``[num_blocks, block_size, kv_heads, head_dim]``."""

    def __init__(
        self,
        *,
        num_heads: int = 32,
        num_kv_heads: int = 8,
        head_dim: int = 128,
        hidden_size: int = 1024,
        block_size: int = 16,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        generator = torch.Generator().manual_seed(seed)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.hidden_size, self.block_size = hidden_size, block_size
        self.q_proj = seeded_linear(hidden_size, num_heads * head_dim, generator)
        self.o_proj = seeded_linear(num_heads * head_dim, hidden_size, generator)

    def attend(
        self, hidden_states: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seq_lens: torch.Tensor
    ) -> torch.Tensor:
        tokens = hidden_states.shape[0]
        group = self.num_heads // self.num_kv_heads
        q = self.q_proj(hidden_states).reshape(tokens, self.num_heads, self.head_dim)
        k = key.to(torch.float32).repeat_interleave(group, dim=1)
        v = value.to(torch.float32).repeat_interleave(group, dim=1)
        attended = ragged_attention(q, k, v, seq_lens, torch.zeros_like(seq_lens))  # every token is new
        attended = attended.reshape(tokens, self.num_heads * self.head_dim)
        return self.o_proj(attended)

    def random_batch(self, num_tokens: int, num_seqs: int, seed: int) -> PagedBatch:
        shape = (self.num_kv_heads, self.head_dim)
        return random_paged_batch(
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            block_size=self.block_size,
            key_token_shape=shape,
            value_token_shape=shape,
            seed=seed,
        )
