"""Valid degenerate calls run on every path, as the contract says (issue 27): a write of padding slots
only into a pool of 0 blocks, a write of T = 0 tokens (stock ORT's fallback too), attention with head_dim
0 (every score 0: the mean of the visible values) or value_head_dim 0. They used to be refused by an
internal NULL-pointer check (torch's empty tensors have no address) or to fail in the fallback's Reshape
(-1 beside a 0); ORT's native kernel alone accepted them."""

from __future__ import annotations

import functools

import onnxruntime as ort
import pytest
import torch

import pakv_onnx
from pakv_onnx import runtime_plugin
from pakv_onnx.export import make_attention_model_for, make_scatter_model_for
from pakv_onnx.spec import ATTENTION, SCATTER, CacheMode

PATHS = ["native", "golden", "torch", "auto", "torch.ops", "torch.ops-functional", "ort-native", "ort-golden", "ort-torch", "stock"]
ATTENTION_PATHS = [p for p in PATHS if p != "torch.ops-functional"]


def _session(model, path: str):
    if path == "stock":
        return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return runtime_plugin.make_session(model, backend=path.removeprefix("ort-"))


def scatter(path: str, inputs: dict[str, torch.Tensor], mode: CacheMode) -> tuple[torch.Tensor, torch.Tensor]:
    """The updated caches by ``path`` (in place for the API and torch.ops, ORT's outputs otherwise)."""
    args = [inputs[n] for n in SCATTER.input_names]
    if path in ("native", "golden", "torch", "auto"):
        return pakv_onnx.scatter_pa_kv_cache(*args, cache_mode=mode, backend=path)
    if path == "torch.ops":
        torch.ops.pakv.scatter_pa_kv_cache(*args, mode.value)
        return args[2], args[3]
    if path == "torch.ops-functional":
        return torch.ops.pakv.scatter_pa_kv_cache_functional(*args, mode.value)
    model = make_scatter_model_for(*args, cache_mode=mode, fallback=path == "stock")
    out = runtime_plugin.run(_session(model, path), inputs)
    return out["key_cache_out"], out["value_cache_out"]


def scatter_inputs(mode: CacheMode, num_blocks: int, slots: list[int]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(num_blocks + len(slots))
    cache = (num_blocks, 4, 2, 8) if mode is CacheMode.NORM else (num_blocks, 2, 4, 8)
    token = (2, 8) if mode is CacheMode.NORM else (1, 16)
    return {
        "key": torch.randn(len(slots), *token, generator=gen),
        "value": torch.randn(len(slots), *token, generator=gen),
        "key_cache": torch.randn(*cache, generator=gen),
        "value_cache": torch.randn(*cache, generator=gen),
        "slot_mapping": torch.tensor(slots, dtype=torch.int64),
    }


@pytest.mark.parametrize("mode", list(CacheMode))
@pytest.mark.parametrize("path", PATHS)
def test_a_write_of_padding_only_into_a_pool_of_no_blocks(path: str, mode: CacheMode) -> None:
    inputs = scatter_inputs(mode, 0, [-1, -1, -1])
    key_cache, value_cache = scatter(path, inputs, mode)
    assert key_cache.shape == inputs["key_cache"].shape and value_cache.shape == inputs["value_cache"].shape


@pytest.mark.parametrize("mode", list(CacheMode))
@pytest.mark.parametrize("path", PATHS)
def test_a_write_of_no_token_changes_nothing(path: str, mode: CacheMode) -> None:
    inputs = scatter_inputs(mode, 3, [])
    before = inputs["key_cache"].clone(), inputs["value_cache"].clone()
    key_cache, value_cache = scatter(path, inputs, mode)
    assert torch.equal(key_cache, before[0]) and torch.equal(value_cache, before[1])


@functools.cache
def _attention_session(path: str, head_dim: int, value_dim: int):
    return _session(make_attention_model_for(*attention_inputs(head_dim, value_dim).values(), fallback=path == "stock"), path)


def attention_inputs(head_dim: int, value_dim: int) -> dict[str, torch.Tensor]:
    """Two sequences: 3 past + 2 new, 0 past + 1 new; 4 query heads over 2 kv heads."""
    gen = torch.Generator().manual_seed(head_dim * 10 + value_dim)
    return {
        "query": torch.randn(3, 4, head_dim, generator=gen),
        "key_cache": torch.randn(3, 4, 2, head_dim, generator=gen),
        "value_cache": torch.randn(3, 4, 2, value_dim, generator=gen),
        "block_table": torch.tensor([[0, 2], [1, -1]]),
        "cumulative_sequence_lengths": torch.tensor([0, 2, 3]),
        "past_sequence_lengths": torch.tensor([3, 0]),
    }


def attend(path: str, head_dim: int, value_dim: int) -> torch.Tensor:
    inputs = attention_inputs(head_dim, value_dim)
    args = [inputs[n] for n in ATTENTION.input_names]
    if path in ("native", "golden", "torch", "auto"):
        return pakv_onnx.paged_attention(*args, backend=path)
    if path == "torch.ops":
        return torch.ops.pakv.paged_attention(*args)
    return runtime_plugin.run(_attention_session(path, head_dim, value_dim), inputs)["output"]


@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_attention_with_head_dim_zero_averages_the_visible_values(path: str) -> None:
    """Every score is 0 (an empty dot product): each query head gets the mean of the values it sees."""
    values = attention_inputs(0, 5)["value_cache"]
    contexts = [torch.cat((values[0], values[2]))[:5], values[1][:1]]  # [L, Hk, Dv] per sequence
    want = torch.stack([contexts[0][:4].mean(0), contexts[0][:5].mean(0), contexts[1][:1].mean(0)])
    want = want.repeat_interleave(2, dim=1)  # query heads 0, 1 read kv head 0; 2, 3 kv head 1
    got = attend(path, 0, 5)
    assert got.shape == (3, 4, 5)
    assert torch.allclose(got, want, atol=1e-6), path


@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_attention_with_no_value_channel_is_an_empty_output(path: str) -> None:
    assert attend(path, 8, 0).shape == (3, 4, 0)
