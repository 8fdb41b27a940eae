"""The ``pypto-cpu`` backend: the PyPTO kernel through PyPTO's CPU toolchain, on the real data.

Each call compiles the kernel in SIM mode and runs it through pypto's pass-verify
interpreter (with :mod:`.adapter` handing it the real CPU tensors), in a persistent worker
process (:func:`.worker.serve`). What is reused across calls: the worker, its torch and pypto
imports (~1.5 s) and the interpreter's helper library (built once per machine, cached).
What cannot be: pypto 0.2.0's SIM mode recompiles on every call, so a call costs about a
second or more (FACTS section 8). The worker is restarted after any failed call (a failed
compile poisons later compiles in that process) and once its resident memory passes
:data:`.worker.RSS_CAP_BYTES` (each SIM/verify call leaks 100-250 MB at seed sizes).

A call whose interpreter run cannot fit the machine's memory is refused up front with the
estimate (:func:`.runs.memory_refusal`).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import threading

import torch

from pakv_onnx.paths import cache_dir
from pakv_onnx.plans import GatherPlan, GatherTensors, ScatterPlan, ScatterTensors
from pakv_onnx.pypto import host, runs

READY_TIMEOUT_S = 600  # the first worker on a machine may build the helper library


class PyptoCpuError(RuntimeError):
    """The pypto-cpu worker failed a call (the message names the kept log)."""


def plan_bytes(plan: GatherPlan, key_cache: torch.Tensor, value_dtype: torch.dtype | None = None) -> int:
    """Bytes of the tensors one call hands the interpreter (caches, outputs, index tensors)."""
    value_dtype = value_dtype or plan.value_dtype
    value_itemsize = value_dtype.itemsize
    value_row = host.row_width(plan, "value")
    value_cache = plan.num_blocks * plan.block_size * value_row * value_itemsize
    outputs = plan.num_tokens * (host.row_width(plan, "key") * key_cache.element_size() + value_row * value_itemsize)
    return key_cache.numel() * key_cache.element_size() + value_cache + outputs + plan.block_tables.numel() * 8


def unsupported_reason(plan: GatherPlan, cache: torch.Tensor, value_cache: torch.Tensor | None = None) -> str | None:
    reason = host.unsupported_reason(plan, cache, value_cache)
    if reason:
        return reason
    value_dtype = value_cache.dtype if value_cache is not None else None
    return runs.memory_refusal(plan_bytes(plan, cache, value_dtype), "verify")


class _Worker:
    """One ``worker --serve`` process and its run directory."""

    def __init__(self) -> None:
        # A live worker's directory stays out of runs/ (which failures prune); it moves there on failure.
        self.run_dir = runs.new_run_dir("pypto-cpu-worker", parent=cache_dir("pypto", "workers"))
        self.log = self.run_dir / "run.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", runs.WORKER_MODULE, "--serve", str(self.log)],
            cwd=self.run_dir,
            env=runs.subprocess_env(self.run_dir),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        reply = self._read()
        if not reply.get("ok"):
            self.stop(keep=True)
            raise PyptoCpuError(f"the pypto-cpu worker did not start: {reply.get('detail')} (log: {self.log})")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            hint = " (killed: most likely out of memory)" if code == -9 else ""
            return {"ok": False, "detail": f"worker exited with code {code}{hint}"}
        return json.loads(line)

    def call(self, inputs: dict, op: str = "gather") -> dict:
        scratch = self.run_dir / "tmp"
        in_path, out_path = scratch / "inputs.pt", scratch / "outputs.pt"
        torch.save(inputs, in_path)
        self.proc.stdin.write(json.dumps({"op": op, "inputs": str(in_path), "outputs": str(out_path)}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        in_path.unlink(missing_ok=True)
        if reply.get("ok"):
            reply["outputs"] = torch.load(out_path, weights_only=True)
            out_path.unlink(missing_ok=True)
        return reply

    def stop(self, keep: bool = False) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if keep:
            kept = runs.runs_dir() / self.run_dir.name
            os.replace(self.run_dir, kept)
            self.run_dir, self.log = kept, kept / "run.log"
            runs.prune_failed_runs()
        else:
            shutil.rmtree(self.run_dir, ignore_errors=True)


_lock = threading.Lock()
_worker: _Worker | None = None


def _stop_worker() -> None:
    global _worker
    if _worker is not None:
        _worker.stop()
        _worker = None


atexit.register(_stop_worker)


def _replan_inputs(plan: GatherPlan, key_cache: torch.Tensor, value_cache: torch.Tensor) -> dict:
    """The call's inputs in the cumsum form spec re-plans to the same gather (first columns kept)."""
    seq_lens = torch.cat((plan.out_starts, torch.tensor([plan.num_tokens]))).to(torch.int64)
    seq_offset = plan.table_col_starts.to(torch.int64) * plan.block_size
    return {
        "tensors": (key_cache, value_cache, plan.block_tables, seq_lens, seq_offset),
        "attributes": {"cache_mode": plan.cache_mode.value, "is_seq_lens_cumsum": True},
    }


def _call_worker(inputs: dict, op: str) -> dict:
    """One call on the persistent worker (started on first use; restarted after a failure)."""
    global _worker
    with _lock:
        if _worker is None:
            _worker = _Worker()
        reply = _worker.call(inputs, op)
        if not reply.get("ok"):
            failed, _worker = _worker, None
            failed.stop(keep=True)
            raise PyptoCpuError(f"pypto-cpu: {reply.get('detail')} (log kept: {failed.log})")
        if reply.get("retire"):
            _stop_worker()
    return reply


def scatter_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def scatter_pypto_cpu(plan: ScatterPlan, tensors: ScatterTensors) -> None:
    """ScatterPaKvCache through PyPTO's SIM compile + pass-verify interpreter in the worker.

    The worker validates the call again (the C validator) and runs the kernel on its copy of the
    caches (only the written rows change there); that copy is then copied into the caller's
    caches in place. Refuses (``ValueError``) a call whose interpreter run cannot fit in memory.
    """
    key, value, key_cache, value_cache = tensors
    refusal = runs.memory_refusal(scatter_bytes(key, value, key_cache, value_cache, plan.slots), "verify")
    if refusal:
        raise ValueError(f"pypto-cpu scatter: {refusal}")
    inputs = {
        "tensors": tuple(t.contiguous() for t in (key, value, key_cache, value_cache, plan.slots)),
        "cache_mode": plan.cache_mode.value,
    }
    reply = _call_worker(inputs, "scatter")
    key_cache.copy_(reply["outputs"]["key_cache"])
    value_cache.copy_(reply["outputs"]["value_cache"])


def gather_pypto_cpu(plan: GatherPlan, tensors: GatherTensors) -> None:
    """Gather through PyPTO's SIM compile + pass-verify interpreter; writes the two outputs."""
    key_cache, value_cache, key_out, value_out = tensors
    reason = unsupported_reason(plan, key_cache, value_cache)
    if reason:  # the registry refuses such calls first; this guards direct callers
        raise ValueError(f"backend 'pypto-cpu' cannot run this call: {reason}")
    if plan.num_tokens == 0:
        return
    inputs = _replan_inputs(plan, key_cache.contiguous(), value_cache.contiguous())
    reply = _call_worker(inputs, "gather")
    key_out.copy_(reply["outputs"]["key"])
    value_out.copy_(reply["outputs"]["value"])


def worker_pid() -> int | None:
    """The live worker's process id (tests check reuse and restart)."""
    return _worker.proc.pid if _worker is not None else None
