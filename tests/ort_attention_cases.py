"""Random com.microsoft::PagedAttention calls for the tests: torch tensors for the op's paths (the
ORT plugin, the Python front, the torch op) and the same call as numpy for the independent
reference (:mod:`ort_attention_reference`), plus the one-node ONNX model of a call."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper
from ort_attention_reference import Call, float8_decode, round_to

INPUT_NAMES = (
    "query", "key", "value", "key_cache", "value_cache", "cumulative_sequence_length", "past_seqlens", "block_table",
    "cos_cache", "sin_cache", "slot_mapping", "head_sink", "q_norm_weight", "k_norm_weight", "k_scale", "v_scale",
    "attention_metadata",
)  # fmt: skip
OUTPUT_NAMES = ("output", "key_cache_out", "value_cache_out")
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "int8": torch.int8, "float8e4m3fn": torch.float8_e4m3fn}  # fmt: skip
ONNX_TYPES = {
    torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16, torch.bfloat16: TensorProto.BFLOAT16,
    torch.int8: TensorProto.INT8, torch.float8_e4m3fn: TensorProto.FLOAT8E4M3FN, torch.int32: TensorProto.INT32,
    torch.int64: TensorProto.INT64, torch.uint8: TensorProto.UINT8,
}  # fmt: skip


@dataclasses.dataclass
class OrtCall:
    """One call: its inputs by ORT's names (None: absent), its attributes, and the reference's view."""

    inputs: dict[str, torch.Tensor | None]
    attributes: dict[str, Any]

    @property
    def dtype(self) -> str:
        return str(self.inputs["query"].dtype).removeprefix("torch.")

    @property
    def cache_dtype(self) -> str:
        dtype = self.inputs["key_cache"].dtype
        return {torch.float8_e4m3fn: "float8e4m3fn"}.get(dtype, str(dtype).removeprefix("torch."))

    def numpy_call(self) -> Call:
        """The reference's view: float tensors as float32 values, caches as values or codes."""

        def values(t: torch.Tensor | None) -> np.ndarray | None:
            if t is None:
                return None
            if t.dtype == torch.float8_e4m3fn:
                return t.view(torch.uint8).numpy().copy()
            if t.dtype in (torch.int8, torch.int32, torch.int64):
                return t.numpy().copy()
            return t.float().numpy().copy()

        return Call(
            self.dtype,
            self.cache_dtype,
            attributes=dict(self.attributes),
            **{name: values(self.inputs[name]) for name in INPUT_NAMES if name != "attention_metadata"},
        )

    def clone(self) -> OrtCall:
        return OrtCall({k: None if v is None else v.clone() for k, v in self.inputs.items()}, dict(self.attributes))


def cache_values(cache: torch.Tensor) -> np.ndarray:
    """A cache as the reference holds it (float32 values of float caches, int8 / float8 codes)."""
    if cache.dtype == torch.float8_e4m3fn:
        return cache.view(torch.uint8).numpy()
    if cache.dtype == torch.int8:
        return cache.numpy()
    return cache.float().numpy()


