"""Ragged causal attention math shared by the sample models (fp32, exportable to ONNX).

Tokens of a batch of sequences are packed along one axis ``[T, ...]``; ``seq_lens`` is the
cumulative ``[Q+1]`` form of the contract. Every op here exports through the dynamo ONNX
exporter with a data-dependent T.
"""

from __future__ import annotations

import torch


def ragged_causal_mask(seq_lens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Block-diagonal causal mask, bool ``[T, T]``: token i may attend to j iff same sequence and j <= i.

    Args:
        seq_lens: int ``[Q+1]`` cumulative token counts starting at 0.
        num_tokens: T (= ``seq_lens[-1]``).
    """
    token = torch.arange(num_tokens, device=seq_lens.device)
    ends = seq_lens[1:].to(torch.int64)
    # Sequence of token t = number of sequences that end at or before t.
    seq_id = (token[:, None] >= ends[None, :]).sum(dim=-1)
    same_seq = seq_id[:, None] == seq_id[None, :]
    causal = token[None, :] <= token[:, None]
    return same_seq & causal


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product attention over packed tokens.

    Args:
        q: fp32 ``[T, H, Dqk]``; k: fp32 ``[T, H, Dqk]``; v: fp32 ``[T, H, Dv]``.
        mask: bool ``[T, T]``, True where attending is allowed (every row has its diagonal).

    Returns:
        fp32 ``[T, H, Dv]``.
    """
    scale = q.shape[-1] ** -0.5
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    scores = scores.masked_fill(~mask[None, :, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hts,shd->thd", probs, v)


def seeded_linear(in_features: int, out_features: int, generator: torch.Generator) -> torch.nn.Linear:
    """A bias-free fp32 linear layer with deterministic weights (no downloads)."""
    layer = torch.nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=generator) * in_features**-0.5)
    return layer
