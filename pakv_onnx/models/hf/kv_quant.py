"""Quantized KV caches for the ``ort`` step: int8 or float8e4m3fn pools with fixed per-channel scales.

com.microsoft::PagedAttention stores ``x / scale`` (int8: rounded half to even and clamped to
[-128, 127]; float8e4m3fn: clamped to +-448, rounded to nearest even) and reads ``e * scale``, with
a scale per KV head and channel (``PER_CHANNEL``, ``[Hk, 1, D]`` float32). The scales are fixed in the
graph; :func:`calibrate` takes them from the fp32 model itself:

- one prefill of :data:`CALIBRATION_PROMPTS` prompts of :data:`CALIBRATION_TOKENS` seeded random token
  ids (or the caller's prompts) through the fp32 ``ort`` step in eager torch, its pools read back (the
  cached keys as the op writes them: q/k-normed and rotated);
- a value channel's scale is its largest magnitude over the written rows / qmax (127, 448);
- a rotated key channel's is its pair's largest norm ``sqrt(k_i^2 + k_j^2)`` (``i, j`` the channels
  one rotary angle turns together) / qmax, the same for both: a rotation keeps the pair's norm, so
  the scale covers the key at every position, not only the calibrated ones; unrotated key channels
  (and MLA's ``c_kv``) take their own largest magnitude;
- a channel that stayed 0 gets scale 1 (it stores 0 whatever the scale).
"""

from __future__ import annotations

import copy

import torch

from pakv_onnx.models.hf.ort_layer import KV_CACHE_DTYPES, KV_CACHE_QMAX, KvQuant

CALIBRATION_PROMPTS = 8
CALIBRATION_TOKENS = 128
CALIBRATION_SEED = 0


def calibration_prompts(vocab_size: int, count: int = CALIBRATION_PROMPTS, length: int = CALIBRATION_TOKENS,
                        seed: int = CALIBRATION_SEED) -> list[list[int]]:  # fmt: skip
    """``count`` prompts of ``length`` token ids drawn uniformly from the vocabulary (seeded)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count, length), generator=generator).tolist()


def rotary_pairs(width: int, offset: int, rotary_dim: int, interleaved: bool) -> torch.Tensor:
    """int64 ``[width]``: each channel's rotary partner (itself when not rotated): halves ``(i, i + r/2)``
    or interleaved ``(2i, 2i + 1)`` over channels ``[offset, offset + rotary_dim)``."""
    partner = torch.arange(width)
    lane = torch.arange(rotary_dim)
    half = rotary_dim // 2
    other = (lane ^ 1) if interleaved else torch.where(lane < half, lane + half, lane - half)
    partner[offset : offset + rotary_dim] = other + offset
    return partner


def channel_scales(rows: torch.Tensor, partner: torch.Tensor | None, qmax: float) -> torch.Tensor:
    """fp32 ``[H, 1, D]`` scales of cached rows ``[T, H, D]`` (see the module docstring); ``partner``
    (``[D]``, :func:`rotary_pairs`) pairs rotated channels, None: every channel alone."""
    rows = rows.to(torch.float32)
    magnitude = rows.abs() if partner is None else torch.sqrt(rows.square() + rows[..., partner].square())
    amax = magnitude.amax(dim=0) if rows.shape[0] else torch.zeros(rows.shape[1:])
    return torch.where(amax > 0, amax / qmax, torch.ones_like(amax)).unsqueeze(1).contiguous()


def calibrate(model: torch.nn.Module, kind: str, *, prompts: list[list[int]] | None = None,
              block_size: int = 16) -> KvQuant:  # fmt: skip
    """The :class:`KvQuant` of ``model`` (a transformers causal LM the ``ort`` step serves, fp32; not
    changed: a copy is run) for ``kind`` (``int8`` or ``fp8``), from one prefill of ``prompts``
    (default :func:`calibration_prompts`); see the module docstring.

    Raises:
        ValueError: an unknown ``kind``.
    """
    from pakv_onnx.models.hf.cache import PagedKVCache
    from pakv_onnx.models.hf.generate import run_step
    from pakv_onnx.models.hf.step import ORT, PagedDecoderStep, run_step_torch

    if kind not in KV_CACHE_DTYPES:
        raise ValueError(f"kv cache kind must be one of {', '.join(KV_CACHE_DTYPES)}, got {kind!r}")
    step = PagedDecoderStep(copy.deepcopy(model), attention=ORT)
    prompts = prompts or calibration_prompts(step.model.config.vocab_size)
    blocks = sum(-(-len(p) // block_size) for p in prompts)
    cache = PagedKVCache(num_layers=step.num_layers, geometry=step.geometry(), num_blocks=blocks, block_size=block_size)
    ids = list(range(len(prompts)))
    for i in ids:
        cache.add_sequence(i)
    run_step(lambda feeds: run_step_torch(step, feeds), cache, ids, prompts)
    qmax = KV_CACHE_QMAX[kind]
    key_scales, value_scales = [], []
    for layer, attention in enumerate(layer.self_attn for layer in step.model.model.layers):
        keys = cache.key_pools[layer].flatten(0, 1)  # [slots, H, D]; unwritten slots are 0 and raise no maximum
        partner = rotary_pairs(keys.shape[-1], *_rotary_span(attention, step.rotary_cos.shape[1] * 2))
        key_scales.append(channel_scales(keys, partner, qmax))
        if not step.latent:
            value_scales.append(channel_scales(cache.value_pools[layer].flatten(0, 1), None, qmax))
    return KvQuant(kind, key_scales, value_scales)


def _rotary_span(attention: torch.nn.Module, rotary_dim: int) -> tuple[int, int, bool]:
    """``(offset, rotary_dim, interleaved)`` of the channels the op rotates for ``attention``'s keys."""
    from pakv_onnx.models.hf.ort_layer import OrtLatentAttention

    if isinstance(attention, OrtLatentAttention):
        return attention.rank, rotary_dim, bool(attention.interleaved)
    return 0, rotary_dim, False
