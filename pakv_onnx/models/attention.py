"""Ragged causal attention math shared by the sample models (fp32, exportable to ONNX).

Tokens of a batch of sequences are packed along one axis ``[T, ...]``; ``seq_lens`` is the
cumulative ``[Q+1]`` form of the contract. Every op here exports through the dynamo ONNX
exporter with a data-dependent T.

:func:`ragged_attention` is what the models run: a loop over sequences (``torch.while_loop``,
an ONNX ``Loop``) so attention scores exist for one sequence at a time and memory grows with
the longest sequence's ``len^2``, not with ``T^2`` of the packed batch.
:func:`cached_ragged_attention` is the decoder step's form: each sequence's keys are one run read back
from the cache after the step's own tokens were written into it.
:func:`ragged_causal_mask` + :func:`masked_attention` are the dense ``[T, T]`` form, kept as an
independent reference for tests.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._higher_order_ops.while_loop import while_loop


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


def ragged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_seq_lens: torch.Tensor,
    past_seq_lens: torch.Tensor,
    scale: float | None = None,
    *,
    heads_first: bool = False,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its past and new keys, one sequence at a time.

    Sequence q has ``n_q`` new (query) tokens and ``p_q`` past tokens; its new tokens are its
    last ``n_q`` positions, and query ``j`` attends to the sequence's keys at positions
    ``0 .. p_q + j``. Sequences never see each other.

    Args:
        q: fp32 ``[N, H, Dqk]``, the new tokens packed by ``query_seq_lens``.
        k: fp32 ``[P + N, H, Dqk]``: first the past tokens (``P`` rows, packed by
            ``past_seq_lens``), then the new tokens (``N`` rows, packed like ``q``).
        v: fp32 ``[P + N, H, Dv]``, rows as in ``k``.
        query_seq_lens: int ``[Q+1]`` cumulative new-token counts starting at 0 (ends at N).
        past_seq_lens: int ``[Q+1]`` cumulative past-token counts starting at 0 (ends at P).
        scale: score scale; default ``Dqk ** -0.5``.
        heads_first: every tensor is head-major instead (``q [H, N, Dqk]``, ``k [H, P + N, Dqk]``,
            ``v [H, P + N, Dv]``, result ``[H, N, Dv]``), as transformers lays out attention: no
            transposes of the whole K/V.

    Returns:
        fp32 ``[N, H, Dv]``. Peak memory holds one sequence's ``[H, n_q, p_q + n_q]`` scores.
    """
    tok = 1 if heads_first else 0  # the token axis

    def key_rows_of(query_rows: torch.Tensor, new: int, p_start: int, p_end: int) -> tuple[torch.Tensor, int]:
        torch._check(p_end >= p_start)
        # Shapes read here, not closed over: dynamo cannot lift an unbacked size into the loop body.
        num_past = k.shape[tok] - q.shape[tok]
        return torch.cat((torch.arange(p_start, p_end), query_rows + num_past)), p_end - p_start

    return _per_sequence(q, k, v, query_seq_lens, past_seq_lens, key_rows_of, scale, heads_first)


def cached_ragged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_seq_lens: torch.Tensor,
    kv_seq_lens: torch.Tensor,
    scale: float | None = None,
    *,
    heads_first: bool = False,
) -> torch.Tensor:
    """:func:`ragged_attention` over keys read back from a cache the new tokens were already written to.

    Sequence q's key/value rows are one contiguous run ``kv_seq_lens[q] .. kv_seq_lens[q+1]``
    (its past tokens, then its ``n_q`` new ones: what GatherPaKvCache returns after the step's
    ScatterPaKvCache), so its new query ``j`` sits at position ``len_q - n_q + j`` and attends to
    the run's rows ``0 .. len_q - n_q + j``. Sequences never see each other.

    Args:
        q: fp32 ``[N, H, Dqk]``, the new tokens packed by ``query_seq_lens``.
        k, v: fp32 ``[T, H, D]`` packed by ``kv_seq_lens``, each sequence's run at least its ``n_q``.
        query_seq_lens: int ``[Q+1]`` cumulative new-token counts starting at 0 (ends at N).
        kv_seq_lens: int ``[Q+1]`` cumulative cached-token counts (past + new) starting at 0 (ends at T).
        scale, heads_first: as :func:`ragged_attention` (head-major ``[H, tokens, D]`` when set).

    Returns:
        fp32 ``[N, H, Dv]`` (``[H, N, Dv]`` head-major). Peak memory holds one sequence's scores.
    """

    def key_rows_of(query_rows: torch.Tensor, new: int, kv_start: int, kv_end: int) -> tuple[torch.Tensor, int]:
        torch._check(kv_end - kv_start >= new)
        return torch.arange(kv_start, kv_end), (kv_end - kv_start) - new

    return _per_sequence(q, k, v, query_seq_lens, kv_seq_lens, key_rows_of, scale, heads_first)


