"""The PyPTO kernel on a CPU: pass-verify bit-exactness, a wrong kernel caught, the tile rule, the cost model.

The SIM/verify tests run PyPTO in subprocesses (one per case) through :mod:`pakv_onnx.pypto_sim`;
they share the project cache directory, so PyPTO's helper library is built once per machine.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from pakv_onnx import cli, pypto_sim
from pakv_onnx.cases import random_case, seed_cases
from pakv_onnx.kernels import pypto_nd
from pakv_onnx.spec import CacheMode, plan_gather


# --------------------------------------------------------------------------- #
# Pure host logic (no pypto needed)
# --------------------------------------------------------------------------- #
def _shapes():
    """(id, key width, value width, block size) of every seed and manual shape plus T=4096."""
    rows = [
        (
            s.case_id,
            s.key_cache_shape[2] * s.key_cache_shape[3],
            s.value_cache_shape[2] * s.value_cache_shape[3],
            s.key_cache_shape[1],
        )
        for s in seed_cases()
    ]
    return rows + [("t4096", 512, 64, 128)]


@pytest.mark.parametrize("case_id,key_width,value_width,block_size", _shapes())
def test_chosen_tiles_fit_the_vector_buffer(case_id, key_width, value_width, block_size):
    tiles = pypto_nd.choose_tiles_for(key_width, value_width, block_size, itemsize=2)
    for rows, cols, width in (
        (tiles.key_rows, tiles.key_cols, key_width),
        (tiles.value_rows, tiles.value_cols, value_width),
    ):
        assert cols == width
        assert block_size % rows == 0
        assert pypto_nd.tile_bytes(rows, cols, 2) <= pypto_nd.VECTOR_BUFFER_BYTES
        # largest: the next divisor of the block would not fit
        bigger = [d for d in range(rows + 1, block_size + 1) if block_size % d == 0]
        assert not bigger or not pypto_nd.tile_fits(bigger[0], cols, 2)


def test_seed_default_does_not_fit_64_heads_but_the_rule_does():
    seed = pypto_nd.seed_tiles_for(1 * 512, 1 * 64)
    assert (seed.key_rows, seed.value_rows) == (16, 32)
    big = pypto_nd.seed_tiles_for(64 * 128, 64 * 128)
    assert (big.key_rows, big.value_rows) == (8, 8)
    # 16 rows x 64 heads x 128 x bf16 = 262,144 bytes: the seed's [16, 32] does not fit
    assert not pypto_nd.tile_fits(16, 64 * 128, 2)
    chosen = pypto_nd.choose_tiles_for(64 * 128, 64 * 128, 128, 2)
    assert pypto_nd.tile_fits(chosen.key_rows, chosen.key_cols, 2)


def test_a_row_wider_than_the_buffer_is_split_into_aligned_columns():
    width = 128 * 1024  # fp16: 256 KiB per token
    rows, cols = pypto_nd.row_tile(width, 16, 2)
    assert rows == 1 and width % cols == 0 and (cols * 2) % 32 == 0
    assert pypto_nd.tile_fits(1, cols, 2)


def test_unsupported_options_are_named():
    def reason(case):
        plan = plan_gather(*case.inputs(), **case.attributes())
        return pypto_nd.unsupported_reason(plan, case.key_cache)

    assert "PA_NZ" in reason(random_case(1, dtype=torch.bfloat16, cache_mode=CacheMode.PA_NZ))
    assert "float32" in reason(random_case(1, dtype=torch.float32, cache_mode=CacheMode.NORM))
    misaligned = pypto_sim.shape_case(torch.bfloat16, (1, 7), (1, 16), 4, 1, 3)
    assert "32 bytes" in reason(misaligned)
    for seed, dtype in ((0, torch.bfloat16), (1, torch.float16), (2, torch.int8)):
        assert reason(pypto_sim.random_kernel_case(seed, dtype)) is None


def test_lengths_mode_becomes_cumsum_on_the_host():
    case = next(c for c in (pypto_sim.random_kernel_case(s) for s in range(50)) if not c.is_seq_lens_cumsum)
    plan = plan_gather(*case.inputs(), **case.attributes())
    key_out = torch.empty(plan.key_out_shape, dtype=plan.dtype)
    value_out = torch.empty(plan.value_out_shape, dtype=plan.dtype)
    _, _, tables, starts, cols, key_rows, _ = pypto_nd.kernel_inputs(
        plan, case.key_cache, case.value_cache, key_out, value_out
    )
    lengths = case.seq_lens.to(torch.int64)
    assert starts.dtype == torch.int32 and tables.dtype == torch.int32 and cols.dtype == torch.int32
    assert starts.tolist() == [0, *torch.cumsum(lengths, 0).tolist()]
    assert cols.tolist() == (case.seq_offset.to(torch.int64) // case.key_cache.shape[1]).tolist()
    assert key_rows.shape == (plan.num_tokens, plan.key_token_shape[0] * plan.key_token_shape[1])


def test_another_pypto_version_is_refused(monkeypatch):
    from pakv_onnx.kernels import _pypto_verify_adapter as adapter

    monkeypatch.setattr(adapter, "pypto_version", lambda: "0.3.0")
    with pytest.raises(adapter.AdapterError, match=r"0\.2\.0.*0\.3\.0"):
        adapter.check_version()


# --------------------------------------------------------------------------- #
# SIM compile + pass-verify interpreter (pypto needed)
# --------------------------------------------------------------------------- #
def test_verify_kernel_cli_passes_small_cases(capsys):
    # bf16 seed case, fp16 (4 heads, 8-row blocks), bf16 with 1-row blocks, int8
    ids = ["level0", "random-0", "random-2", "random-5"]
    code = cli.main(["verify-kernel", "--cases", *ids])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count(" PASS ") == len(ids), out
    assert "4 passed, 0 failed" in out


@pytest.mark.slow
def test_verify_kernel_64_heads_and_t4096(capsys):
    ids = ["heads64_k128_v128", "heads1_k128_v64", "t4096", "random-1", "random-3"]
    code = cli.main(["verify-kernel", "--cases", *ids])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count(" PASS ") == len(ids), out


# The deliberate bug: the product kernel, mutated to read one cache row too far.
KERNEL_LINE = "src_row = block_tables[seq, first_col + blk] * block_size"


def off_by_one_kernel_script() -> str:
    """The kernel module's own source with one line mutated, run as a verify worker."""
    source = Path(_pypto_kernel_path()).read_text()
    assert source.count(KERNEL_LINE) == 1, "the kernel changed: update the mutation"
    mutated = source.replace(KERNEL_LINE, KERNEL_LINE + " + 1")
    worker = "\nimport sys\nfrom pakv_onnx import pypto_sim\nsys.exit(pypto_sim.worker_main(sys.argv[1], kernel_fn=gather_nd_kernel))\n"
    return mutated + worker


