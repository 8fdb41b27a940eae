"""DeepSeek-V3's multi-head latent attention over paged pools, in the absorbed form MLA engines decode in.

What a layer caches per token is the latent ``[c_kv | k_pe]``: the ``kv_a_layernorm``-normalized
``c_kv`` (``kv_lora_rank`` wide) and the RoPE'd shared key ``k_pe`` (``qk_rope_head_dim`` wide),
exactly what transformers hands its cache. The latent lies across the layer's two pools: the key
pool holds its first columns, the value pool the rest (the split is the pools' widths, see
:func:`~pakv_onnx.models.hf.configs.cache_geometry`: ``c_kv`` | ``k_pe`` by default, two equal halves
for og.Engine's one pool shape).

transformers up-projects the whole gathered latent into per-head keys and values every step
(``kv_b_proj``: ``W_UK``, ``W_UV``). The absorbed form never does: per head h,

    q_latent[h] = q_nope[h] @ W_UK[h]                      (kv_lora_rank wide: the query in latent space)
    scores[h]   = (q_latent[h] . c_kv + q_pe[h] . k_pe) * scaling
    out[h]      = (softmax(scores[h]) @ c_kv) @ W_UV[h]     (v_head_dim wide, then o_proj)

which equals ``q[h] . k[h]`` and ``softmax @ v[h]`` of the up-projected form (matrix products
reassociated), so attention reads the gathered latent as it is: one shared "head" of
``kv_lora_rank + qk_rope_head_dim`` per token. :func:`absorb_latent_attention` puts
:class:`AbsorbedLatentAttention` in place of each ``DeepseekV3Attention`` of the model a
:class:`~pakv_onnx.models.hf.step.PagedDecoderStep` wraps (that model only; transformers' classes
are not patched).
"""

from __future__ import annotations

import torch

from pakv_onnx.models.attention import loop_over_sequences
from pakv_onnx.models.hf.kwargs import KV_SEQ_LENS_KWARG, QUERY_SEQ_LENS_KWARG


class LatentLayoutError(ValueError):
    """A layer's pools do not hold its latent in a layout :class:`AbsorbedLatentAttention` reads."""


def _rope_functions():
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as modeling

    return modeling.apply_rotary_pos_emb, modeling.apply_rotary_pos_emb_interleave


