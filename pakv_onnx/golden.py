"""The torch reference for GatherPaKvCache (and ScatterPaKvCache, PagedAttention, and
com.microsoft::PagedAttention, ORT's fused op): the ground truth every backend is tested against.

Written to be read, not to be fast: one slice copy per (sequence, used block), straight
from the contract in :mod:`pakv_onnx.spec` (its FLOOR RULE: sequence q starts at slot 0 of
column ``seq_offset[q] // bs``, kept in ``plan.table_col_starts``). It never validates on its
own; callers hand it a :class:`~pakv_onnx.plans.GatherPlan` from
:func:`~pakv_onnx.validator.plan_gather`. Caches may have different dtypes and may be pool views
strided on dim 0: it indexes them as they are and never copies a whole cache.
"""

from __future__ import annotations

import torch

from pakv_onnx import plans
from pakv_onnx.spec import ORT_ATTENTION, CacheMode


def _block_rows(cache: torch.Tensor, mode: CacheMode, block: int, rows: int) -> torch.Tensor:
    """The first ``rows`` token rows of one physical block, shaped like output rows.

    Norm  [nb, bs, H, D]      -> [rows, H, D]
    PA_NZ [nb, HD/E, bs, E]   -> [rows, HD]   (the fractal rows of a token, concatenated)
    """
    if mode is CacheMode.NORM:
        return cache.select(0, block).narrow(0, 0, rows)  # cache[block, :rows]
    fractals = cache.select(0, block).narrow(1, 0, rows)  # cache[block, :, :rows, :]: [HD/E, rows, E]
    return fractals.transpose(0, 1).reshape(rows, -1)


