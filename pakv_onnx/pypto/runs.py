"""PyPTO runs on a CPU, each in a subprocess: SIM compile, cost model, pass-verify interpreter.

Each run is ``python -m pakv_onnx.pypto.worker REQUEST.json`` in its own process: a failed
compile poisons later compiles in the same process, and every SIM or verify call leaks a
copy of its inputs. The subprocess runs with its cwd, ``HOME``, ``TMPDIR`` and PyPTO's
output variables inside a per-run directory under :func:`pakv_onnx.paths.cache_dir`
(``pypto/runs/...``), sends its stdout/stderr to ``run.log`` at the file-descriptor level and
writes ``result.json``. A successful run's directory is removed; a failed one is kept and
named; only the newest :data:`KEEP_FAILED_RUNS` failed directories within
:data:`KEEP_FAILED_BYTES` are kept (the newest one always).

Before a run, :func:`memory_refusal` compares an estimate of its peak memory with what the
machine has available and refuses (with both figures) a run that cannot fit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from pakv_onnx.paths import CACHE_DIR_ENV, cache_dir, pypto_output_env, tree_size

DEFAULT_TIMEOUT_S = 900
KEEP_FAILED_RUNS = 10
KEEP_FAILED_BYTES = 256 * 2**20  # PyPTO's output of one run can reach hundreds of MB
WORKER_MODULE = "pakv_onnx.pypto.worker"

# Peak memory model of one run (measured: the interpreter copies its inputs many times; the
# seed's 812 MB caches drove a verify to OOM at 19 GB): base process + factor x input bytes.
BASE_PROCESS_BYTES = 1_500 * 2**20
BYTES_FACTOR = {"verify": 24, "cost": 4, "floor": 4, "helper": 0}


@dataclasses.dataclass
class RunResult:
    """What one subprocess run reported."""

    case_id: str
    ok: bool  # compiled and ran (and, for verify, matched the golden)
    detail: str
    seconds: float
    aicore_us: float | None = None
    tasks: int | None = None
    tiles: dict | None = None
    log: str | None = None
    run_dir: str | None = None
    payload: dict | None = None


_SUMMARY = {
    "aicore_us": re.compile(r"AICore End-to-End Time:\s*([0-9.]+)"),
    "tasks": re.compile(r"Total Task Count:\s*([0-9]+)"),
}
_ERROR_HINT = re.compile(r"(exceed|out of|buffer|CHECK FAILED|Error|error)", re.IGNORECASE)


def parse_cost_summary(text: str) -> dict[str, Any]:
    """AICore end-to-end us and task count from the cost model's printout (last run)."""
    found: dict[str, Any] = {}
    for key, pattern in _SUMMARY.items():
        matches = pattern.findall(text)
        if matches:
            found[key] = int(matches[-1]) if key == "tasks" else float(matches[-1])
    return found


# --------------------------------------------------------------------------- #
# Memory
# --------------------------------------------------------------------------- #
def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (``None`` where there is none)."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def estimate_bytes(input_bytes: int, mode: str) -> int:
    return BASE_PROCESS_BYTES + BYTES_FACTOR.get(mode, BYTES_FACTOR["verify"]) * input_bytes


def memory_refusal(input_bytes: int, mode: str, available: int | None = None) -> str | None:
    """Why a ``mode`` run over ``input_bytes`` of tensors cannot fit here, or ``None``."""
    available = available_bytes() if available is None else available
    need = estimate_bytes(input_bytes, mode)
    if available is None or need <= available:
        return None
    return (
        f"a PyPTO {mode} run over {input_bytes / 2**20:.1f} MiB of tensors needs about {need / 2**30:.1f} GiB "
        f"(the interpreter copies its inputs; estimate {BASE_PROCESS_BYTES / 2**30:.1f} GiB + "
        f"{BYTES_FACTOR.get(mode, 24)} x inputs), but only {available / 2**30:.1f} GiB is available"
    )