class AbsorbedLatentAttention(torch.nn.Module):
    """A ``DeepseekV3Attention`` (its weights, shared, not copied) run in the absorbed form.

    Buffers: ``k_absorb`` fp32 ``[H, qk_nope_head_dim, kv_lora_rank]`` (``W_UK`` per head) and
    ``v_absorb`` ``[H, kv_lora_rank, v_head_dim]`` (``W_UV`` per head, transposed), both cut from
    ``kv_b_proj.weight`` ``[H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]``.

    Raises:
        ValueError: ``kv_b_proj`` has a bias (its key bias would not fold into the query).
    """

    def __init__(self, attention: torch.nn.Module) -> None:
        super().__init__()
        if attention.kv_b_proj.bias is not None:
            raise ValueError(
                f"layer {attention.layer_idx}: kv_b_proj has a bias; the absorbed form folds only its weight"
            )
        for name in (
            "q_proj",
            "q_a_proj",
            "q_a_layernorm",
            "q_b_proj",
            "kv_a_proj_with_mqa",
            "kv_a_layernorm",
            "o_proj",
        ):
            setattr(self, name, getattr(attention, name))
        self.layer_idx = attention.layer_idx
        self.num_heads, self.scaling = attention.num_heads, attention.scaling
        self.rank, self.rope = attention.kv_lora_rank, attention.qk_rope_head_dim
        self.nope, self.v_dim = attention.qk_nope_head_dim, attention.v_head_dim
        self.rope_interleave = bool(attention.config.rope_interleave)
        weight = attention.kv_b_proj.weight.detach().view(self.num_heads, self.nope + self.v_dim, self.rank)
        self.register_buffer("k_absorb", weight[:, : self.nope].contiguous(), persistent=False)
        self.register_buffer("v_absorb", weight[:, self.nope :].transpose(1, 2).contiguous(), persistent=False)

    def latent_split(self, cache) -> int:
        """How many leading latent columns the layer's key pool holds (the value pool holds the rest).

        Raises:
            LatentLayoutError: the pools are not one head each, or their widths do not add up to
                ``kv_lora_rank + qk_rope_head_dim``.
        """
        key_pool, value_pool = cache.key_pools[self.layer_idx], cache.value_pools[self.layer_idx]
        (key_heads, key_width), (value_heads, value_width) = key_pool.shape[2:], value_pool.shape[2:]
        if key_heads != 1 or value_heads != 1 or key_width + value_width != self.rank + self.rope:
            raise LatentLayoutError(
                f"layer {self.layer_idx}: the pools hold rows [{key_heads}, {key_width}] and [{value_heads}, "
                f"{value_width}]; the latent [c_kv | k_pe] needs one head each and {self.rank} + {self.rope} "
                "columns in all"
            )
        return key_width

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        """One step's packed tokens: ``hidden_states`` fp32 ``[1, N, hidden]`` -> ``([1, N, hidden], None)``.

        ``cache`` is the step's :class:`~pakv_onnx.models.hf.cache.StepCache` (it writes the new
        latent rows and reads each sequence's back); ``kwargs`` carry the step's cumulative query
        and cached lengths. ``attention_mask`` is unused (per-sequence causality is built here).
        """
        tokens = hidden_states.shape[1]
        heads, hidden = self.num_heads, hidden_states[0]
        if self.q_proj is not None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q_nope, q_pe = q.view(tokens, heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.rank, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        rotate = _rope_functions()[1 if self.rope_interleave else 0]
        cos, sin = position_embeddings  # [1, N, rope]; token-major q [1, N, H, rope] broadcasts at dim 2
        q_pe, k_pe = rotate(q_pe.unsqueeze(0), k_pe.view(1, tokens, 1, self.rope), cos, sin, unsqueeze_dim=2)
        split = self.latent_split(cache)
        latent = torch.cat((c_kv, k_pe.view(tokens, self.rope)), dim=-1)  # [N, rank + rope]
        key_rows, value_rows = latent.split([split, self.rank + self.rope - split], dim=-1)
        key_pool, value_pool = cache.write(key_rows.unsqueeze(1), value_rows.unsqueeze(1), self.layer_idx)
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.k_absorb)  # [H, N, rank]
        query = torch.cat((q_latent, q_pe[0].transpose(0, 1)), dim=-1)  # [H, N, rank + rope], the latent's columns
        # Two tensors, not two views of one (torch.while_loop refuses aliased inputs).
        query_a, query_b = (part.clone() for part in query.split([split, self.rank + self.rope - split], dim=-1))
        out_latent = paged_latent_attention(
            query_a,
            query_b,
            key_pool,
            value_pool,
            cache.block_table,
            kwargs[QUERY_SEQ_LENS_KWARG],
            kwargs[KV_SEQ_LENS_KWARG],
            self.scaling,
            self.rank,
        )  # [N, H, rank]
        out = torch.bmm(out_latent.transpose(0, 1), self.v_absorb)  # [H, N, v_dim]
        return self.o_proj(out.transpose(0, 1).reshape(1, tokens, heads * self.v_dim)), None


def gathers_per_sequence(config) -> bool:
    """Whether the paged step of a model with ``config`` reads its cache with one GatherPaKvCache per
    sequence per layer (inside the attention Loop: DeepSeek-V3 here), not one per layer."""
    return getattr(config, "model_type", None) == "deepseek_v3"


