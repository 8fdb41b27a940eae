"""The PyPTO ScatterPaKvCache kernel: moves on the host, bit-exact through PyPTO's interpreter, in place.

The reference is a plain loop written here (``cache[s // bs, s % bs] = key[t]``), not the
module's own. Interpreter runs (marked slow) go through PyPTO's SIM compile + pass-verify in
subprocesses with a temporary cache directory (the helper library shared, built once).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

import pakv_onnx
from pakv_onnx import cli
from pakv_onnx.pypto import runs, scatter_cases, scatter_host
from pakv_onnx.pypto import tiles as tiles_mod
from pakv_onnx.spec import CacheMode, bits_view, bitwise_equal
from pakv_onnx.validator import plan_scatter

pytestmark = pytest.mark.usefixtures("temp_cache")


def loop_reference(key, value, key_cache, value_cache, slot_mapping, cache_mode):
    """The contract, token by token, on clones: (key_cache, value_cache) after the scatter."""
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    nz = cache_mode == "PA_NZ"
    for t, s in enumerate(slot_mapping.tolist()):
        if s < 0:
            continue  # padding
        for tokens, cache in ((key, key_cache), (value, value_cache)):
            bits = bits_view(cache)
            bs = cache.shape[2] if nz else cache.shape[1]
            row = bits_view(tokens[t])
            if nz:  # fractal f of the token -> cache[s // bs, f, s % bs, :]
                bits[s // bs, :, s % bs, :] = row.reshape(cache.shape[1], cache.shape[3])
            else:
                bits[s // bs, s % bs] = row
    return key_cache, value_cache


def apply_entries(plan, tiles, key, value, key_cache, value_cache):
    """What the kernel does with the entries, in torch (views assembled into the caches)."""
    for which, tokens, cache in (("key", key, key_cache), ("value", value, value_cache)):
        entries = scatter_host.build_entries(plan, tiles, which).to(torch.int64).reshape(-1, scatter_host.MOVE_FIELDS)
        bits, token_bits = bits_view(cache), bits_view(tokens)
        group = (tiles.key_tile if which == "key" else tiles.value_tile)[0]
        for src, dst_a, dst_b, valid, first in entries.tolist():
            if valid == 0:
                continue
            if plan.mode is CacheMode.NORM:
                bits.view(-1, cache.shape[2] * cache.shape[3])[dst_a : dst_a + valid] = token_bits.reshape(
                    tokens.shape[0], -1
                )[src : src + valid]
            else:
                fractals = token_bits.reshape(tokens.shape[0], cache.shape[1], cache.shape[3])
                bits[dst_a, first : first + group, dst_b : dst_b + valid] = fractals[
                    src : src + valid, first : first + group
                ].transpose(0, 1)


def validated(key, value, key_cache, value_cache, slot_mapping, cache_mode="Norm"):
    """The kernel's plan of a call the one validator accepted."""
    return scatter_host.from_validated(plan_scatter(key, value, key_cache, value_cache, slot_mapping, cache_mode=cache_mode))


HOST_CASES = [*scatter_cases.default_case_ids(8), "scatter:bfloat16:8,128:8,128:16:64:decode:16"]


@pytest.mark.parametrize("case_id", HOST_CASES)
def test_entries_reproduce_the_loop_reference_at_every_candidate_tile(case_id):
    case = scatter_cases.build(case_id)
    plan = validated(*case.inputs(), **case.attributes())
    shape = scatter_host.shape_of(plan)
    want = loop_reference(*case.inputs(), case.cache_mode.value)
    assert bitwise_equal(want[0], case.golden()[0]) and bitwise_equal(want[1], case.golden()[1])
    candidates = scatter_host.candidate_tiles(shape)
    candidates += [t for pieces in (1, 3) for t in scatter_host._tiles_at(shape, 1, pieces)[:2]]
    for tiles in candidates:
        key_cache, value_cache = case.key_cache.clone(), case.value_cache.clone()
        apply_entries(plan, tiles, case.key, case.value, key_cache, value_cache)
        assert bitwise_equal(key_cache, want[0]) and bitwise_equal(value_cache, want[1]), (case_id, tiles)