def gather_golden(plan: plans.GatherPlan, tensors: plans.GatherTensors) -> None:
    """Gather every sequence's tokens from the paged caches into the outputs, in place.

    Args:
        plan: a validated plan for these tensors.
        tensors: the caches (any block stride) and the outputs ``key_out`` ``[T, *key_token_shape]``
            and ``value_out`` ``[T, *value_token_shape]`` (see :class:`~pakv_onnx.plans.GatherTensors`).
    """
    key_cache, value_cache, key_out, value_out = tensors
    bs = plan.block_size
    mode = plan.cache_mode
    lengths, out_starts, col_starts = plan.index_lists()
    for row, length, out_start, first_col in zip(plan.block_table_rows(), lengths, out_starts, col_starts):
        for token in range(0, length, bs):
            block = row[first_col + token // bs]
            rows = min(bs, length - token)
            start = out_start + token
            key_out.narrow(0, start, rows).copy_(_block_rows(key_cache, mode, block, rows))  # key_out[start:+rows]
            value_out.narrow(0, start, rows).copy_(_block_rows(value_cache, mode, block, rows))


def _token_rows(cache: torch.Tensor, mode: CacheMode, block: int, slot: int) -> torch.Tensor:
    """One token's row of one block, written through (a view): Norm ``[H, D]``, PA_NZ ``[HD/E, E]``."""
    if mode is CacheMode.NORM:
        return cache[block, slot]
    return cache[block, :, slot, :]


def scatter_golden(plan: plans.ScatterPlan, tensors: plans.ScatterTensors) -> None:
    """Write every token with a slot into its cache row, in place; padding tokens (slot < 0) are skipped.

    Args:
        plan: a validated scatter for these tensors.
        tensors: ``key`` / ``value`` ``[T, H, D]`` and the caches (any block stride), written in place.
    """
    key, value, key_cache, value_cache = tensors
    bs, mode = plan.block_size, plan.cache_mode
    for token, slot in enumerate(plan.slots.tolist()):
        if slot < 0:
            continue
        block, row = divmod(slot, bs)
        for src, cache in ((key, key_cache), (value, value_cache)):
            dst = _token_rows(cache, mode, block, row)
            dst.copy_(src[token].reshape(dst.shape))


def _context_rows(cache: torch.Tensor, row: list[int], length: int, block_size: int) -> torch.Tensor:
    """Positions ``0 .. length - 1`` of one sequence, ``[length, H, D]``: row ``p % bs`` of block
    ``row[p // bs]`` for each position p (the blocks concatenated, cut at ``length``)."""
    blocks = [cache[row[c]] for c in range(-(-length // block_size))]
    return torch.cat(blocks).narrow(0, 0, length)


def attention_golden(plan: plans.AttentionPlan, tensors: plans.AttentionTensors) -> None:
    """Causal GQA attention of every sequence's new tokens over its context, into ``tensors.out``.

    Per sequence with n new tokens and a context of L: its rows gathered through the block table,
    every kv head repeated for the Hq // Hk query heads that read it, scores in fp32 times
    ``plan.scale``, query j masked to positions ``0 .. L - n + j``, softmax in fp32, the weighted
    values rounded once to the output's dtype.

    Args:
        plan: a validated plan for these tensors.
        tensors: query ``[N, Hq, D]``, the caches (any block stride), out ``[N, Hq, Dv]`` (written).
    """
    query, key_cache, value_cache, out = tensors
    group = plan.num_heads // plan.num_kv_heads
    starts, counts, lengths = plan.index_lists()
    for row, start, n, length in zip(plan.block_table_rows(), starts, counts, lengths):
        if n == 0:
            continue
        keys = _context_rows(key_cache, row, length, plan.block_size).float().repeat_interleave(group, dim=1)
        values = _context_rows(value_cache, row, length, plan.block_size).float().repeat_interleave(group, dim=1)
        q = query.narrow(0, start, n).float()  # [n, Hq, D]
        scores = torch.einsum("nhd,lhd->hnl", q, keys) * plan.scale
        visible = torch.arange(length)[None, :] <= (length - n + torch.arange(n))[:, None]  # [n, L]
        out.narrow(0, start, n).copy_(attend_visible(scores, visible, values))


def attend_visible(scores: torch.Tensor, visible: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """softmax over the visible positions, times the values, under the non-finite rules
    (docs/reliability.md, "Non-finite values in attention"): ``[n, H, Dv]`` fp32.

    A position that is not visible, or whose score is -inf, is absent: weight 0 and its value row never
    read (0 x NaN would poison the row). A NaN or +inf score, or no position left, makes the row NaN
    (softmax's own NaN). Every present position counts as weight > 0: a NaN in its value gives NaN in that
    channel, +inf / -inf give +inf / -inf (whatever its fp32 weight rounds to), both NaN.

    Args:
        scores: fp32 ``[H, n, L]`` (already scaled).
        visible: bool ``[n, L]`` (or ``[H, n, L]``): which positions each query sees.
        values: fp32 ``[L, H, Dv]``.
    """
    masked = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(masked, dim=-1)
    finite = values.isfinite()
    if bool(finite.all()):
        return torch.einsum("hnl,lhd->nhd", probs, values)
    out = torch.einsum("hnl,lhd->nhd", probs, values.where(finite, 0.0))
    present = (masked > float("-inf")).float()  # NaN scores are not present: their row is NaN already
    kinds = (values.isnan(), values == float("inf"), values == float("-inf"))
    nan, plus, minus = (torch.einsum("hnl,lhd->nhd", present, kind.float()) > 0 for kind in kinds)
    out = out.masked_fill(minus, float("-inf")).masked_fill(plus, float("inf"))
    return out.masked_fill(nan | (plus & minus) | probs.isnan().any(-1).transpose(0, 1)[..., None], float("nan"))


# --------------------------------------------------------------------------------------------- #
# com.microsoft::PagedAttention (ORT's fused op)
# --------------------------------------------------------------------------------------------- #
def _round_once(hi: torch.Tensor, lo: torch.Tensor, bits: int, min_step: int) -> torch.Tensor:
    """The exact value ``hi + lo`` (float64, |lo| at most half an ulp of hi) rounded once, to nearest
    even, to ``bits`` significand bits with steps no finer than ``2^min_step`` (float16: 11, -24;
    float32: 24, -149), as float64. torch's float64 -> float16 conversion rounds twice (through
    float32), so the rounding is done here, on the scaled significand."""
    _, exponent = torch.frexp(hi)  # |hi| in [2^(e-1), 2^e)
    step = torch.clamp(exponent - bits, min=min_step)
    m = torch.ldexp(hi, -step)
    r = torch.round(m)  # half to even
    r = r + ((m - r == 0.5) & (lo > 0)).double() - ((m - r == -0.5) & (lo < 0)).double()  # exactly halfway: lo decides
    return torch.where(torch.isfinite(hi), torch.ldexp(r, step), hi)


def _rotate(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, s: torch.Tensor, sign: float, dtype: torch.dtype) -> torch.Tensor:
    """One rotated channel ``a c + sign b s`` (T values) in the arithmetic of ORT's CUDA kernel:
    float16 ``T(a c + T(sign b s))`` (one fused multiply-add in half), bfloat16 every operation in
    float32 rounded to T, float32 the float16 form in fp32."""
    if dtype == torch.bfloat16:
        ac = (a.float() * c.float()).to(dtype).float()
        bs = ((sign * b.float()).to(dtype).float() * s.float()).to(dtype).float()
        return (ac + bs).to(dtype)
    bits, min_step = (11, -24) if dtype == torch.float16 else (24, -149)
    product = (sign * b.double()) * s.double()  # exact
    bs = _round_once(product, torch.zeros_like(product), bits, min_step)
    p = a.double() * c.double()  # exact
    hi = p + bs
    back = hi - p
    lo = (p - (hi - back)) + (bs - back)  # hi + lo == p + bs exactly
    return _round_once(hi, lo, bits, min_step).float().to(dtype)


def _norm(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    """RMSNorm of heads ``[N, H, D]`` (T) as ORT's CUDA kernel: float32 squares summed by a tree over
    the smallest power of two >= max(32, D) lanes, the mean, + eps, 1 / sqrt (correctly rounded float32;
    the GPU's rsqrtf is approximate), float32 ``(x inv) w``, rounded to T. Divisions are tensor by
    tensor (torch's division by a Python number multiplies by its inverse on CUDA)."""
    d = x.shape[-1]
    lanes = 32
    while lanes < d:
        lanes *= 2
    tree = torch.zeros(x.shape[:-1] + (lanes,), dtype=torch.float32, device=x.device)
    tree[..., :d] = x.float() * x.float()
    while tree.shape[-1] > 1:  # lane c adds lane c + stride
        tree = tree[..., : tree.shape[-1] // 2] + tree[..., tree.shape[-1] // 2 :]
    mean = tree[..., 0] / torch.full_like(tree[..., 0], float(d))
    mean = mean + torch.full_like(mean, epsilon)
    inverse = (1.0 / torch.sqrt(mean.double())).float()
    return ((x.float() * inverse[..., None]) * weight.float()).to(x.dtype)


def _prepare_heads(
    plan: plans.OrtAttentionPlan, x: torch.Tensor, weight: torch.Tensor | None, rotary: tuple[torch.Tensor | None, ...]
) -> torch.Tensor:
    """Heads ``[N, H, D]`` of T through RMSNorm (with ``weight``) and rotary (``rotary``: cos_cache,
    sin_cache) at each token's position, operation for operation as ORT's CUDA kernel
    (docs/ort-paged-attention.md "Cache bytes")."""
    dtype = plan.dtype
    if weight is not None:
        x = _norm(x.to(dtype), weight, float(plan.epsilon))
    if plan.rotary_dim == 0:
        return x
    half, offset = plan.rotary_dim // 2, plan.rotary_offset
    cos, sin = (table[plan.positions][:, None, :] for table in rotary)  # [N, 1, half]
    out = x.clone()
    for r in range(plan.rotary_dim):
        if plan.rotary_interleaved:  # pairs (2i, 2i + 1)
            i, partner, sign = r // 2, r + 1 - 2 * (r % 2), -1.0 if r % 2 == 0 else 1.0
        else:  # halves (i, i + half)
            i, partner, sign = r % half, (r + half) % plan.rotary_dim, -1.0 if r < half else 1.0
        a, b = x[..., offset + r], x[..., offset + partner]
        out[..., offset + r] = _rotate(a, b, cos[..., i], sin[..., i], sign, dtype)
    return out


def _quantized(row: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """T values as the cache's elements, as ORT's CUDA kernel stores them: q = x / scale in float32 (a
    zero scale stores 0); int8 fmax(q, -128) (NaN -> -128), fmin(., 127), rounded half to even;
    float8e4m3fn fmin(q, 448) (NaN -> 448), fmax(., -448), rounded to nearest even."""
    if cache_dtype not in (torch.int8, torch.float8_e4m3fn):
        return row.to(cache_dtype)
    v = torch.where(scale == 0, torch.zeros_like(scale), row.float() / torch.where(scale == 0, 1.0, scale))
    if cache_dtype == torch.int8:
        return torch.fmin(torch.fmax(v, torch.full_like(v, -128.0)), torch.full_like(v, 127.0)).round().to(torch.int8)
    return torch.fmax(torch.fmin(v, torch.full_like(v, 448.0)), torch.full_like(v, -448.0)).to(torch.float8_e4m3fn)


def _scales(scale: torch.Tensor | None, heads: int, dim: int) -> torch.Tensor | None:
    """A plan's scale as float32 ``[Hk, D]`` (PER_TENSOR: its one value everywhere), or None (no quantization)."""
    if scale is None:
        return None
    return scale.expand(heads * dim).reshape(heads, dim) if scale.numel() == 1 else scale.reshape(heads, dim)


def ort_attention_golden(plan: plans.OrtAttentionPlan, tensors: plans.OrtAttentionTensors) -> None:
    """com.microsoft::PagedAttention: every new token's key (and value) written into its slot, then
    attention of every new token over its sequence's context read back from the caches.

    Per token t of sequence b (position p = past + j): its q and k heads normalized and rotated
    (:func:`_prepare_heads`), its k / v rows stored at ``plan.slots[t]`` (quantized for int8 / float8
    caches); each cache element read back as its value (int8 / float8: ``e x scale``, for T float16 /
    bfloat16 computed in fp32 and rounded to T, as ORT's CUDA kernel does); then per query head h (kv head h // (Hq / Hk)) the scores ``scale x q . k`` (softcap
    ``c tanh(s / c)``) over positions ``max(0, p - window) ..`` p (or the whole context when not
    causal), softmax in float64 with the sink logit in the denominator, the weighted values (LATENT:
    the keys' leading Dv channels) rounded once to T.

    Args:
        plan: a validated plan for these tensors.
        tensors: the inputs, the caches written and read (in place), the output ``[N, Hq * Dv]``.
    """
    inputs = dict(zip(ORT_ATTENTION.input_names, tensors.inputs))
    n, hq, hk, d, dv = plan.num_tokens, plan.num_heads, plan.num_kv_heads, plan.head_dim, plan.value_head_dim
    query = inputs["query"]
    q_rows = query[:, : hq * d].reshape(n, hq, d)
    k_rows = (query[:, hq * d : (hq + hk) * d] if plan.packed else inputs["key"]).reshape(n, hk, d)
    v_rows = None if plan.latent else (query[:, (hq + hk) * d :] if plan.packed else inputs["value"]).reshape(n, hk, d)
    rotary = (inputs["cos_cache"], inputs["sin_cache"])
    queries = _prepare_heads(plan, q_rows, inputs["q_norm_weight"] if plan.normalize else None, rotary)
    keys = _prepare_heads(plan, k_rows, inputs["k_norm_weight"] if plan.normalize else None, rotary)
    caches = [(tensors.key_cache, keys, _scales(plan.key_scale, hk, d))]
    if not plan.latent:
        caches.append((tensors.value_cache, v_rows, _scales(plan.value_scale, hk, d)))
    for t, slot in enumerate(plan.slots.tolist()):
        if slot < 0:
            continue
        block, row = divmod(slot, plan.block_size)
        for cache, rows, scale in caches:
            cache[block, row] = _quantized(rows[t], cache.dtype, scale)

    def values_of(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        factor = _scales(scale, hk, d)
        if factor is None:
            return cache.double()
        if plan.dtype in (torch.float16, torch.bfloat16):  # ORT's CUDA kernel: fp32 e x scale, rounded to T
            return (cache.float() * factor.float()).to(plan.dtype).double()
        return cache.double() * factor.double()

    key_values = values_of(tensors.key_cache, plan.key_scale)
    value_values = key_values[..., :dv] if plan.latent else values_of(tensors.value_cache, plan.value_scale)
    out = tensors.out.view(n, hq, dv)
    for b, (start, count, length) in enumerate(
        zip(plan.query_starts.tolist(), plan.query_counts.tolist(), plan.context_lens.tolist())
    ):
        if count == 0:
            continue
        row = plan.tables[b].tolist()
        for j in range(count):
            position = length - count + j
            last = position if plan.causal else length - 1
            first = max(0, position - plan.window) if plan.window >= 0 else 0
            where = [(row[p // plan.block_size], p % plan.block_size) for p in range(first, last + 1)]
            k = torch.stack([key_values[blk, slot] for blk, slot in where])  # [L, Hk, D]
            v = torch.stack([value_values[blk, slot] for blk, slot in where])
            for h in range(hq):
                g = h // (hq // hk)
                scores = plan.scale * (k[:, g] @ queries[start + j, h].double())
                if plan.softcap > 0:
                    scores = plan.softcap * torch.tanh(scores / plan.softcap)
                logits = scores if plan.head_sink is None else torch.cat([scores, plan.head_sink[h : h + 1].double()])
                weights = torch.softmax(logits, dim=0)
                if bool(weights.isnan().any()):  # a NaN or +inf logit, or every logit -inf: the row is NaN
                    out[start + j, h] = float("nan")
                    continue
                present = scores > float("-inf")  # a -inf score is absent: its value row is never read
                out[start + j, h] = (weights[: len(where)][present] @ v[present, g]).float().to(out.dtype)
