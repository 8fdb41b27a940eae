"""DeepSeek-V2/V3-style MLA context attention over a paged latent cache.

The paged caches hold what MLA caches per token: the compressed KV latent
(``key_cache [num_blocks, 128, 1, 512]``) and the shared rope key
(``value_cache [num_blocks, 128, 1, 64]``), both BF16 — the seed sweep's shapes. The model
gathers both, up-projects the latent into per-head no-rope keys and values, appends the
rope key to every head, runs causal attention per sequence and projects the output.
Attention math is fp32 (ONNX Runtime's CPU provider has no BF16 MatMul).
"""

from __future__ import annotations

import torch

from pakv_onnx.models.attention import ragged_attention, seeded_linear
from pakv_onnx.models.batch import PagedBatch, random_paged_batch
from pakv_onnx.models.paged_model import PagedAttentionModel


class MlaContextAttention(PagedAttentionModel):
    """MLA prefill/context attention; gathered key = latent ``[T, 1, 512]``, value = rope ``[T, 1, 64]``."""

    def __init__(
        self,
        *,
        num_heads: int = 16,
        kv_lora_rank: int = 512,
        rope_dim: int = 64,
        nope_dim: int = 128,
        v_head_dim: int = 128,
        hidden_size: int = 1024,
        block_size: int = 128,
        seed: int = 0,
    ) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.num_heads, self.kv_lora_rank, self.rope_dim = num_heads, kv_lora_rank, rope_dim
        self.nope_dim, self.v_head_dim, self.hidden_size = nope_dim, v_head_dim, hidden_size
        self.block_size = block_size
        self.q_proj = seeded_linear(hidden_size, num_heads * (nope_dim + rope_dim), generator)
        self.k_up = seeded_linear(kv_lora_rank, num_heads * nope_dim, generator)
        self.v_up = seeded_linear(kv_lora_rank, num_heads * v_head_dim, generator)
        self.o_proj = seeded_linear(num_heads * v_head_dim, hidden_size, generator)

    def attend(
        self, hidden_states: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seq_lens: torch.Tensor
    ) -> torch.Tensor:
        tokens = hidden_states.shape[0]
        latent = key.reshape(tokens, self.kv_lora_rank).to(torch.float32)
        rope = value.reshape(tokens, 1, self.rope_dim).to(torch.float32)
        q = self.q_proj(hidden_states).reshape(tokens, self.num_heads, self.nope_dim + self.rope_dim)
        k_nope = self.k_up(latent).reshape(tokens, self.num_heads, self.nope_dim)
        k = torch.cat((k_nope, rope.expand(tokens, self.num_heads, self.rope_dim)), dim=-1)
        v = self.v_up(latent).reshape(tokens, self.num_heads, self.v_head_dim)
        attended = ragged_attention(q, k, v, seq_lens, torch.zeros_like(seq_lens))  # every token is new
        attended = attended.reshape(tokens, self.num_heads * self.v_head_dim)
        return self.o_proj(attended)

    def random_batch(self, num_tokens: int, num_seqs: int, seed: int) -> PagedBatch:
        return random_paged_batch(
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            block_size=self.block_size,
            key_token_shape=(1, self.kv_lora_rank),
            value_token_shape=(1, self.rope_dim),
            seed=seed,
        )