def _pypto_kernel_path() -> str:
    spec = importlib.util.find_spec("pakv_onnx.kernels._pypto_kernel")
    return spec.origin


def test_a_wrong_kernel_is_caught(tmp_path):
    script = tmp_path / "wrong_kernel.py"
    script.write_text(off_by_one_kernel_script())
    result = pypto_sim.run_in_subprocess({"mode": "verify", "case": "level0"}, worker=[sys.executable, str(script)])
    assert not result.ok
    assert "NOT bit-exact" in result.detail, result.detail  # a real mismatch, not a crash


def _cost(case_id: str, tiles: pypto_nd.Tiles) -> pypto_sim.RunResult:
    return pypto_sim.run_in_subprocess({"mode": "cost", "case": case_id, "tiles": list(tiles.as_tuple())})


def _seed_and_chosen(case_id: str) -> tuple[pypto_sim.RunResult, pypto_sim.RunResult]:
    case = pypto_sim.build_case(case_id)
    plan = plan_gather(*case.inputs(), **case.attributes())
    seed = pypto_nd.seed_tiles_for(*pypto_nd.token_widths(plan))
    return _cost(case_id, seed), _cost(case_id, pypto_nd.choose_tiles(plan))


@pytest.mark.parametrize("case_id,max_ratio", [("level5", 0.6), ("heads1_k128_v64", 1.0), ("t4096", 1.0)])
def test_cost_model_time_beats_the_seed_config(case_id, max_ratio):
    seed, chosen = _seed_and_chosen(case_id)
    assert seed.ok and chosen.ok, (seed.detail, chosen.detail)
    assert chosen.aicore_us <= max_ratio * seed.aicore_us, (chosen.aicore_us, seed.aicore_us)


@pytest.mark.slow
def test_64_heads_seed_config_fails_to_compile_and_the_rule_compiles():
    seed, chosen = _seed_and_chosen("heads64_k128_v128")
    # The seed's rule gives [8, 8] for 64 x 128 (>= 4096 elements), which fits; its [16, 32] does not.
    assert chosen.ok and seed.ok
    assert chosen.aicore_us <= seed.aicore_us
    failing = _cost("heads64_k128_v128", pypto_nd.Tiles(16, 64 * 128, 32, 64 * 128))
    assert not failing.ok
    assert "exceeds MEM_UB size [196608]" in failing.detail, failing.detail  # the reason from PyPTO's log
