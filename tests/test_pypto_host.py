"""The PyPTO kernel's host side without pypto: entries, tiles, refusals, memory, run directories, cases."""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import pytest
import torch

from pakv_onnx import cli
from pakv_onnx.cases import random_case
from pakv_onnx.pypto import cases, host, runs
from pakv_onnx.pypto import tiles as tiles_mod
from pakv_onnx.spec import CacheMode, bitwise_equal, nz_last_dim
from pakv_onnx.validator import plan_gather


def _plan(case):
    return plan_gather(*case.inputs(), **case.attributes())


def gather_by_entries(plan, key_cache, value_cache, chunk):
    """What the kernel does with the entries, in torch: each entry's views assembled into the outputs."""
    if plan.cache_mode is CacheMode.NORM:
        entries = host.build_entries(plan, chunk).to(torch.int64)
    else:
        shape = tiles_mod.shape_of(plan, key_cache.element_size(), value_cache.element_size())
        tiles = tiles_mod.entry_tiles(shape, chunk)
        entries = host.build_nz_entries(plan, tiles, key_cache.shape[1], value_cache.shape[1]).to(torch.int64)
        groups = (tiles.key_tile[0], tiles.value_tile[0])
    outs = []
    for index, (cache, out_shape) in enumerate(((key_cache, plan.key_out_shape), (value_cache, plan.value_out_shape))):
        out = torch.zeros(out_shape, dtype=cache.dtype)
        for row in entries.tolist():
            first, slot, dst, valid = row[:4]
            if plan.cache_mode is CacheMode.NORM:
                rows = cache.reshape(-1, cache.shape[2], cache.shape[3])  # [nb*bs, H, D]
                out[dst : dst + valid] = rows[first : first + valid]
            else:  # block [C, bs, E]: fractals f0 .. f0+group of valid slots -> out[dst.., f0.., :]
                f0, group = row[4 + index], groups[index]
                part = cache[first, f0 : f0 + group, slot : slot + valid, :].transpose(0, 1)
                out.view(out.shape[0], cache.shape[1], cache.shape[3])[dst : dst + valid, f0 : f0 + group] = part
        outs.append(out)
    return outs


@pytest.mark.parametrize(
    "case_id", ["kernel-0", "kernel-1", "kernel-2", "kernel-5", "nz-int8", "level9", *cases.FEATURE_CASES]
)
def test_entries_reproduce_the_golden_at_every_chunk(case_id):
    case = cases.build_case(case_id)
    plan = _plan(case)
    golden = case.golden()
    for chunk in tiles_mod.candidate_chunks(plan.block_size):
        key, value = gather_by_entries(plan, case.key_cache, case.value_cache, chunk)
        assert bitwise_equal(key, golden[0]) and bitwise_equal(value, golden[1]), (case_id, chunk)


def test_nz_entries_cover_every_fractal_group_once_per_chunk():
    case = cases.build_case("shape:bfloat16:1,512:1,64:128:4:55:PA_NZ")  # key C = 32, value C = 4
    plan = _plan(case)
    shape = tiles_mod.shape_of(plan, 2, 2)
    tiles = tiles_mod.Tiles("entries", 16, (4, 16), (2, 16))  # 8 key groups, 2 value groups
    entries = host.build_nz_entries(plan, tiles, 32, 4)
    assert entries.dtype == torch.int32 and entries.shape == (8 * shape.tasks(16), 6)
    first_chunk = entries[:8]
    assert first_chunk[:, 4].tolist() == [0, 4, 8, 12, 16, 20, 24, 28]
    assert first_chunk[:, 5].tolist() == [0, 2] * 4  # value groups repeat (2 divides 8)
    assert (first_chunk[:, :4] == first_chunk[0, :4]).all()
    with pytest.raises(ValueError, match="divide"):
        host.build_nz_entries(plan, tiles_mod.Tiles("entries", 16, (3, 16), (2, 16)), 32, 4)
    assert not tiles_mod.valid_for(tiles_mod.Tiles("entries", 16, (32, 16), (3, 16)), shape)


