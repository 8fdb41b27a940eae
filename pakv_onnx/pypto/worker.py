"""Inside a PyPTO subprocess: one request per process (:func:`worker_main`), or a served loop (:func:`serve`).

``python -m pakv_onnx.pypto.worker REQUEST.json`` runs one request of :mod:`.runs`;
``python -m pakv_onnx.pypto.worker --serve`` is the persistent worker of the ``pypto-cpu``
backend (:mod:`.cpu`): it imports torch and pypto and loads the helper library once, then
answers requests read as JSON lines on stdin, with tensors exchanged through files.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

# A worker stops taking work once its resident memory passes this: each SIM/verify call
# leaks a copy of its inputs and interpreter state (measured 100-250 MB per seed-sized verify;
# six in one process reached 6.7 GB).
RSS_CAP_BYTES = 1536 * 2**20


def rss_bytes() -> int:
    """This process's resident set size (0 where /proc is missing)."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def redirect_output(log_path: str) -> int:
    """Send fds 1 and 2 to ``log_path`` (PyPTO prints from C++ and subprocesses); returns a dup of the old fd 1."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return saved


def flush_c_stdio() -> None:
    import ctypes

    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


def fill_sentinel(tensor: torch.Tensor) -> None:
    from pakv_onnx.spec import bits_view

    bits_view(tensor).fill_(-1)  # all bits set: a row the kernel skipped cannot pass as gathered


def _outputs(plan) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan's two outputs, every bit set (see :func:`fill_sentinel`)."""
    key_out = torch.empty(plan.key_out_shape, dtype=plan.key_dtype)
    value_out = torch.empty(plan.value_out_shape, dtype=plan.value_dtype)
    fill_sentinel(key_out)
    fill_sentinel(value_out)
    return key_out, value_out


def _mismatch(outputs, goldens) -> list[str]:
    from pakv_onnx.spec import bits_view, bitwise_equal

    details = []
    for name, got, want in zip(("key", "value"), outputs, goldens):
        if bitwise_equal(got, want):
            continue
        rows = (bits_view(got) != bits_view(want)).reshape(got.shape[0], -1).any(dim=1)
        first = int(torch.nonzero(rows)[0, 0]) if rows.any() else -1
        details.append(f"{name}: {int(rows.sum())}/{got.shape[0]} rows differ, first row {first}")
    return details


def _cache_mismatch(caches, goldens, originals, written_rows) -> list[str]:
    """What differs between the scattered caches and the golden: rows the scatter wrote, and rows it must not touch."""
    from pakv_onnx.spec import bits_view, bitwise_equal

    details = []
    for name, got, want, before, rows in zip(("key_cache", "value_cache"), caches, goldens, originals, written_rows):
        if bitwise_equal(got, want):
            continue
        differs = bits_view(got) != bits_view(want)
        touched = (bits_view(got) != bits_view(before)) & ~rows
        details.append(
            f"{name}: {int(differs.sum())} elements differ from the golden, {int(touched.sum())} of them outside "
            "the written rows"
        )
    return details