def test_runs_become_few_moves_and_decode_tokens_one_each():
    # a prefill of 300 tokens from row 5 of a 128-row block, then 3 decode tokens, one padding token
    bs = 128
    slots = [7 * bs + 5 + i for i in range(123)] + [2 * bs + i for i in range(128)] + [9 * bs + i for i in range(49)]
    slots += [3 * bs + 17, -1, 11 * bs + 127, 4 * bs]
    key = torch.zeros((len(slots), 1, 16), dtype=torch.bfloat16)
    cache = torch.zeros((12, bs, 1, 16), dtype=torch.bfloat16)
    plan = validated(key, key, cache, cache.clone(), torch.tensor(slots), "Norm")
    runs_ = scatter_host.runs_of(plan)
    assert runs_[:, 2].tolist() == [123, 128, 49, 1, 1, 1]  # block boundaries split the prefill; padding is no run
    moves = scatter_host.build_moves(plan, 64)
    # [5, 64) [64, 128) | [0, 64) [64, 128) | [0, 49) | 3 single tokens: windows never cross a multiple of 64
    assert moves[:, 3].tolist() == [59, 64, 64, 64, 49, 1, 1, 1]
    assert (moves[:, 2] // 64 == (moves[:, 2] + moves[:, 3] - 1) // 64).all()
    assert int(moves[:, 3].sum()) == plan.written == len(slots) - 1
    tiles = scatter_host.ScatterTiles(64, 3, (32, 16), (32, 16))
    entries = scatter_host.build_entries(plan, tiles, "key")
    assert entries.dtype == torch.int32 and entries.shape == (3, 3 * scatter_host.MOVE_FIELDS)
    assert entries.reshape(-1, 5)[-1, 3] == 0  # the last task is padded with a move of no rows


def test_pa_nz_moves_repeat_per_fractal_group():
    key = torch.zeros((3, 4, 16), dtype=torch.float16)  # 64 halves = 128 bytes = 4 fractals of E = 16
    cache = torch.zeros((4, 4, 8, 16), dtype=torch.float16)  # [nb, C, bs, E]
    plan = validated(key, key, cache, cache.clone(), torch.tensor([10, 11, -1]), "PA_NZ")
    tiles = scatter_host.ScatterTiles(2, 1, (2, 2), (4, 2))
    key_entries = scatter_host.build_entries(plan, tiles, "key")
    assert key_entries[:, 4].tolist() == [0, 2]  # one move (rows 2..3 of block 1), two groups of 2 fractals
    assert key_entries[:, 1].tolist() == [1, 1] and key_entries[:, 2].tolist() == [2, 2]
    assert key_entries[:, 3].tolist() == [2, 2]
    assert scatter_host.build_entries(plan, tiles, "value")[:, 4].tolist() == [0]


def test_the_kernels_refusals_are_named():
    """What the validator accepts and the kernel cannot do is refused by name (the contract's own
    violations are the validator's: tests/test_scatter.py)."""
    key = torch.zeros((3, 2, 16), dtype=torch.bfloat16)
    cache = torch.zeros((4, 8, 2, 16), dtype=torch.bfloat16)
    slots = torch.tensor([1, 2, 3], dtype=torch.int32)
    fp8_key = torch.zeros((3, 2, 32), dtype=torch.float8_e5m2)
    fp8 = validated(fp8_key, key, torch.zeros((4, 8, 2, 32), dtype=torch.float8_e5m2), cache, slots)
    assert "float8_e5m2" in scatter_host.unsupported_reason(fp8) and "pass-verify" in scatter_host.unsupported_reason(
        fp8
    )
    narrow = torch.zeros((3, 1, 8), dtype=torch.bfloat16)  # 16-byte rows
    plan = validated(narrow, key, torch.zeros((4, 8, 1, 8), dtype=torch.bfloat16), cache, slots, "Norm")
    assert "32 bytes" in scatter_host.unsupported_reason(plan)
    pool = torch.zeros((4, 2, 8, 2, 16), dtype=torch.bfloat16)
    assert "strided" in scatter_host.unsupported_reason(plan, (key, key, pool[:, 0], pool[:, 1]))


def test_a_validated_plan_maps_onto_the_kernels_plan():
    case = scatter_cases.build("scatter-mixed-nz")
    plan = validated(*case.inputs(), **case.attributes())
    assert plan.mode is CacheMode.PA_NZ and plan.num_tokens == case.key.shape[0]
    assert plan.key_width == case.key.shape[1] * case.key.shape[2] and plan.value_width == case.value.shape[1] * case.value.shape[2]
    assert (plan.key_dtype, plan.value_dtype) == (case.key.dtype, case.value.dtype)
    assert plan.slots.dtype == torch.int64 and torch.equal(plan.slots, case.slot_mapping.to(torch.int64))


def test_the_rule_fits_the_buffer_and_prefers_few_rounds():
    for case_id in scatter_cases.REPRESENTATIVE:
        case = scatter_cases.build(case_id.replace(":1024:", ":64:").replace("prefill4:4096", "prefill4:1024"))
        plan = validated(*case.inputs(), **case.attributes())
        shape = scatter_host.shape_of(plan)
        rule = scatter_host.rule_tiles(shape)
        assert scatter_host.valid_for(rule, shape), (case_id, rule)
        assert all(b <= tiles_mod.VECTOR_BUFFER_BYTES for b in scatter_host.tile_bytes(rule, shape))


def test_tuned_scatter_tiles_are_cached_and_checked():
    case = scatter_cases.build("scatter-kernel-3")
    plan = validated(*case.inputs(), **case.attributes())
    shape = scatter_host.shape_of(plan)
    assert scatter_host.tuned(shape) is None and scatter_host.choose_tiles(plan) == scatter_host.rule_tiles(shape)
    pick = scatter_host._tiles_at(shape, 4, 2)[0]
    scatter_host.remember(shape, pick)
    assert scatter_host.choose_tiles(plan) == pick
    scatter_host.remember(
        shape, scatter_host.ScatterTiles(3, 1, pick.key_tile, pick.value_tile)
    )  # 3 does not divide bs
    assert scatter_host.choose_tiles(plan) == scatter_host.rule_tiles(shape)


# --------------------------------------------------------------------------- #
# Through PyPTO's interpreter
# --------------------------------------------------------------------------- #
@pytest.mark.slow
def test_the_pypto_cpu_backend_updates_the_callers_caches_in_place():
    for case_id in ("scatter-nz-bfloat16", "scatter-mixed-norm", "scatter-kernel-4"):  # PA_NZ, mixed dtypes, int64
        case = scatter_cases.build(case_id)
        key, value, key_cache, value_cache, slot_mapping = case.fresh_inputs()
        key_ptr, value_ptr = key_cache.data_ptr(), value_cache.data_ptr()
        want = loop_reference(key, value, key_cache, value_cache, slot_mapping, case.cache_mode.value)
        pakv_onnx.scatter_pa_kv_cache(
            key, value, key_cache, value_cache, slot_mapping, cache_mode=case.cache_mode, backend="pypto-cpu"
        )
        assert key_cache.data_ptr() == key_ptr and value_cache.data_ptr() == value_ptr
        assert bitwise_equal(key_cache, want[0]) and bitwise_equal(value_cache, want[1]), case_id


@pytest.mark.slow
def test_verify_kernel_scatter_passes_every_dtype_layout_and_feature(capsys):
    # each of the 9 dtypes once, both layouts, mixed key/value dtypes, padding + int64 slots;
    # `pakv-onnx verify-kernel --op scatter` runs all 25 default cases
    norm = ["bfloat16", "int8", "uint16", "int32", "float32"]
    nz = ["float16", "uint8", "int16", "uint32"]
    ids = [*(f"scatter-norm-{n}" for n in norm), *(f"scatter-nz-{n}" for n in nz), *scatter_cases.FEATURE_CASES]
    code = cli.main(["verify-kernel", "--op", "scatter", "--cases", *ids])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count(" PASS ") == len(ids) and "caches updated in place" in out, out
    assert not any(runs.runs_dir().iterdir())


# The deliberate bug: the first key move lands in a slot slot_mapping never names (one wrong entry).
WRONG_ENTRY_WORKER = """
import sys
import torch
from pakv_onnx.pypto import scatter_host, worker

right = scatter_host.build_entries

def wrong(plan, tiles, which):
    entries = right(plan, tiles, which).clone()
    if which == "key":
        taken = set(plan.slots.tolist())
        spare = next(s for s in range(plan.num_blocks * plan.block_size) if s not in taken)
        if plan.mode.value == "Norm":
            entries[0, 1] = spare
        else:
            entries[0, 1], entries[0, 2] = spare // plan.block_size, spare % plan.block_size
        entries[0, 3] = 1
    return entries

scatter_host.build_entries = wrong
sys.exit(worker.worker_main(sys.argv[1]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("case_id", ["scatter-norm-int8", "scatter-nz-uint8"])  # pass in the verify test above
def test_a_wrong_entry_is_caught(tmp_path, case_id):
    script = tmp_path / "wrong_entry.py"
    script.write_text(WRONG_ENTRY_WORKER)
    request = {"op": "scatter", "mode": "verify", "case": case_id}
    result = runs.run_in_subprocess(request, worker=[sys.executable, str(script)])
    assert not result.ok
    assert "NOT bit-exact" in result.detail, result.detail  # a real mismatch, not a crash
    assert "key_cache:" in result.detail and "value_cache:" not in result.detail, result.detail
    outside = int(result.detail.split(" of them outside")[0].rsplit(" ", 1)[1])
    assert outside > 0, result.detail  # the stray row is seen as a write outside the written rows


@pytest.mark.slow
def test_tune_scatter_reports_the_floor_and_meets_it_on_a_decode_step(capsys):
    code = cli.main(
        [
            "tune",
            "--op",
            "scatter",
            "--case",
            "scatter:bfloat16:8,128:8,128:16:64:decode:16",
            "--chunks",
            "1",
            "--json",
            "--no-save",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(captured.out)
    assert result["floor_us"] > 0 and result["chosen"]["chunk"] == 1
    assert result["chosen_us"] <= 1.3 * result["floor_us"], result
    assert sum(row["chosen"] for row in result["rows"]) == 1
