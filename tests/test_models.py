"""Sample attention graphs end to end: torch eager, the golden reference, and their ONNX graphs."""

from __future__ import annotations

from pathlib import Path

import onnxruntime
import pytest
import torch

from pakv_onnx import runtime_plugin
from pakv_onnx.demo import ATTENTION_ATOL, SAMPLE_GRAPHS
from pakv_onnx.models import MODEL_INPUT_NAMES, MODEL_OUTPUT_NAMES, GqaPagedAttention, MlaContextAttention
from pakv_onnx.models.attention import cached_ragged_attention, masked_attention, ragged_attention, ragged_causal_mask
from pakv_onnx.spec import bitwise_equal

# (num_tokens, num_seqs, seed): several batch layouts through one exported graph.
LAYOUTS = [(64, 1, 11), (200, 4, 12), (333, 7, 13)]
PLUGIN_BACKENDS = ("native", "golden", "torch")
ORT_MINOR = int(onnxruntime.__version__.split(".")[1])


def assert_matches_reference(outputs: dict[str, torch.Tensor], reference: tuple, runner: str) -> None:
    ref_out, ref_key, ref_value = reference
    assert bitwise_equal(outputs["key"], ref_key), f"{runner}: gathered key differs"
    assert bitwise_equal(outputs["value"], ref_value), f"{runner}: gathered value differs"
    error = float((outputs["output"] - ref_out).abs().max())
    assert error <= ATTENTION_ATOL, f"{runner}: attention max abs error {error:.3g} > {ATTENTION_ATOL}"


def test_ragged_causal_mask() -> None:
    mask = ragged_causal_mask(torch.tensor([0, 2, 2, 5]), 5)
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("lengths", [[5, 0, 9, 1], [1], [0, 0, 7], [16, 3]])
def test_ragged_attention_equals_dense_masked_attention(lengths: list[int]) -> None:
    """The per-sequence loop computes what the dense [T, T] block-diagonal mask computes."""
    generator = torch.Generator().manual_seed(sum(lengths))
    total = sum(lengths)
    q, k = (torch.randn(total, 3, 8, generator=generator) for _ in range(2))
    v = torch.randn(total, 3, 5, generator=generator)
    seq_lens = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    got = ragged_attention(q, k, v, seq_lens, torch.zeros_like(seq_lens))
    want = masked_attention(q, k, v, ragged_causal_mask(seq_lens, total))
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    head_major = [x.transpose(0, 1).contiguous() for x in (q, k, v)]
    got_hm = ragged_attention(*head_major, seq_lens, torch.zeros_like(seq_lens), heads_first=True)
    assert torch.allclose(got_hm.transpose(0, 1), want, atol=1e-6, rtol=0)


def test_ragged_attention_with_past_tokens() -> None:
    """New tokens after a cached past: each attends to its sequence's past and earlier new tokens only."""
    generator = torch.Generator().manual_seed(3)
    past, new = [4, 0, 6], [2, 3, 1]
    q = torch.randn(sum(new), 2, 4, generator=generator)
    k_past, k_new = torch.randn(sum(past), 2, 4, generator=generator), torch.randn(sum(new), 2, 4, generator=generator)
    v_past, v_new = torch.randn(sum(past), 2, 6, generator=generator), torch.randn(sum(new), 2, 6, generator=generator)
    cum = lambda xs: torch.tensor([0, *xs]).cumsum(0).to(torch.int32)  # noqa: E731
    got = ragged_attention(q, torch.cat((k_past, k_new)), torch.cat((v_past, v_new)), cum(new), cum(past))
    p_cu, n_cu = cum(past).tolist(), cum(new).tolist()
    for s in range(3):  # reference: one sequence at a time, full keys, dense causal mask on its last rows
        keys = torch.cat((k_past[p_cu[s] : p_cu[s + 1]], k_new[n_cu[s] : n_cu[s + 1]]))
        values = torch.cat((v_past[p_cu[s] : p_cu[s + 1]], v_new[n_cu[s] : n_cu[s + 1]]))
        length = keys.shape[0]
        full_q = torch.cat((torch.zeros(past[s], 2, 4), q[n_cu[s] : n_cu[s + 1]]))
        mask = torch.ones(length, length, dtype=torch.bool).tril()
        want = masked_attention(full_q, keys, values, mask)[past[s] :]
        assert torch.allclose(got[n_cu[s] : n_cu[s + 1]], want, atol=1e-6, rtol=0), s