def random_ort_call(
    seed: int,
    *,
    dtype: str = "float32",
    cache_dtype: str | None = None,
    num_heads: int = 4,
    kv_num_heads: int = 2,
    head_size: int = 16,
    block_size: int = 4,
    num_blocks: int = 12,
    sequences: tuple[tuple[int, int], ...] = ((3, 1), (0, 5), (6, 0), (2, 3)),
    packed: bool = False,
    rotary: str | None = None,
    rotary_dim: int | None = None,
    rotary_offset: int = 0,
    norm: bool = False,
    slots: str = "derived",
    sink: bool = False,
    window: int = -1,
    softcap: float = 0.0,
    causal: int = 1,
    latent: bool = False,
    v_head_size: int = 0,
    quant: str | None = None,
    scale: float = 0.0,
    index_dtype: torch.dtype = torch.int32,
    metadata: bool = False,
) -> OrtCall:
    """A random call. ``sequences``: (past, new) per sequence (prefill, decode and empty rows in one
    batch); blocks assigned at random; ``slots``: "derived" (no slot_mapping), "given" (the derived
    slots, explicit) or "skip" (given, with some -1); ``quant``: "PER_TENSOR" / "PER_CHANNEL" for
    an int8 / float8e4m3fn ``cache_dtype``."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    t_dtype = TORCH_DTYPES[dtype]
    cache_dtype = cache_dtype or dtype
    hq, hk, d, bs = num_heads, 1 if latent else kv_num_heads, head_size, block_size
    n = sum(new for _, new in sequences)

    def randn(*shape: int, spread: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * spread).to(t_dtype)

    needs = [-(-(past + new) // bs) for past, new in sequences]
    assert sum(needs) <= num_blocks, "not enough blocks for the sequences"
    order = rng.permutation(num_blocks)
    cols = max(max(needs), 1) + 1
    table = torch.full((len(sequences), cols), -1, dtype=index_dtype)
    at = 0
    for b, need in enumerate(needs):
        table[b, :need] = torch.as_tensor(order[at : at + need], dtype=index_dtype)
        at += need
    cu = torch.tensor(np.concatenate([[0], np.cumsum([new for _, new in sequences])]), dtype=index_dtype)
    past = torch.tensor([p for p, _ in sequences], dtype=index_dtype)

    def cache() -> torch.Tensor:
        shape = (num_blocks, bs, hk, d)
        if cache_dtype == "int8":
            return torch.randint(-100, 101, shape, generator=g, dtype=torch.int8)
        if cache_dtype == "float8e4m3fn":
            codes = torch.randint(0, 0x7E, shape, generator=g, dtype=torch.uint8) | (
                torch.randint(0, 2, shape, generator=g, dtype=torch.uint8) << 7
            )
            return codes.view(torch.float8_e4m3fn)
        return randn(*shape)

    inputs: dict[str, torch.Tensor | None] = dict.fromkeys(INPUT_NAMES)
    if packed:
        inputs["query"] = randn(n, (hq + 2 * hk) * d)
    else:
        inputs["query"] = randn(n, hq * d)
        inputs["key"] = randn(n, hk * d)
        inputs["value"] = None if latent else randn(n, hk * d)
    inputs["key_cache"] = cache()
    inputs["value_cache"] = None if latent else cache()
    inputs.update(cumulative_sequence_length=cu, past_seqlens=past, block_table=table)
    attributes: dict[str, Any] = {"num_heads": hq, "kv_num_heads": hk}
    if rotary:
        rd = rotary_dim or d - rotary_offset
        rows = max(p + new for p, new in sequences) + 3
        angles = torch.arange(rows)[:, None] / (10000.0 ** (torch.arange(rd // 2)[None, :] * 2.0 / rd))
        inputs["cos_cache"], inputs["sin_cache"] = angles.cos().to(t_dtype), angles.sin().to(t_dtype)
        attributes.update(do_rotary=1, rotary_interleaved=int(rotary == "interleaved"))
        if rotary_offset:
            attributes["rotary_offset"] = rotary_offset
    if norm:
        inputs["q_norm_weight"] = (1 + 0.2 * torch.randn(d, generator=g)).to(t_dtype)
        inputs["k_norm_weight"] = (1 + 0.2 * torch.randn(d, generator=g)).to(t_dtype)
        attributes["qk_norm_epsilon"] = 1e-5
    if slots != "derived":
        slot = [
            int(table[b, (p + j) // bs]) * bs + (p + j) % bs for b, (p, new) in enumerate(sequences) for j in range(new)
        ]
        if slots == "skip":
            slot = [-1 if i % 3 == 1 else s for i, s in enumerate(slot)]
        inputs["slot_mapping"] = torch.tensor(slot, dtype=index_dtype)
    if sink:
        inputs["head_sink"] = randn(hq, spread=2.0)
    if quant:
        for side, name in ((0, "k"), (1, "v")):
            if latent and side:
                continue
            shape = (1,) if quant == "PER_TENSOR" else (hk, 1, d)
            top = 4.0 if cache_dtype == "int8" else 8.0
            inputs[f"{name}_scale"] = (torch.rand(shape, generator=g) * 0.05 + 0.5 / top * 0.1).float()
            attributes[f"{name}_quant_type"] = quant
    if latent:
        attributes["kv_cache_layout"] = "LATENT"
    if v_head_size:
        attributes["v_head_size"] = v_head_size
    if metadata:
        inputs["attention_metadata"] = torch.tensor(
            [max(new for _, new in sequences), max(p + x for p, x in sequences)], dtype=index_dtype
        )
    for name, value, default in (
        ("local_window_size", window, -1),
        ("softcap", softcap, 0.0),
        ("is_causal", causal, 1),
        ("scale", scale, 0.0),
    ):
        if value != default:
            attributes[name] = value
    return OrtCall(inputs, attributes)


def model_for(call: OrtCall, outputs: tuple[str, ...] = OUTPUT_NAMES, shaped: bool = False) -> onnx.ModelProto:
    """The one-node model of a call: its present inputs (typed; unranked, or with the call's static
    shapes when ``shaped``: ORT's CUDA kernel's shape inference requires ranked caches, and it picks
    its backends from static shapes), the given outputs."""
    names = [name if call.inputs[name] is not None else "" for name in INPUT_NAMES]
    while names and not names[-1]:
        names.pop()
    latent = call.attributes.get("kv_cache_layout") == "LATENT"
    outs = [o for o in outputs if not (latent and o == "value_cache_out")]
    node = helper.make_node("PagedAttention", names, outs, domain="com.microsoft", **call.attributes)
    graph_inputs = [helper.make_tensor_value_info(n, ONNX_TYPES[call.inputs[n].dtype], list(call.inputs[n].shape) if shaped else None)
                    for n in names if n]  # fmt: skip
    types = {"output": call.inputs["query"].dtype, "key_cache_out": call.inputs["key_cache"].dtype,
             "value_cache_out": call.inputs["key_cache"].dtype}  # fmt: skip
    graph_outputs = [helper.make_tensor_value_info(o, ONNX_TYPES[types[o]], None) for o in outs]
    graph = helper.make_graph([node], "ort_paged_attention", graph_inputs, graph_outputs)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def decoded(cache: torch.Tensor) -> np.ndarray:
    """float64 values of a cache's elements (float8 codes decoded, int8 as integers)."""
    if cache.dtype == torch.float8_e4m3fn:
        return float8_decode(cache.view(torch.uint8).numpy())
    return cache.double().numpy()


def rounded(values: np.ndarray, dtype: str) -> np.ndarray:
    """float64 reference values rounded once to T (through float32), as float32."""
    return round_to(values.astype(np.float32), dtype)