def _per_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_seq_lens: torch.Tensor,
    kv_seq_lens: torch.Tensor,
    key_rows_of: Callable[[torch.Tensor, int, int, int], tuple[torch.Tensor, int]],
    scale: float | None,
    heads_first: bool,
) -> torch.Tensor:
    """The loop both ragged forms run: for each sequence i with new tokens (query rows
    ``query_seq_lens[i] ..`` ``[i+1]``, ``new`` of them), ``key_rows_of(query_rows, new,
    kv_seq_lens[i], kv_seq_lens[i+1])`` gives its key rows and how many precede its first query
    (``past``); query ``j`` attends to key rows ``0 .. past + j``.
    A ``torch.while_loop`` when traced (an ONNX ``Loop``), a Python loop over the same body in eager."""
    tok = 1 if heads_first else 0  # the token axis
    spec_scores, spec_out = ("htd,hsd->hts", "hts,hsd->htd") if heads_first else ("thd,shd->hts", "hts,shd->thd")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q_cu, kv_cu = query_seq_lens.to(torch.int64), kv_seq_lens.to(torch.int64)
    # Only sequences with new tokens: an empty one has nothing to compute (and zero-row
    # attention makes ORT's Loop body divide by zero).
    active = torch.nonzero(q_cu[1:] > q_cu[:-1]).flatten()
    bounds = torch.stack((q_cu[:-1], q_cu[1:], kv_cu[:-1], kv_cu[1:]), dim=1).index_select(0, active)
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])  # [N, H, Dv] or [H, N, Dv]

    def more(i: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return i < bounds.shape[0]

    def one_sequence(i: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        row = bounds.index_select(0, i.reshape(1)).reshape(4)
        q_start, q_end, kv_start, kv_end = (row[j].item() for j in range(4))
        torch._check(q_start >= 0)
        torch._check(q_end > q_start)
        torch._check(kv_start >= 0)
        query_rows = torch.arange(q_start, q_end)
        key_rows, past = key_rows_of(query_rows, q_end - q_start, kv_start, kv_end)
        scores = torch.einsum(spec_scores, q.index_select(tok, query_rows), k.index_select(tok, key_rows)) * scale
        key_pos = torch.arange(key_rows.shape[0])
        query_pos = torch.arange(query_rows.shape[0]) + past
        allowed = key_pos[None, :] <= query_pos[:, None]
        probs = torch.softmax(scores.masked_fill(~allowed[None], float("-inf")), dim=-1)
        attended = torch.einsum(spec_out, probs, v.index_select(tok, key_rows))
        return i + 1, out.index_copy(tok, query_rows, attended)

    return loop_over_sequences(more, one_sequence, out)


def seeded_linear(in_features: int, out_features: int, generator: torch.Generator) -> torch.nn.Linear:
    """A bias-free fp32 linear layer with deterministic weights (no downloads)."""
    layer = torch.nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=generator) * in_features**-0.5)
    return layer


def loop_over_sequences(
    more: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    one_sequence: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    out: torch.Tensor,
) -> torch.Tensor:
    """``(i, out) = one_sequence(i, out)`` from ``i = 0`` (an int64 scalar) while ``more(i, out)``;
    the final ``out``. A ``torch.while_loop`` when exported or compiled (an ONNX ``Loop``), a Python
    loop over the same body in eager (eager while_loop would compile the body with dynamo)."""
    i = torch.zeros((), dtype=torch.int64)
    if torch.compiler.is_exporting() or torch.compiler.is_compiling():
        _, out = while_loop(more, one_sequence, (i, out))
        return out
    while bool(more(i, out)):
        i, out = one_sequence(i, out)
    return out