def test_cached_ragged_attention_equals_the_past_then_new_form() -> None:
    """Keys read back per sequence (past then new, one run each: the decoder step's layout) give
    what ragged_attention gives on the past-then-new layout; heads-first too."""
    generator = torch.Generator().manual_seed(4)
    past, new = [4, 0, 6, 9], [2, 3, 1, 0]
    q = torch.randn(sum(new), 2, 4, generator=generator)
    k_past, k_new = torch.randn(sum(past), 2, 4, generator=generator), torch.randn(sum(new), 2, 4, generator=generator)
    v_past, v_new = torch.randn(sum(past), 2, 6, generator=generator), torch.randn(sum(new), 2, 6, generator=generator)
    cum = lambda xs: torch.tensor([0, *xs]).cumsum(0).to(torch.int32)  # noqa: E731
    p_cu, n_cu = cum(past).tolist(), cum(new).tolist()
    runs = lambda a, b: torch.cat([torch.cat((a[p_cu[s] : p_cu[s + 1]], b[n_cu[s] : n_cu[s + 1]])) for s in range(4)])  # noqa: E731
    want = ragged_attention(q, torch.cat((k_past, k_new)), torch.cat((v_past, v_new)), cum(new), cum(past))
    kv_lens = cum([p + n for p, n in zip(past, new)])
    got = cached_ragged_attention(q, runs(k_past, k_new), runs(v_past, v_new), cum(new), kv_lens)
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    head_major = [x.transpose(0, 1).contiguous() for x in (q, runs(k_past, k_new), runs(v_past, v_new))]
    got_hm = cached_ragged_attention(*head_major, cum(new), kv_lens, heads_first=True)
    assert torch.allclose(got_hm.transpose(0, 1), want, atol=1e-6, rtol=0)
    shifted = cached_ragged_attention(q, runs(k_past, k_new), runs(v_past, v_new), cum(new), cum([p + n + 1 for p, n in zip(past, new)][:3] + [0]))
    assert not torch.allclose(shifted, want, atol=1e-3)  # a wrong run boundary is seen


@pytest.mark.parametrize("model", [MlaContextAttention(), GqaPagedAttention(block_size=16)], ids=["mla", "gqa"])
def test_eager_forward_matches_reference(model) -> None:
    for num_tokens, num_seqs, seed in LAYOUTS:
        batch = model.random_batch(num_tokens, num_seqs, seed)
        hidden = model.random_hidden_states(num_tokens, seed)
        with torch.no_grad():
            step = batch.step_inputs()
            outputs = dict(zip(MODEL_OUTPUT_NAMES, model(hidden, *step)))
        assert_matches_reference(outputs, model.reference_forward(hidden, batch), "eager")
        assert bitwise_equal(step[2], batch.key_cache) and bitwise_equal(step[3], batch.value_cache)  # written in place