def _written_masks(case) -> list[torch.Tensor]:
    """Boolean masks (cache-shaped) of the elements the scatter may write: the written slots' rows."""
    from pakv_onnx.spec import CacheMode

    masks = []
    slots = case.slot_mapping.to(torch.int64)
    slots = slots[slots >= 0]
    for cache in (case.key_cache, case.value_cache):
        mask = torch.zeros(cache.shape, dtype=torch.bool)
        if case.cache_mode is CacheMode.NORM:
            mask[slots // cache.shape[1], slots % cache.shape[1]] = True
        else:
            mask[slots // cache.shape[2], :, slots % cache.shape[2]] = True
        masks.append(mask)
    return masks


def execute_scatter(request: dict[str, Any], kernel_fn=None) -> dict[str, Any]:
    """One scatter request (``"op": "scatter"``): verify, cost or floor on a named scatter case."""
    from pakv_onnx.pypto import adapter, host, scatter_cases, scatter_host
    from pakv_onnx.pypto.tiles import Tiles

    mode = request["mode"]
    from pakv_onnx.validator import plan_scatter

    case = scatter_cases.build(request["case"])
    plan = scatter_host.from_validated(plan_scatter(*case.inputs(), **case.attributes()))
    shapes = f"key={list(case.key.shape)} value={list(case.value.shape)} written={plan.written}"
    if mode == "floor":
        # The same bytes copied contiguously: the written tokens' rows, [written, W] per cache.
        tiles = Tiles.from_json(request["tiles"])
        rows = max(1, plan.written)
        key_src = torch.zeros((rows, plan.key_width), dtype=plan.key_dtype)
        value_src = torch.zeros((rows, plan.value_width), dtype=plan.value_dtype)
        host.run_copy(key_src, value_src, torch.empty_like(key_src), torch.empty_like(value_src), tiles)
        flush_c_stdio()
        return {"ok": True, "detail": f"contiguous copy, cost model ran ({shapes})", "tiles": tiles.to_json()}
    reason = scatter_host.unsupported_reason(plan, case.inputs()[:4])
    if reason is not None:
        return {"ok": False, "refused": True, "detail": f"refused: {reason}", "tiles": None}
    tiles = scatter_host.ScatterTiles.from_json(request["tiles"]) if request.get("tiles") else None
    verify = mode == "verify"
    if verify:
        adapter.install()
    inputs = case.fresh_inputs()
    used = scatter_host.scatter_in_process(plan, *inputs[:4], sim=True, verify=verify, tiles=tiles, kernel_fn=kernel_fn)
    flush_c_stdio()
    if not verify:
        return {"ok": True, "detail": f"compiled, cost model ran ({shapes})", "tiles": used.to_json()}
    bad = _cache_mismatch(inputs[2:4], case.golden(), (case.key_cache, case.value_cache), _written_masks(case))
    if bad:
        return {"ok": False, "detail": f"{shapes} NOT bit-exact vs golden ({'; '.join(bad)})", "tiles": used.to_json()}
    return {"ok": True, "detail": f"{shapes} bit-exact vs golden (caches updated in place)", "tiles": used.to_json()}


def execute(request: dict[str, Any], kernel_fn=None) -> dict[str, Any]:
    """Run one request in this process (the subprocess body; tests call it for injected kernels)."""
    from pakv_onnx.plans import GatherTensors
    from pakv_onnx.pypto import adapter, cases, host
    from pakv_onnx.pypto.tiles import Tiles
    from pakv_onnx.validator import plan_gather

    mode = request["mode"]
    adapter.check_version()
    if mode == "helper":
        return {"ok": True, "detail": f"helper library at {adapter.build_calculator()}", "tiles": None}
    if request.get("op") == "scatter":
        return execute_scatter(request, kernel_fn=kernel_fn)
    case = cases.build_case(request["case"])
    plan = plan_gather(*case.inputs(), **case.attributes())
    tiles = Tiles.from_json(request["tiles"]) if request.get("tiles") else None
    key_out, value_out = _outputs(plan)
    shapes = f"key={list(key_out.shape)} value={list(value_out.shape)}"
    if mode == "floor":
        # Same output bytes, contiguous rows (the cost model does not look at the data).
        key_src = torch.zeros((plan.num_tokens, host.row_width(plan, "key")), dtype=key_out.dtype)
        value_src = torch.zeros((plan.num_tokens, host.row_width(plan, "value")), dtype=value_out.dtype)
        host.run_copy(key_src, value_src, key_out.view_as(key_src), value_out.view_as(value_src), tiles)
        flush_c_stdio()
        return {"ok": True, "detail": f"contiguous copy, cost model ran ({shapes})", "tiles": tiles.to_json()}
    reason = host.unsupported_reason(plan, case.key_cache, case.value_cache)
    if reason is not None:
        return {"ok": False, "refused": True, "detail": f"refused: {reason}", "tiles": None}
    verify = mode == "verify"
    if verify:
        adapter.install()
    tensors = GatherTensors(case.key_cache, case.value_cache, key_out, value_out)
    used = host.run_kernel(plan, tensors, sim=True, verify=verify, tiles=tiles, kernel_fn=kernel_fn)
    flush_c_stdio()
    if not verify:
        return {"ok": True, "detail": f"compiled, cost model ran ({shapes})", "tiles": used.to_json()}
    bad = _mismatch((key_out, value_out), case.golden())
    if bad:
        return {"ok": False, "detail": f"{shapes} NOT bit-exact vs golden ({'; '.join(bad)})", "tiles": used.to_json()}
    return {"ok": True, "detail": f"{shapes} bit-exact vs golden", "tiles": used.to_json()}


def _failure(err: BaseException) -> dict[str, Any]:
    traceback.print_exc()
    lines = str(err).strip().splitlines()
    return {"ok": False, "detail": f"{type(err).__name__}: {lines[0][:300] if lines else ''}", "tiles": None}


def execute_batch(request: dict[str, Any], kernel_fn=None) -> dict[str, Any]:
    """Several cost/floor runs in this process, each with the cost-model lines its run printed.

    Stops at the first failure (a failed compile poisons later ones); the parent reruns the rest.
    Before going on to the next run, the results so far go to the result file (marked
    ``partial``): if this process dies on that run, the parent keeps them and blames that run.
    """
    from pakv_onnx.pypto.runs import parse_cost_summary

    log = request["log"]
    results = []
    for item in request["items"]:
        flush_c_stdio()
        start = os.path.getsize(log)
        try:
            payload = execute(item, kernel_fn=kernel_fn)
        except Exception as err:  # noqa: BLE001
            payload = _failure(err)
        flush_c_stdio()
        with open(log, errors="replace") as handle:
            handle.seek(start)
            payload.update(parse_cost_summary(handle.read()))
        results.append(payload)
        if not payload["ok"] or rss_bytes() > RSS_CAP_BYTES:
            break  # the parent runs the rest in a fresh process
        write_result(request["result"], {"ok": False, "partial": True, "results": results})
    return {"ok": True, "detail": f"{len(results)} runs", "tiles": None, "results": results}


def worker_main(request_path: str, kernel_fn=None) -> int:
    request = json.loads(Path(request_path).read_text())
    redirect_output(request["log"])
    try:
        if request["mode"] == "batch":
            payload = execute_batch(request, kernel_fn=kernel_fn)
        else:
            payload = execute(request, kernel_fn=kernel_fn)
    except Exception as err:  # noqa: BLE001  (reported as the case's FAIL reason)
        payload = _failure(err)
    flush_c_stdio()
    write_result(request["result"], payload)
    return 0 if payload["ok"] else 1


def write_result(path: str, payload: dict[str, Any]) -> None:
    """Replace the result file in one step (the parent may read it after this process was killed)."""
    scratch = Path(f"{path}.tmp")
    scratch.write_text(json.dumps(payload))
    scratch.replace(path)


# --------------------------------------------------------------------------- #
# The pypto-cpu worker
# --------------------------------------------------------------------------- #
def gather_files(request: dict[str, Any]) -> dict[str, Any]:
    """One pypto-cpu call: load the inputs, plan, run the kernel through the interpreter, save the outputs."""
    from pakv_onnx.plans import GatherTensors
    from pakv_onnx.pypto import adapter, host
    from pakv_onnx.validator import plan_gather

    inputs = torch.load(request["inputs"], weights_only=True)
    plan = plan_gather(*inputs["tensors"], **inputs["attributes"])
    key_cache, value_cache = inputs["tensors"][0], inputs["tensors"][1]
    key_out, value_out = _outputs(plan)
    adapter.install()
    tiles = host.run_kernel(plan, GatherTensors(key_cache, value_cache, key_out, value_out), sim=True, verify=True)
    flush_c_stdio()
    torch.save({"key": key_out, "value": value_out}, request["outputs"])
    _clear_pypto_output()
    return {"ok": True, "detail": tiles.label(), "retire": rss_bytes() > RSS_CAP_BYTES}


def scatter_files(request: dict[str, Any]) -> dict[str, Any]:
    """One pypto-cpu scatter: load the inputs, run the kernel through the interpreter (it writes
    into the loaded caches), save the caches."""
    from pakv_onnx.pypto import adapter, scatter_host
    from pakv_onnx.validator import plan_scatter

    inputs = torch.load(request["inputs"], weights_only=True)
    key, value, key_cache, value_cache, slot_mapping = inputs["tensors"]
    plan = scatter_host.from_validated(
        plan_scatter(key, value, key_cache, value_cache, slot_mapping, cache_mode=inputs["cache_mode"])
    )
    adapter.install()
    tiles = scatter_host.scatter_in_process(plan, key, value, key_cache, value_cache, sim=True, verify=True)
    flush_c_stdio()
    torch.save({"key_cache": key_cache, "value_cache": value_cache}, request["outputs"])
    _clear_pypto_output()
    return {"ok": True, "detail": tiles.label(), "tiles": tiles.to_json(), "retire": rss_bytes() > RSS_CAP_BYTES}


def _clear_pypto_output() -> None:
    """Remove what PyPTO wrote for a call that passed: pass-verify dumps every pass's tensors
    (about 67 MB per seed-sized call), which would fill the disk over a long session."""
    import shutil

    output = os.environ.get("TILE_FWK_OUTPUT_DIR")
    if not output or not os.path.isdir(output):
        return
    for entry in os.scandir(output):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            os.unlink(entry.path)


def serve(log_path: str) -> int:
    """Answer JSON-line requests on stdin with JSON lines on the original stdout until EOF."""
    replies = os.fdopen(redirect_output(log_path), "w", buffering=1)
    from pakv_onnx.pypto import adapter

    try:
        adapter.check_version()
        adapter.install()
        adapter._load_calculator()  # noqa: SLF001  (the helper library: once per worker, not per call)
        import pakv_onnx.pypto.kernel  # noqa: F401  (pypto import, once)

        replies.write(json.dumps({"ok": True, "detail": "ready"}) + "\n")
    except Exception as err:  # noqa: BLE001
        replies.write(json.dumps(_failure(err)) + "\n")
        return 1
    for line in sys.stdin:
        try:
            request = json.loads(line)
            payload = scatter_files(request) if request.get("op") == "scatter" else gather_files(request)
        except Exception as err:  # noqa: BLE001
            payload = _failure(err)
        flush_c_stdio()
        replies.write(json.dumps(payload) + "\n")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        sys.exit(serve(sys.argv[2]))
    sys.exit(worker_main(sys.argv[1]))