def test_entries_are_int32_one_per_chunk_and_never_cross_a_block():
    case = cases.build_case("kernel-2")
    plan = _plan(case)
    for chunk in tiles_mod.candidate_chunks(plan.block_size):
        entries = host.build_entries(plan, chunk)
        assert entries.dtype == torch.int32 and entries.shape[1] == 4
        assert entries.shape[0] == sum(-(-int(n) // chunk) for n in plan.seq_lengths)
        assert int(entries[:, 3].min()) >= 1 and int(entries[:, 3].max()) <= chunk
        assert int(entries[:, 3].sum()) == plan.num_tokens
    with pytest.raises(ValueError, match="divide block_size"):
        host.build_entries(plan, plan.block_size + 1)


SHAPE_IDS = [*cases.seed_case_ids(), cases.T4096_CASE, "nz-bfloat16", "nz-float32", "dtype-int8"]


@pytest.mark.parametrize("case_id", SHAPE_IDS)
def test_rule_tiles_fit_the_vector_buffer_and_divide_the_block(case_id):
    case = cases.build_case(case_id)
    plan = _plan(case)
    shape = tiles_mod.shape_of(plan, case.key_cache.element_size(), case.value_cache.element_size())
    chosen = tiles_mod.rule_tiles(shape)
    assert plan.block_size % chosen.chunk == 0
    assert tiles_mod.fits(chosen, shape)
    if shape.mode == "Norm":
        assert chosen.key_tile[1] == shape.key_width or chosen.key_tile[0] == 1


def test_the_seed_rule_overflows_the_buffer_at_64_heads_and_the_candidates_do_not():
    plan = _plan(cases.build_case("heads64_k128_v128"))
    shape = tiles_mod.shape_of(plan, 2, 2)
    assert tiles_mod.seed_tiles(shape).key_tile[0] == 8  # heads*dim >= 4096: [8, 8]
    wide = dataclasses.replace(shape, key_width=64 * 128)
    assert tiles_mod.entry_tiles(wide, 16).key_tile[0] * 64 * 128 * 2 <= tiles_mod.VECTOR_BUFFER_BYTES
    assert all(tiles_mod.fits(t, shape) for t in tiles_mod.candidate_tiles(shape))


def test_a_row_wider_than_the_buffer_is_split_into_aligned_columns():
    rows, cols = tiles_mod.norm_tile(16, 128 * 1024, 2)  # fp16: 256 KiB per token
    assert rows == 1 and (128 * 1024) % cols == 0 and (cols * 2) % 32 == 0
    assert cols * 2 <= tiles_mod.VECTOR_BUFFER_BYTES


def test_refusals_are_named():
    def reason(case, value_cache=None):
        return host.unsupported_reason(_plan(case), case.key_cache, value_cache if value_cache is not None else case.value_cache)

    fp8 = random_case(1, dtype=torch.float8_e4m3fn, cache_mode=CacheMode.PA_NZ)
    assert "float8_e4m3fn" in reason(fp8) and "pass-verify" in reason(fp8)
    misaligned = cases.shape_case(torch.bfloat16, (1, 7), (1, 16), 4, 1, 3)
    assert "32 bytes" in reason(misaligned)
    case = cases.build_case("kernel-1")
    strided = torch.cat((case.value_cache, case.value_cache), dim=1)[:, : case.value_cache.shape[1]]
    assert not strided.is_contiguous() and bitwise_equal(strided.contiguous(), case.value_cache)
    assert "strided" in reason(case, strided) and "value_cache" in reason(case, strided)
    for name in cases.dtype_by_name():
        for prefix in ("dtype-", "nz-"):
            assert reason(cases.build_case(prefix + name)) is None, prefix + name


def test_random_n_is_the_same_case_as_in_every_other_command():
    for seed in (0, 3, 7):
        mine, theirs = cases.build_case(f"random-{seed}"), random_case(seed)
        for a, b in zip(mine.inputs(), theirs.inputs()):
            assert (a is None and b is None) or bitwise_equal(a, b)
        assert mine.attributes() == theirs.attributes()


def test_lengths_mode_and_offsets_become_entries_on_the_host():
    case = cases.build_case("lengths")
    assert not case.is_seq_lens_cumsum and int(case.seq_offset.max()) > 0
    plan = _plan(case)
    entries = host.build_entries(plan, plan.block_size)
    starts = torch.cumsum(case.seq_lens.to(torch.int64), 0) - case.seq_lens.to(torch.int64)
    first_of_seq = [int(s) for s, n in zip(starts, case.seq_lens) if int(n)]
    assert sorted(set(first_of_seq)) == sorted(set(first_of_seq) & set(entries[:, 2].tolist()))


def test_memory_refusal_gives_the_estimate(monkeypatch):
    assert runs.memory_refusal(10 * 2**20, "verify", available=64 * 2**30) is None
    message = runs.memory_refusal(812 * 2**20, "verify", available=20 * 2**30)
    assert message and "GiB" in message and "812.0 MiB" in message and "20.0 GiB is available" in message


def test_pypto_cpu_refuses_a_call_that_cannot_fit(monkeypatch, temp_cache):
    from pakv_onnx import gather_pa_kv_cache
    from pakv_onnx.kernels import BackendUnavailableError

    monkeypatch.setattr(runs, "available_bytes", lambda: 2**20)
    case = cases.build_case("level0")
    with pytest.raises(BackendUnavailableError, match=r"pypto-cpu.*needs about .* GiB.*available"):
        gather_pa_kv_cache(*case.inputs(), **case.attributes(), backend="pypto-cpu")


def test_verify_kernel_checks_memory_only_for_the_cpu_interpreter(monkeypatch):
    from pakv_onnx.commands import verify_kernel

    monkeypatch.setattr(runs, "available_bytes", lambda: 2**20)
    built = verify_kernel._build_all(["level0"])
    kernel, memory = verify_kernel._refusals(built, "cpu")
    assert not kernel and len(memory) == 1 and "needs about" in memory[0], memory
    assert verify_kernel._refusals(built, "npu") == ({}, [])  # the NPU's memory is not the interpreter's


def test_failed_run_directories_are_bounded(temp_cache):
    for i in range(runs.KEEP_FAILED_RUNS + 4):
        path = runs.new_run_dir(f"failed-{i}")
        stamp = time.time() - 1000 + i
        os.utime(path, (stamp, stamp))
    removed = runs.prune_failed_runs()
    left = sorted(p.name for p in runs.runs_dir().iterdir())
    assert len(left) == runs.KEEP_FAILED_RUNS and len(removed) == 4
    assert all("failed-0-" not in name for name in left)  # the oldest went first
    newest = max(runs.runs_dir().iterdir(), key=lambda p: p.stat().st_mtime)
    (newest / "big.bin").write_bytes(b"\0" * 4096)
    removed = runs.prune_failed_runs(max_bytes=1024)
    assert [p.name for p in runs.runs_dir().iterdir()] == [newest.name]  # the newest stays, even over the cap
    assert len(removed) == runs.KEEP_FAILED_RUNS - 1


DYING_WORKER = """
import os, signal, sys
from pakv_onnx.pypto import worker

def execute(item, kernel_fn=None):
    with open({ran!r}, "a") as handle:
        handle.write(item["case"] + "\\n")
    if item["case"] == "dies":
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel OOM killer would
    return {{"ok": True, "detail": "ran " + item["case"], "tiles": None}}

worker.execute = execute
sys.exit(worker.worker_main(sys.argv[1]))
"""


def test_a_batch_whose_subprocess_dies_blames_the_item_it_died_on(tmp_path, temp_cache):
    ran = tmp_path / "ran.txt"
    script = tmp_path / "dying_worker.py"
    script.write_text(DYING_WORKER.format(ran=str(ran)))
    items = [{"mode": "cost", "case": c} for c in ("a", "b", "dies", "c")]
    results = runs.run_batch(items, worker=[sys.executable, str(script)])
    assert [(r.case_id, r.ok) for r in results] == [("a", True), ("b", True), ("dies", False), ("c", True)]
    assert "killed" in results[2].detail and os.path.isdir(results[2].run_dir), results[2]
    assert ran.read_text().split() == ["a", "b", "dies", "c"]  # what passed before the death is not run again


def test_tuned_tiles_are_cached_and_used(temp_cache):
    case = cases.build_case("level3")
    plan = _plan(case)
    shape = tiles_mod.shape_of(plan, 2, 2)
    assert tiles_mod.tuned(shape) is None
    pick = tiles_mod.entry_tiles(shape, 4)
    tiles_mod.remember(shape, pick)
    assert tiles_mod.tuned(shape) == pick
    assert host.choose_tiles(plan, torch.bfloat16, torch.bfloat16) == pick
    other = _plan(cases.build_case("level4"))
    assert host.choose_tiles(other, torch.bfloat16, torch.bfloat16) == tiles_mod.rule_tiles(
        tiles_mod.shape_of(other, 2, 2)
    )


def test_another_pypto_version_is_refused(monkeypatch):
    from pakv_onnx.pypto import adapter

    monkeypatch.setattr(adapter, "pypto_version", lambda: "0.3.0")
    with pytest.raises(adapter.AdapterError, match=r"0\.2\.0.*0\.3\.0"):
        adapter.check_version()


def test_cli_usage_errors_exit_2(capsys, temp_cache):
    assert cli.main(["verify-kernel", "--cases", "level0", "nope"]) == 2
    assert "unknown case id 'nope'" in capsys.readouterr().err
    assert cli.main(["tune", "--case", "nope"]) == 2
    assert cli.main(["tune", "--jobs", "0"]) == 2  # argparse's refusal, returned as the exit code
    assert "--jobs: must be >= 1, got 0" in capsys.readouterr().err
    assert cli.main(["tune", "--case", "random-3"]) == 2  # a case the kernel refuses: said why
    assert "32 bytes" in capsys.readouterr().err


def test_verify_kernel_on_npu_fails_clearly_without_one(capsys):
    assert cli.main(["verify-kernel", "--device", "npu", "--cases", "level0"]) == 2
    err = capsys.readouterr().err
    assert "--device npu needs an Ascend NPU" in err and "torch_npu" in err


def test_verify_kernel_list_shows_t_and_covers_the_contract(capsys):
    assert cli.main(["verify-kernel", "--list"]) == 0
    out = capsys.readouterr().out
    assert "t4096                T=4096" in out
    assert "PA_NZ" in out and "(lengths)" in out
    for name in cases.dtype_by_name():
        assert f"dtype-{name} " in out and f"nz-{name} " in out
    expected_e = nz_last_dim(1)
    assert f", {expected_e}]" in out  # an int8 PA_NZ cache, E = 32