def test_step_inputs_leave_the_written_rows_out_of_the_caches() -> None:
    """The step's rows are missing from its caches until the write op puts them there."""
    model = GqaPagedAttention(block_size=16)
    batch = model.random_batch(100, 3, 4)
    new_key, new_value, key_cache, value_cache, slots, *_ = batch.step_inputs()
    assert slots.dtype == torch.int32 and int(slots[-1]) == -1  # one padding row
    lengths = (batch.seq_lens[1:] - batch.seq_lens[:-1]).tolist()
    assert len(slots) == sum(max(1, n // 4) for n in lengths if n) + 1
    assert not bitwise_equal(key_cache, batch.key_cache)
    rows = key_cache.view(-1, *key_cache.shape[2:])
    assert int(rows[slots[:-1].long()].abs().sum()) == 0
    assert bitwise_equal(new_key[:-1], batch.key_cache.view(-1, *key_cache.shape[2:])[slots[:-1].long()])
    hidden = model.random_hidden_states(100, 4)
    with torch.no_grad():  # every slot -1 (nothing written): the gather reads the holes
        _, key, _ = model(hidden, new_key, new_value, key_cache, value_cache, torch.full_like(slots, -1), *batch.step_inputs()[5:])
    assert not bitwise_equal(key, model.reference_forward(hidden, batch)[1])


def test_reference_sees_a_wrong_block() -> None:
    """The comparison can fail: swapping two used blocks of the table changes the gather."""
    model = GqaPagedAttention(block_size=16)
    batch = model.random_batch(100, 2, 3)
    hidden = model.random_hidden_states(100, 3)
    tables = batch.block_tables.clone()
    row = int((batch.seq_lens[1:] - batch.seq_lens[:-1]).argmax())
    used = [c for c in range(tables.shape[1]) if int(tables[row, c]) >= 0]
    tables[row, used[0]], tables[row, used[1]] = int(tables[row, used[1]]), int(tables[row, used[0]])
    new_key, new_value, key_cache, value_cache, slots, _, seq_lens, seq_offset = batch.step_inputs()
    with torch.no_grad():
        out, key, _ = model(hidden, new_key, new_value, key_cache, value_cache, slots, tables, seq_lens, seq_offset)
    _, ref_key, _ = model.reference_forward(hidden, batch)
    assert not bitwise_equal(key, ref_key)


@pytest.fixture(scope="module", params=list(SAMPLE_GRAPHS))
def exported(request, tmp_path_factory) -> tuple:
    graph = SAMPLE_GRAPHS[request.param]
    model = graph.build(0).eval()
    num_tokens, num_seqs, seed = LAYOUTS[1]
    batch = model.random_batch(num_tokens, num_seqs, seed)
    inputs = (model.random_hidden_states(num_tokens, seed), *batch.step_inputs())
    path = Path(tmp_path_factory.mktemp("models")) / f"{graph.name}.onnx"
    model.export_onnx(inputs, path)
    return model, path


def _runners(path: Path) -> dict[str, onnxruntime.InferenceSession]:
    sessions = {f"plugin:{b}": runtime_plugin.make_session(path, backend=b) for b in PLUGIN_BACKENDS}
    sessions["stock-ort"] = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sessions


def test_onnx_graph_matches_reference_on_every_backend(exported) -> None:
    model, path = exported
    sessions = _runners(path)
    for num_tokens, num_seqs, seed in LAYOUTS:  # one graph, several Q / T / num_blocks
        batch = model.random_batch(num_tokens, num_seqs, seed)
        hidden = model.random_hidden_states(num_tokens, seed)
        reference = model.reference_forward(hidden, batch)
        for runner, session in sessions.items():
            feeds = dict(zip(MODEL_INPUT_NAMES, (hidden, *batch.step_inputs())))  # fresh caches, rows missing
            assert_matches_reference(runtime_plugin.run(session, feeds), reference, f"{runner} T={num_tokens}")
            if runner.startswith("plugin:"):  # the updated caches feed only the gather: the alias route
                in_place = bitwise_equal(feeds["key_cache"], batch.key_cache)
                assert in_place == (ORT_MINOR >= 18), f"{runner}: onnxruntime {onnxruntime.__version__}, in place {in_place}"


# Run in a child process under a 4 GiB address-space cap: 128 sequences of 64 tokens (T = 8192).
# Dense attention over the packed batch would allocate 8 heads x 8192^2 fp32 = 2 GiB per score
# tensor and fail; per-sequence attention needs [8, 64, 64] scores at a time.
_MEMORY_CHILD = r"""
import os, resource, sys, tempfile
import onnxruntime, torch
from pakv_onnx import runtime_plugin
from pakv_onnx.models import MODEL_INPUT_NAMES, GqaPagedAttention
model = GqaPagedAttention(num_heads=8, num_kv_heads=2, head_dim=32, hidden_size=128, block_size=16).eval()
folder = tempfile.TemporaryDirectory()  # removed when this process ends
path = os.path.join(folder.name, "gqa.onnx")
model.export_onnx(model.example_inputs(64, 3, 0), path)
cap = 4 << 30
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
seqs, length, bs = 128, 64, 16
tokens, blocks = seqs * length, seqs * length // bs
g = torch.Generator().manual_seed(0)
tables = torch.randperm(blocks, generator=g).to(torch.int32).reshape(seqs, length // bs)
caches = [torch.randn(blocks, bs, 2, 32, generator=g).to(torch.bfloat16) for _ in range(2)]
seq_lens = torch.arange(0, tokens + 1, length, dtype=torch.int32)
pad = (torch.zeros(1, 2, 32).to(torch.bfloat16),) * 2  # the step writes nothing (one padding row, slot -1)
no_slot = torch.tensor([-1], dtype=torch.int32)
inputs = (torch.randn(tokens, 128, generator=g), *pad, *caches, no_slot, tables, seq_lens, torch.zeros(seqs, dtype=torch.int32))
session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
out = runtime_plugin.run(session, dict(zip(MODEL_INPUT_NAMES, inputs)))
# Spot-check one sequence against the eager model on just that sequence.
q = 77
rows = slice(q * length, (q + 1) * length)
one = (inputs[0][rows], *pad, *caches, no_slot, tables[q:q + 1], seq_lens[:2], torch.zeros(1, dtype=torch.int32))
with torch.no_grad():
    ref = model(*one)[0]
err = float((out["output"][rows] - ref).abs().max())
print("OK", tokens, err)
"""


@pytest.mark.slow  # exports in a child process: 30-40 s on a busy machine
def test_exported_attention_memory_is_per_sequence() -> None:
    """T = 8192 in 128 sequences runs in ONNX Runtime under a 4 GiB address-space cap (dense would need > 2 GiB
    per score tensor; the previous dense graphs fail this with an arena allocation error)."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _MEMORY_CHILD], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    status, tokens, err = result.stdout.split()[-3:]
    assert status == "OK" and int(tokens) == 8192
    assert float(err) <= ATTENTION_ATOL
