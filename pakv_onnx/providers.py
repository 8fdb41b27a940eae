"""Where an exported decoder runs and in which precision: the execution providers ``pakv-onnx export``
writes a genai_config.json for, the precisions it exports in, and what ORT's CUDA kernel of
``com.microsoft::PagedAttention`` cannot run (:data:`CUDA_LIMITS`, one table; docs/decoders.md shows it).

One model.onnx serves both providers: the CPU runs its ``com.microsoft::PagedAttention`` nodes with this
package's library (``custom_ops_library``), a GPU with ORT's own CUDA kernel (``provider_options``
``cuda``); only genai_config.json differs. This module imports nothing heavy (no torch, no onnx), so the
command line refuses an impossible pair of options before loading anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

CPU, CUDA = "cpu", "cuda"
EXECUTION_PROVIDERS = (CPU, CUDA)
# The attention forms of an exported step (models.hf.step.ATTENTION_CHOICES; a test ties them).
ORT_FORM, PAKV_FORM = "ort", "pakv"


@dataclasses.dataclass(frozen=True)
class Precision:
    """One ``--precision``: the element types of an exported step.

    Attributes:
        name: the option's value (``fp32``, ``fp16``, ``bf16``).
        compute: torch dtype name of the weights, activations and logits' producer (``float32``, ``float16``).
        attention: torch dtype name of com.microsoft::PagedAttention's T (query, output, rotary tables, q/k
            norm weights) and of the pools unless quantized.
        forms: the attention forms exported in it.
        note: what a reader needs to know (docs and ``--help``).
    """

    name: str
    compute: str
    attention: str
    forms: tuple[str, ...]
    note: str


FP32, FP16, BF16 = "fp32", "fp16", "bf16"
PRECISIONS: dict[str, Precision] = {
    FP32: Precision(FP32, "float32", "float32", (ORT_FORM, PAKV_FORM), "every element float32 (the CPU only: ORT's "
                    "CUDA kernel has no float32 T)"),
    FP16: Precision(FP16, "float16", "float16", (ORT_FORM,), "weights, activations, the op's T and the pools "
                    "float16; RMS norms computed in float32 as transformers does; logits float32"),
    BF16: Precision(BF16, "float32", "bfloat16", (ORT_FORM,), "the op's T and the pools bfloat16, the weights and "
                    "the other activations float32: ORT's CPU EP has no bfloat16 MatMul, Add or Mul (and inserts "
                    "casts for float16 only), so a bfloat16 graph would not load on the CPU"),
}  # fmt: skip
DEFAULT_PRECISION = FP32
# The quantized pools (--kv-cache) and the T each combines with: any (ORT's CUDA kernel: fp16 / bf16 T).
KV_CACHE_KINDS = ("int8", "fp8")
# ORT's CUDA kernel's largest num_heads: its launch puts one thread per head in a block (maxThreadsPerBlock,
# 1024 on NVIDIA GPUs since sm_20).
CUDA_MAX_HEADS = 1024


@dataclasses.dataclass(frozen=True)
class ExportTarget:
    """What decides whether a provider can run an exported step. ``None``: not known yet (the model's
    config or the step's rotary table is read later); rules on an unknown value are not checked."""

    precision: str
    attention: str | None
    block_size: int
    kv_cache: str | None = None
    head_size: int | None = None
    num_heads: int | None = None
    rotary_dim: int | None = None  # 2 x the cos table's columns; 0: no rotary
    rotary_offset: int = 0


def _power_of_two_16(value: int) -> bool:
    return value >= 16 and value & (value - 1) == 0


@dataclasses.dataclass(frozen=True)
class CudaLimit:
    """One rule of ORT's CUDA ``com.microsoft::PagedAttention`` an exported step must keep.

    ``subject`` names the option or model property, ``value`` reads it off an :class:`ExportTarget`
    (None: unknown, not checked), ``ok`` tells whether ORT's kernel runs it, ``needs`` says what it needs
    and ``source`` where ORT says so (onnxruntime 1.31, FACTS §14)."""

    subject: str
    needs: str
    source: str
    value: Callable[[ExportTarget], object]
    ok: Callable[[object, ExportTarget], bool]


CUDA_LIMITS: tuple[CudaLimit, ...] = (
    CudaLimit("--precision", "fp16 or bf16 (T float16 / bfloat16; no float32 kernel)", "paged_attention.cc kernel registrations",
              lambda t: t.precision, lambda v, t: v in (FP16, BF16)),
    CudaLimit("--attention", "ort (ORT has no kernel for the pakv ops; they run on the CPU with this library)",
              "ORT's contrib ops", lambda t: t.attention, lambda v, t: v == ORT_FORM),
    CudaLimit("--block-size", "a power of two >= 16", "paged_attention_helper.h CheckKVCache",
              lambda t: t.block_size, lambda v, t: _power_of_two_16(v)),
    CudaLimit("--kv-cache", "int8 or fp8 (float8e4m3fn, in builds with USE_FP8_KV_CACHE: 1.31.1's wheel has it)",
              "paged_attention.cc kernel registrations", lambda t: t.kv_cache,
              lambda v, t: v is None or v in KV_CACHE_KINDS),
    CudaLimit("head size", "a multiple of 8", "paged_attention_helper.h Check_QKV / Check_Q_K_Latent",
              lambda t: t.head_size, lambda v, t: v % 8 == 0),
    CudaLimit("head size", "a multiple of 16 when rotary is on", "group_query_attention_helper.h CheckRotaryCaches",
              lambda t: t.head_size if t.rotary_dim else None, lambda v, t: v % 16 == 0),
    CudaLimit("rotary dim", "a multiple of 16 (cos_cache columns a multiple of 8) and at most the head size",
              "group_query_attention_helper.h CheckRotaryCaches", lambda t: t.rotary_dim or None,
              lambda v, t: v % 16 == 0 and (t.head_size is None or v // 2 <= t.head_size // 16 * 8)),
    CudaLimit("rotary offset", "a multiple of 8, with offset + rotary dim <= head size (LATENT: kv_lora_rank)",
              "paged_attention_helper.h CheckInputs", lambda t: t.rotary_offset or None,
              lambda v, t: v % 8 == 0 and (t.head_size is None or v + (t.rotary_dim or 0) <= t.head_size)),
    CudaLimit("num_heads", f"at most {CUDA_MAX_HEADS} (one thread per head in a block)",
              "paged_attention_helper.h CheckInputs", lambda t: t.num_heads, lambda v, t: v <= CUDA_MAX_HEADS),
)  # fmt: skip


def precision_refusal(precision: str, attention: str | None) -> str | None:
    """Why a step cannot be exported in ``precision`` in the ``attention`` form (None: it can; an unknown
    form is left to the form's own check)."""
    if precision not in PRECISIONS:
        return f"--precision {precision!r} is unknown (choices: {', '.join(PRECISIONS)})"
    forms = PRECISIONS[precision].forms
    if attention is not None and attention in (ORT_FORM, PAKV_FORM) and attention not in forms:
        return (
            f"--precision {precision} is exported for --attention {' or '.join(forms)} only, not --attention "
            f"{attention}: the pakv ops' fallback functions, their Loop / gather (MLA) graph and the pakv "
            "decoder path are built and checked in float32"
        )
    return None


def cuda_refusal(target: ExportTarget) -> str | None:
    """Why ORT's CUDA kernel cannot run the step ``target`` describes (the first broken rule of
    :data:`CUDA_LIMITS`, naming the option or property, its value and what ORT needs), or None."""
    for limit in CUDA_LIMITS:
        value = limit.value(target)
        if value is not None and not limit.ok(value, target):
            return (
                f"--execution-provider {CUDA} cannot run {limit.subject} {value}: ORT's CUDA "
                f"com.microsoft::PagedAttention needs {limit.needs} ({limit.source}); --execution-provider "
                f"{CPU} runs it with this library"
            )
    return None


def export_refusal(target: ExportTarget, provider: str) -> str | None:
    """Why ``pakv-onnx export`` refuses to write ``target`` for ``provider`` (None: it writes it)."""
    if provider not in EXECUTION_PROVIDERS:
        return f"--execution-provider {provider!r} is unknown (choices: {', '.join(EXECUTION_PROVIDERS)})"
    return precision_refusal(target.precision, target.attention) or (
        cuda_refusal(target) if provider == CUDA else None
    )


def cuda_limits_table() -> str:
    """:data:`CUDA_LIMITS` as a markdown table (docs/decoders.md holds it; a test compares)."""
    rows = ["| option or property | ORT's CUDA kernel needs | where ORT says so |", "|---|---|---|"]
    rows += [f"| {limit.subject} | {limit.needs} | {limit.source} |" for limit in CUDA_LIMITS]
    return "\n".join(rows)