def absorb_latent_attention(model: torch.nn.Module) -> int:
    """Replace every ``DeepseekV3Attention`` of ``model`` (in place) by an :class:`AbsorbedLatentAttention`
    over the same weights; returns how many were replaced (0 for a model without MLA)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, DeepseekV3Attention):
                setattr(parent, name, AbsorbedLatentAttention(child))
                replaced += 1
    return replaced


def paged_latent_attention(
    query_a: torch.Tensor,
    query_b: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_table: torch.Tensor,
    query_seq_lens: torch.Tensor,
    kv_seq_lens: torch.Tensor,
    scale: float,
    value_width: int,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its latent rows in the pools, one sequence at a time.

    The latent (``a + b`` columns per token) lies in two column blocks, the key pool's and the value
    pool's; the query is cut at the same column. Each sequence's rows are read with its own
    GatherPaKvCache (one block-table row: the rows land contiguous, ready for the products, with
    no packed copy to slice). Scores are ``query . latent`` over all columns, the output
    ``softmax @ latent[:, :value_width]`` (``c_kv``). Sequence q holds ``len_q`` rows (past, then
    its ``n_q`` new tokens, already written): its new query ``j`` attends to rows ``0 .. len_q - n_q + j``.

    Args:
        query_a, query_b: fp32 ``[H, N, a]`` and ``[H, N, b]``, the new tokens packed by ``query_seq_lens``.
        key_pool, value_pool: ``[num_blocks, block_size, 1, a]`` and ``[..., 1, b]``, the step's rows written.
        block_table: int32 ``[Q, max_blocks]``; query_seq_lens, kv_seq_lens: int ``[Q+1]`` cumulative
            new and cached (past + new) counts from 0.
        scale: the score scale. value_width: the latent columns that are values (``kv_lora_rank``).

    Returns:
        fp32 ``[N, H, value_width]``. Peak memory holds one sequence's rows and ``[H * n_q, len_q]``
        scores; the latent is multiplied as it lies (only the per-sequence query and scores are transposed).
    """
    heads, width_a = query_a.shape[0], query_a.shape[2]
    q_cu = query_seq_lens.to(torch.int64)
    kv_cu = kv_seq_lens.to(torch.int64)
    # Sequences with new tokens only (zero-row attention makes ORT's Loop body divide by zero).
    active = torch.nonzero(q_cu[1:] > q_cu[:-1]).flatten()
    bounds = torch.stack((q_cu[:-1], q_cu[1:], kv_cu[1:] - kv_cu[:-1]), dim=1).index_select(0, active)
    tables = block_table.index_select(0, active)
    out = query_a.new_zeros(query_a.shape[1], heads, value_width)

    def more(i: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return i < bounds.shape[0]

    def one_sequence(i: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        row = bounds.index_select(0, i.reshape(1))  # [1, 3]
        q_start, q_end, length = (row[0, j].item() for j in range(3))
        torch._check(q_start >= 0)
        torch._check(q_end > q_start)
        torch._check(length >= q_end - q_start)
        new, past = q_end - q_start, length - (q_end - q_start)
        seq_lens = torch.cat((row.new_zeros(1), row[0, 2:])).to(torch.int32)  # [0, len]
        rows_a, rows_b = torch.ops.pakv.gather_pa_kv_cache(
            key_pool, value_pool, tables.index_select(0, i.reshape(1)), seq_lens, None, "Norm", True
        )  # [len, 1, a], [len, 1, b]
        rows_a, rows_b = rows_a.flatten(1), rows_b.flatten(1)
        query_rows = torch.arange(q_start, q_end)
        qa = query_a.index_select(1, query_rows).reshape(-1, width_a)  # [H * new, a], row h * new + j
        qb = query_b.index_select(1, query_rows).reshape(qa.shape[0], -1)
        # [len, H * new] from the latent as it lies, then the small transpose to [H * new, len].
        scores = (torch.matmul(rows_a, qa.transpose(0, 1)) + torch.matmul(rows_b, qb.transpose(0, 1))).transpose(0, 1)
        query_pos = torch.arange(new).repeat(heads) + past  # row h * new + j is query j (no `%`: it exports badly)
        allowed = torch.arange(rows_a.shape[0])[None, :] <= query_pos[:, None]
        probs = torch.softmax((scores * scale).masked_fill(~allowed, float("-inf")), dim=-1)
        attended = torch.matmul(probs, rows_a)  # [H * new, a]
        if width_a < value_width:  # the values run on into the value pool's columns
            attended = torch.cat((attended, torch.matmul(probs, rows_b)[:, : value_width - width_a]), dim=-1)
        elif width_a > value_width:
            attended = attended[:, :value_width]
        return i + 1, out.index_copy(0, query_rows, attended.reshape(heads, new, value_width).transpose(0, 1))

    return loop_over_sequences(more, one_sequence, out)
