"""What the front refuses by name, whatever the tensor (issue 27): an index tensor on the meta device (it
has no data to read) is the validator's ValueError naming it, on the Python API and through
``torch.ops.pakv.*`` (whose dispatcher runs the Meta kernel when any tensor is meta: among CPU tensors that
used to return uninitialised memory, or write nothing, without a word); an all-meta call of a shape-only op
keeps meta semantics. Index tensors of 2**63 - 1 rows are refused by the rule they break (the front used to
size its scratch from them first: OverflowError)."""

from __future__ import annotations

import pytest
import torch

import pakv_onnx
import pakv_onnx.export  # noqa: F401  registers torch.ops.pakv.*

KC = torch.randn(4, 4, 2, 8)
VC = torch.randn(4, 4, 2, 8)
GATHER = {"key_cache": KC, "value_cache": VC, "block_tables": torch.tensor([[0, 1]]), "seq_lens": torch.tensor([0, 6])}
SCATTER = {"key": torch.randn(2, 2, 8), "value": torch.randn(2, 2, 8), "key_cache": KC, "value_cache": VC,
           "slot_mapping": torch.tensor([0, 5])}  # fmt: skip
ATTENTION = {"query": torch.randn(1, 2, 8), "key_cache": KC, "value_cache": VC, "block_table": torch.tensor([[0, 1]]),
             "cumulative_sequence_lengths": torch.tensor([0, 1]), "past_sequence_lengths": torch.tensor([5])}  # fmt: skip
# (op, its inputs, the front, torch.ops)
OPS = {
    "gather": (GATHER, pakv_onnx.gather_pa_kv_cache, lambda *a: torch.ops.pakv.gather_pa_kv_cache(*a, None, "Norm", True)),
    "scatter": (SCATTER, pakv_onnx.scatter_pa_kv_cache, torch.ops.pakv.scatter_pa_kv_cache),
    "scatter_functional": (SCATTER, pakv_onnx.scatter_pa_kv_cache, torch.ops.pakv.scatter_pa_kv_cache_functional),
    "attention": (ATTENTION, pakv_onnx.paged_attention, torch.ops.pakv.paged_attention),
}
INDEX = {"gather": ("block_tables", "seq_lens"), "scatter": ("slot_mapping",), "scatter_functional": ("slot_mapping",),
         "attention": ("block_table", "cumulative_sequence_lengths", "past_sequence_lengths")}  # fmt: skip


def _one_on_meta(op: str, name: str) -> list[torch.Tensor]:
    inputs = OPS[op][0]
    return [t.to("meta") if n == name else t.clone() for n, t in inputs.items()]


@pytest.mark.parametrize("front", ["api", "torch.ops"])
@pytest.mark.parametrize("op, name", [(op, n) for op, names in INDEX.items() for n in names])
def test_an_index_tensor_on_meta_is_named(op: str, name: str, front: str) -> None:
    call = OPS[op][1 if front == "api" else 2]
    with pytest.raises(ValueError, match=rf"^{name}: its data is not readable on the host .*it is on meta\)$"):
        call(*_one_on_meta(op, name))


@pytest.mark.parametrize("op, name", [(op, n) for op, (inputs, _, _) in OPS.items() for n in list(inputs)[:2]])
def test_torch_ops_with_one_meta_tensor_among_cpu_tensors_refuse_it(op: str, name: str) -> None:
    args = _one_on_meta(op, name)
    before = [t.clone() for t in args if t.device.type == "cpu"]
    with pytest.raises(ValueError, match="meta"):
        OPS[op][2](*args)
    assert all(torch.equal(a, b) for a, b in zip([t for t in args if t.device.type == "cpu"], before))


def test_an_all_meta_call_of_a_shape_only_op_keeps_meta_semantics() -> None:
    out = torch.ops.pakv.paged_attention(*(t.to("meta") for t in ATTENTION.values()))
    assert out.device.type == "meta" and out.shape == (1, 2, 8)
    k, v = torch.ops.pakv.scatter_pa_kv_cache_functional(*(t.to("meta") for t in SCATTER.values()))
    assert k.device.type == "meta" and k.shape == KC.shape


HUGE = 2**63 - 1


@pytest.mark.parametrize("rows", [HUGE, 2**40])
def test_index_tensors_of_huge_row_counts_are_refused_by_their_rule(rows: int) -> None:
    table = torch.zeros(1, 1, dtype=torch.int64).expand(rows, 1)
    with pytest.raises(ValueError, match="seq_lens"):
        pakv_onnx.gather_pa_kv_cache(KC, VC, table, torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="cumulative_sequence_lengths"):
        pakv_onnx.paged_attention(ATTENTION["query"], KC, VC, table, torch.tensor([0, 1]), torch.tensor([0]))
    key = torch.zeros(1, 2, 8, dtype=KC.dtype).expand(2**40, 2, 8)  # token rows dense, token stride 0
    with pytest.raises(ValueError, match="slot_mapping must have T"):
        pakv_onnx.scatter_pa_kv_cache(key, key, KC, VC, torch.tensor([0]))