def case_bytes(case) -> int:
    return sum(t.numel() * t.element_size() for t in case.inputs() if t is not None)


# --------------------------------------------------------------------------- #
# Run directories
# --------------------------------------------------------------------------- #
def runs_dir() -> Path:
    return cache_dir("pypto", "runs")


def new_run_dir(label: str, parent: Path | None = None) -> Path:
    """A fresh run directory named by time and ``label`` (under :func:`runs_dir` unless ``parent``)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", label)[:60]
    path = (parent or runs_dir()) / f"{time.strftime('%Y%m%d-%H%M%S')}-{safe}-{uuid.uuid4().hex[:6]}"
    path.mkdir(parents=True)
    return path


def prune_failed_runs(keep: int = KEEP_FAILED_RUNS, max_bytes: int = KEEP_FAILED_BYTES) -> list[Path]:
    """Keep the newest ``keep`` run directories that fit in ``max_bytes`` together (the newest always).

    Returns the removed ones.
    """
    newest_first = sorted(
        (p for p in runs_dir().iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True
    )
    removed, total = [], 0
    for index, path in enumerate(newest_first):
        total += tree_size(path)
        if index >= keep or (index > 0 and total > max_bytes):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def subprocess_env(run_dir: Path) -> dict[str, str]:
    """Environment of a PyPTO subprocess: every file PyPTO writes lands in ``run_dir``."""
    from pakv_onnx.pypto.adapter import HELPER_DIR_ENV

    env = dict(os.environ)
    env.pop("ASCEND_HOME_PATH", None)  # would switch pypto to NPU mode and CANN libraries
    # The subprocess runs in run_dir, so without this it would import whichever pakv_onnx is
    # installed (e.g. another checkout's editable install), not the one that started it.
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    home = run_dir / "home"
    for path in (home, run_dir / "output", run_dir / "ascend_log", run_dir / "tmp"):
        path.mkdir(parents=True, exist_ok=True)
    env.update(
        {
            CACHE_DIR_ENV: str(cache_dir()),  # keep the same cache whatever HOME says
            HELPER_DIR_ENV: os.environ.get(HELPER_DIR_ENV) or str(cache_dir("pypto", "calculator")),
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
    """Run one request (``{"mode": "verify"|"cost"|"floor"|"helper", "case": ID, "tiles": {..}|None}``).

    ``worker`` is the command that takes the request file (default: :mod:`.worker`); tests
    point it at a script that calls :func:`.worker.worker_main` with a deliberately wrong kernel.
    """
    case_id = str(request.get("case", "-"))
    run_dir = new_run_dir(f"{request.get('mode')}-{case_id}")
    log_path, result_path = run_dir / "run.log", run_dir / "result.json"
    request_path = run_dir / "request.json"
    request_path.write_text(json.dumps(dict(request, result=str(result_path), log=str(log_path))))
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [*(worker or [sys.executable, "-m", WORKER_MODULE]), str(request_path)],
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
    except BaseException:  # Ctrl-C: the child got it too; leave no half-written directory behind
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    seconds = time.perf_counter() - start
    result = read_result(case_id, run_dir, returncode, seconds)
    if result.ok and not keep:
        shutil.rmtree(run_dir, ignore_errors=True)
        result.log = result.run_dir = None
    elif not result.ok:
        prune_failed_runs()
    return result


def run_batch(
    items: list[dict[str, Any]],
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    keep: bool = False,
    worker: list[str] | None = None,
) -> list[RunResult]:
    """Cost/floor runs, several per subprocess (saves the ~1.5 s import per run).

    A run that fails ends its subprocess (later compiles there would fail too); the rest
    go to a fresh one. Returns one :class:`RunResult` per item, in order. ``keep`` keeps
    every batch's run directory (named in each result's ``run_dir``); ``worker`` as in
    :func:`run_in_subprocess`.
    """
    results: list[RunResult] = []
    while len(results) < len(items):
        rest = items[len(results) :]
        start = time.perf_counter()
        batch = run_in_subprocess(
            {"mode": "batch", "case": rest[0].get("case", "-"), "items": rest},
            timeout=timeout,
            keep=True,
            worker=worker,
        )
        done = (batch.payload or {}).get("results", [])  # all of them, or those before the subprocess died
        seconds = (time.perf_counter() - start) / max(1, len(done))
        for item, payload in zip(rest, done):
            detail = str(payload["detail"])
            if not payload["ok"]:
                first_error = first_logged_error(Path(batch.run_dir) / "ascend_log")
                if first_error and first_error not in detail:
                    detail = f"{detail}; PyPTO log: {first_error}"
            results.append(
                RunResult(
                    case_id=str(item.get("case", "-")),
                    ok=bool(payload["ok"]),
                    detail=detail,
                    seconds=seconds,
                    tiles=payload.get("tiles"),
                    aicore_us=payload.get("aicore_us"),
                    tasks=payload.get("tasks"),
                    log=None if payload["ok"] and not keep else batch.log,
                    run_dir=batch.run_dir if keep or not payload["ok"] else None,
                )
            )
        if not batch.ok and len(done) < len(rest):  # the subprocess itself died on this item: report it, go on
            results.append(dataclasses.replace(batch, case_id=str(rest[len(done)].get("case", "-"))))
        if batch.ok and done and all(p["ok"] for p in done) and not keep:
            shutil.rmtree(batch.run_dir, ignore_errors=True)
        else:
            prune_failed_runs()
    return results


def read_result(case_id: str, run_dir: Path, returncode: int | None, seconds: float) -> RunResult:
    log_path, result_path = run_dir / "run.log", run_dir / "result.json"
    log_text = log_path.read_text(errors="replace") if log_path.exists() else ""
    summary = parse_cost_summary(log_text)
    tiles = None
    payload = json.loads(result_path.read_text()) if result_path.exists() else None
    if payload is not None and not payload.get("partial"):
        ok, detail, tiles = bool(payload["ok"]), str(payload["detail"]), payload.get("tiles")
    else:  # no result, or a batch's results so far: the subprocess died
        ok = False
        hints = [line.strip() for line in log_text.splitlines() if _ERROR_HINT.search(line)]
        why = "timed out" if returncode is None else f"exited with code {returncode}"
        if returncode == -9:
            why += " (killed: most likely out of memory)"
        detail = f"subprocess {why}" + (f": {hints[-1][:300]}" if hints else "")
    if not ok:
        first_error = first_logged_error(run_dir / "ascend_log")
        if first_error and first_error not in detail:
            detail = f"{detail}; PyPTO log: {first_error}"
    return RunResult(
        case_id=case_id,
        ok=ok,
        detail=detail,
        seconds=seconds,
        tiles=tiles,
        log=str(log_path),
        run_dir=str(run_dir),
        payload=payload,
        **summary,
    )


def first_logged_error(log_dir: Path) -> str | None:
    """The message of the first ``[ERROR]`` line PyPTO logged (compile failures name their cause only there)."""
    if not log_dir.exists():
        return None
    for path in sorted(log_dir.rglob("*.log")):
        with open(path, errors="replace") as handle:
            for line in handle:
                if "[ERROR]" in line:
                    return line.rsplit("]:", 1)[-1].strip()[:300]
    return None


def helper_is_built() -> bool:
    """True once PyPTO's interpreter helper library is in the cache."""
    from pakv_onnx.pypto import adapter

    return (adapter.calculator_dir() / adapter.CALCULATOR_LIB).exists()


def ensure_helper(timeout: float = DEFAULT_TIMEOUT_S, say=None) -> RunResult | None:
    """Build PyPTO's helper library once (in a subprocess); ``None`` if it was there, else the build's result."""
    if helper_is_built():
        return None
    if say:
        say("building PyPTO's interpreter helper library once (cmake + g++, about 1-2 min; cached) ...")
    return run_in_subprocess({"mode": "helper"}, timeout=timeout)
