"""Running the PyPTO kernel on a CPU: SIM-mode compile, cost model and pass-verify interpreter.

Each run happens in its own subprocess (``python -m pakv_onnx.pypto_sim REQUEST.json``):
a failed compile poisons later compiles in the same process, and every SIM or verify
call leaks a copy of its inputs. The subprocess

* runs with its cwd, ``HOME``, ``TILE_FWK_OUTPUT_DIR``, ``ASCEND_PROCESS_LOG_PATH`` and
  ``PYPTO_HOME`` inside a per-run directory under :func:`pakv_onnx.paths.cache_dir`
  (``pypto/runs/...``), removed after a successful run and kept (and named) after a failure;
* sends its stdout and stderr (PyPTO prints from C++ and from helper subprocesses) to a log
  file at the file-descriptor level, from which the parent reads the cost-model summary;
* writes a JSON result file the parent reads.

Cases are named, never pickled, so the subprocess rebuilds the same bytes:

* a seed id (``level0`` ... ``level9``, ``heads1_k128_v64``, ``heads64_k128_v128``): the
  seed case with ``num_blocks`` = :data:`SMALL_NUM_BLOCKS` (the seed's generation rule
  otherwise unchanged; the 5513-block caches take 812 MB and the interpreter copies them);
* ``t4096``: the sweep's shapes with Q = 4 and T = 4096 (8 blocks per sequence);
* ``random-N``: a random case the kernel supports (shuffled and repeated block ids,
  non-zero seq_offset, tail blocks, zero-length sequences, bf16/fp16/int8, both seq_lens
  forms, int32/int64 indices);
* ``shape:DTYPE:KH,KD:VH,VD:BS:Q:T``: explicit shapes in the sweep's pattern (for ``tune``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from pakv_onnx.cases import GatherCase, even_split, random_cache, seed_case, seed_cases
from pakv_onnx.paths import CACHE_DIR_ENV, cache_dir, pypto_output_env

SMALL_NUM_BLOCKS = 64
T4096_CASE = "t4096"
DEFAULT_TIMEOUT_S = 900
KERNEL_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}


# --------------------------------------------------------------------------- #
# Cases
# --------------------------------------------------------------------------- #
def small_seed_case(case_id: str, num_blocks: int = SMALL_NUM_BLOCKS) -> GatherCase:
    """The seed case ``case_id`` with ``num_blocks`` cache blocks (generation rule otherwise unchanged)."""
    spec = seed_case(case_id)
    small = dataclasses.replace(
        spec,
        key_cache_shape=(num_blocks, *spec.key_cache_shape[1:]),
        value_cache_shape=(num_blocks, *spec.value_cache_shape[1:]),
    )
    case = small.build()
    return dataclasses.replace(case, description=f"{case.description}, num_blocks {num_blocks}")


def shape_case(
    dtype: torch.dtype,
    key_hd: tuple[int, int],
    value_hd: tuple[int, int],
    block_size: int,
    q_count: int,
    total_tokens: int,
    *,
    num_blocks: int | None = None,
    seed: int = 0,
    case_id: str | None = None,
) -> GatherCase:
    """A case in the sweep's pattern: T split evenly over Q, consecutive block ids, zero offsets."""
    lengths = even_split(total_tokens, q_count)
    blocks = [-(-n // block_size) for n in lengths]
    cols = max(1, max(blocks))
    num_blocks = num_blocks or max(SMALL_NUM_BLOCKS, sum(blocks))
    tables = torch.zeros(q_count, cols, dtype=torch.int32)
    counter = 0
    for q, used in enumerate(blocks):
        for col in range(used):
            tables[q, col] = counter % num_blocks
            counter += 1
    generator = torch.Generator().manual_seed(seed)
    return GatherCase(
        case_id=case_id or f"shape:{shape_spec(dtype, key_hd, value_hd, block_size, q_count, total_tokens)}",
        description=f"Q={q_count} T={total_tokens} block_size={block_size}",
        key_cache=random_cache((num_blocks, block_size, *key_hd), dtype, generator),
        value_cache=random_cache((num_blocks, block_size, *value_hd), dtype, generator),
        block_tables=tables,
        seq_lens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
        seq_offset=torch.zeros(q_count, dtype=torch.int32),
    )


def shape_spec(dtype, key_hd, value_hd, block_size, q_count, total_tokens) -> str:
    name = str(dtype).removeprefix("torch.")
    return f"{name}:{key_hd[0]},{key_hd[1]}:{value_hd[0]},{value_hd[1]}:{block_size}:{q_count}:{total_tokens}"


def t4096_case() -> GatherCase:
    """The sweep's shapes (key 1x512, value 1x64, bf16, 128-row blocks) with Q = 4, T = 4096."""
    return shape_case(torch.bfloat16, (1, 512), (1, 64), 128, 4, 4096, seed=4096, case_id=T4096_CASE)


def random_kernel_case(seed: int, dtype: torch.dtype | None = None) -> GatherCase:
    """A small random case inside the kernel's support (32-byte aligned token rows)."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    dtype = dtype or rng.choice(list(KERNEL_DTYPES.values()))
    itemsize = torch.empty((), dtype=dtype).element_size()
    unit = 32 // itemsize  # elements per 32-byte block
    block_size = rng.choice((1, 2, 4, 8, 16, 32))
    num_blocks = rng.randint(8, SMALL_NUM_BLOCKS)
    num_seqs = rng.randint(2, 6)
    key_hd = (rng.randint(1, 4), unit * rng.randint(1, 4))
    value_hd = (rng.randint(1, 4), unit * rng.randint(1, 4))
    # Always a zero-length sequence and a partial tail block; the rest anything up to 3.5 blocks.
    lengths = [rng.randint(0, 3 * block_size + block_size // 2) for _ in range(num_seqs)]
    lengths[rng.randrange(num_seqs)] = 0
    lengths[rng.randrange(num_seqs)] = block_size + max(1, block_size // 2) if block_size > 1 else 3
    offset_cols = [rng.randint(0, 2) for _ in range(num_seqs)]
    offset_cols[rng.randrange(num_seqs)] = rng.randint(1, 3)
    used = [off + -(-n // block_size) for off, n in zip(offset_cols, lengths)]
    cols = max(used) + rng.randint(0, 2)
    tables = torch.randint(-3, num_blocks + 3, (num_seqs, cols), generator=generator)  # junk where unused
    for q in range(num_seqs):
        for col in range(offset_cols[q], used[q]):
            tables[q, col] = rng.randrange(num_blocks)  # shuffled, repeats allowed
    is_cumsum = rng.random() < 0.5
    index_dtype = rng.choice((torch.int32, torch.int64))
    running = torch.tensor([0, *lengths]).cumsum(0)
    return GatherCase(
        case_id=f"random-{seed}",
        description=f"random kernel case seed {seed}",
        key_cache=random_cache((num_blocks, block_size, *key_hd), dtype, generator),
        value_cache=random_cache((num_blocks, block_size, *value_hd), dtype, generator),
        block_tables=tables.to(index_dtype),
        seq_lens=(running if is_cumsum else torch.tensor(lengths)).to(index_dtype),
        seq_offset=torch.tensor([c * block_size for c in offset_cols], dtype=index_dtype),
        is_seq_lens_cumsum=is_cumsum,
    )


def seed_case_ids() -> list[str]:
    return [spec.case_id for spec in seed_cases()]


def build_case(case_id: str) -> GatherCase:
    """Rebuild a named case (see the module docstring); ``ValueError`` on an unknown name."""
    if case_id == T4096_CASE:
        return t4096_case()
    if case_id.startswith("random-"):
        try:
            return random_kernel_case(int(case_id.removeprefix("random-")))
        except ValueError:
            raise ValueError(f"bad random case id {case_id!r} (want random-N)") from None
    if case_id.startswith("shape:"):
        return parse_shape_case(case_id)
    return small_seed_case(case_id)


def parse_shape_case(case_id: str) -> GatherCase:
    parts = case_id.split(":")
    try:
        _, dtype, key, value, block_size, q_count, total = parts
        dt = KERNEL_DTYPES[dtype]
        key_hd = tuple(int(v) for v in key.split(","))
        value_hd = tuple(int(v) for v in value.split(","))
        if len(key_hd) != 2 or len(value_hd) != 2:
            raise ValueError
        return shape_case(dt, key_hd, value_hd, int(block_size), int(q_count), int(total))
    except (ValueError, KeyError):
        raise ValueError(
            f"bad shape case {case_id!r}: want shape:DTYPE:KH,KD:VH,VD:BLOCK_SIZE:Q:T with DTYPE one of "
            f"{', '.join(KERNEL_DTYPES)}"
        ) from None


# --------------------------------------------------------------------------- #
# The subprocess
# --------------------------------------------------------------------------- #
@dataclasses.dataclass
class RunResult:
    """What one subprocess run reported."""

    case_id: str
    ok: bool  # compiled and ran (and, for verify, matched the golden)
    detail: str
    seconds: float
    aicore_us: float | None = None
    tasks: int | None = None
    utilisation: float | None = None
    tiles: tuple[int, int, int, int] | None = None
    log: str | None = None
    run_dir: str | None = None


_SUMMARY = {
    "aicore_us": re.compile(r"AICore End-to-End Time:\s*([0-9.]+)"),
    "tasks": re.compile(r"Total Task Count:\s*([0-9]+)"),
    "utilisation": re.compile(r"AICore Utilization:\s*([0-9.]+)%"),
}
_ERROR_HINT = re.compile(r"(exceed|out of|buffer|CHECK FAILED|Error|error)", re.IGNORECASE)


def parse_cost_summary(text: str) -> dict[str, Any]:
    """AICore end-to-end us, task count and utilisation (%) from the cost model's printout (last run)."""
    found: dict[str, Any] = {}
    for key, pattern in _SUMMARY.items():
        matches = pattern.findall(text)
        if matches:
            found[key] = int(matches[-1]) if key == "tasks" else float(matches[-1])
    return found


def subprocess_env(run_dir: Path) -> dict[str, str]:
    """Environment of a PyPTO subprocess: every file PyPTO writes lands in ``run_dir``."""
    env = dict(os.environ)
    env.pop("ASCEND_HOME_PATH", None)  # would switch pypto to NPU mode and CANN libraries
    home = run_dir / "home"
    for path in (home, run_dir / "output", run_dir / "ascend_log", run_dir / "tmp"):
        path.mkdir(parents=True, exist_ok=True)
    env.update(
        {
            CACHE_DIR_ENV: str(cache_dir()),  # keep the same cache whatever HOME says
            "HOME": str(home),
            **pypto_output_env(run_dir),
            "TMPDIR": str(run_dir / "tmp"),
            "MPLBACKEND": "Agg",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def run_in_subprocess(
    request: dict[str, Any],
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    keep: bool = False,
    worker: list[str] | None = None,
) -> RunResult:
    """Run one request (``{"mode": "verify"|"cost"|"helper", "case": ID, "tiles": [..]|None}``).

    ``worker`` is the command that takes the request file (default: this module); tests
    point it at a script that calls :func:`worker_main` with a deliberately wrong kernel.
    """
    case_id = request.get("case", "-")
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", str(case_id))[:60]
    run_dir = cache_dir("pypto", "runs", f"{time.strftime('%Y%m%d-%H%M%S')}-{safe}-{uuid.uuid4().hex[:6]}")
    log_path = run_dir / "run.log"
    result_path = run_dir / "result.json"
    request = dict(request, result=str(result_path), log=str(log_path))
    request_path = run_dir / "request.json"
    request_path.write_text(json.dumps(request))
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [*(worker or [sys.executable, "-m", "pakv_onnx.pypto_sim"]), str(request_path)],
            cwd=run_dir,
            env=subprocess_env(run_dir),
            check=False,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout,
        )
        returncode: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        returncode = None
    seconds = time.perf_counter() - start
    log_text = log_path.read_text(errors="replace") if log_path.exists() else ""
    summary = parse_cost_summary(log_text)
    if result_path.exists():
        payload = json.loads(result_path.read_text())
        ok, detail = bool(payload["ok"]), str(payload["detail"])
        tiles = tuple(payload["tiles"]) if payload.get("tiles") else None
    else:
        ok, tiles = False, None
        hints = [line.strip() for line in log_text.splitlines() if _ERROR_HINT.search(line)]
        why = "timed out" if returncode is None else f"exited with code {returncode}"
        detail = f"subprocess {why}" + (f": {hints[-1][:300]}" if hints else "")
    if not ok:
        first_error = _first_logged_error(run_dir / "ascend_log")
        if first_error and first_error not in detail:
            detail = f"{detail}; PyPTO log: {first_error}"
    result = RunResult(
        case_id=str(case_id),
        ok=ok,
        detail=detail,
        seconds=seconds,
        tiles=tiles,
        log=str(log_path),
        run_dir=str(run_dir),
        **summary,
    )
    if ok and not keep:
        shutil.rmtree(run_dir, ignore_errors=True)
        result.log = result.run_dir = None
    return result


def _first_logged_error(log_dir: Path) -> str | None:
    """The message of the first ``[ERROR]`` line PyPTO logged (compile failures name their cause only there)."""
    for path in sorted(log_dir.rglob("*.log")):
        with open(path, errors="replace") as handle:
            for line in handle:
                if "[ERROR]" in line:
                    return line.rsplit("]:", 1)[-1].strip()[:300]
    return None


def helper_is_built() -> bool:
    """True once PyPTO's interpreter helper library is in the cache."""
    from pakv_onnx.kernels import _pypto_verify_adapter as adapter

    return (adapter.calculator_dir() / adapter.CALCULATOR_LIB).exists()


# --------------------------------------------------------------------------- #
# Inside the subprocess
# --------------------------------------------------------------------------- #
def _redirect_output(log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _flush_c_stdio() -> None:
    import ctypes

    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


def _fill_sentinel(tensor: torch.Tensor) -> None:
    from pakv_onnx.spec import bits_view

    bits_view(tensor).fill_(-1)  # all bits set: no gathered row can equal it by accident twice


def execute(request: dict[str, Any], kernel_fn=None) -> dict[str, Any]:
    """Run one request in this process (the subprocess body; tests call it for injected kernels)."""
    from pakv_onnx.kernels import _pypto_verify_adapter as adapter
    from pakv_onnx.kernels import pypto_nd
    from pakv_onnx.spec import bitwise_equal, plan_gather

    mode = request["mode"]
    adapter.check_version()
    if mode == "helper":
        path = adapter.build_calculator()
        return {"ok": True, "detail": f"helper library at {path}", "tiles": None}
    case = build_case(request["case"])
    plan = plan_gather(*case.inputs(), **case.attributes())
    key_out = torch.empty(plan.key_out_shape, dtype=plan.dtype)
    value_out = torch.empty(plan.value_out_shape, dtype=plan.dtype)
    _fill_sentinel(key_out)
    _fill_sentinel(value_out)
    tiles = pypto_nd.Tiles(*request["tiles"]) if request.get("tiles") else None
    verify = mode == "verify"
    if verify:
        adapter.install()
    used = pypto_nd.run_kernel(
        plan,
        case.key_cache,
        case.value_cache,
        key_out,
        value_out,
        sim=True,
        verify=verify,
        tiles=tiles,
        kernel_fn=kernel_fn,
    )
    _flush_c_stdio()
    shapes = f"key={list(key_out.shape)} value={list(value_out.shape)}"
    if not verify:
        return {"ok": True, "detail": f"compiled, cost model ran ({shapes})", "tiles": list(used.as_tuple())}
    golden_key, golden_value = case.golden()
    bad = [
        name
        for name, got, want in (("key", key_out, golden_key), ("value", value_out, golden_value))
        if not bitwise_equal(got, want)
    ]
    if bad:
        details = []
        for name, got, want in (("key", key_out, golden_key), ("value", value_out, golden_value)):
            if name in bad:
                from pakv_onnx.spec import bits_view

                rows = (bits_view(got) != bits_view(want)).reshape(got.shape[0], -1).any(dim=1)
                first = int(torch.nonzero(rows)[0, 0]) if rows.any() else -1
                details.append(f"{name}: {int(rows.sum())}/{got.shape[0]} rows differ, first row {first}")
        return {
            "ok": False,
            "detail": f"{shapes} NOT bit-exact vs golden ({'; '.join(details)})",
            "tiles": list(used.as_tuple()),
        }
    return {"ok": True, "detail": f"{shapes} bit-exact vs golden", "tiles": list(used.as_tuple())}


def worker_main(request_path: str, kernel_fn=None) -> int:
    request = json.loads(Path(request_path).read_text())
    _redirect_output(request["log"])
    try:
        payload = execute(request, kernel_fn=kernel_fn)
    except Exception as err:  # noqa: BLE001  (reported as the case's FAIL reason)
        import traceback

        traceback.print_exc()
        lines = str(err).strip().splitlines()
        payload = {"ok": False, "detail": f"{type(err).__name__}: {lines[0][:300] if lines else ''}", "tiles": None}
    _flush_c_stdio()
    Path(request["result"]).write_text(json.dumps(payload))
    return 0 if payload["ok"] else 1


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1]))
