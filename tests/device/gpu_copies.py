"""The GPU check's first part: the library's own CUDA entries of GatherPaKvCache and ScatterPaKvCache.

* matrix: every cache dtype x layout x seq_lens form x index dtype x seq_offset, plus mixed key /
  value dtypes (``quick``: one case per dtype), through the CUDA entry: outputs bit for bit equal to
  the golden (torch on the CPU); the scatter's every dtype x layout, its caches bound in place;
* speed: the gather vs one device memcpy of the same output bytes, vs ORT's own ``Gather`` of the same
  rows through the same kind of session (ORT's per-run cost included: the floor a custom op can reach
  at small shapes) and vs torch's ``index_select``, at
  the seed shapes and at 262,144 tokens, once per copy path the driver has (``PAKV_ONNX_CUDA_COPY``:
  batch, kernel, runs), with the path that actually ran read back from the library's counters.

``target`` is gpu_check.Target: the GPU, or for --dry-run the CPU execution provider with CPU tensors
(the same models, bindings and comparisons; no copy path runs there).
"""

from __future__ import annotations

import itertools
import os

import torch

LARGE_TOKENS_GOAL = 262_144
SEED_CASES = ("level0", "level8", "heads64_k128_v128")
COPY_PATHS = ("batch", "kernel", "runs")


def ort_readable(model):
    """The model with an IR version every supported ORT reads (onnx 1.23 writes IR 14, ORT 1.31 reads at
    most 13: FACTS §14, where the first GPU run failed): the package's own cap, one rule."""
    from pakv_onnx.export import cap_ir_version

    return cap_ir_version(model)


def gather_cases(quick: bool):
    from conftest import with_value_dtype

    from pakv_onnx.cases import random_case
    from pakv_onnx.spec import CACHE_DTYPES, CacheMode

    dtypes = [d.torch_dtype for d in CACHE_DTYPES]
    options = list(itertools.product(CacheMode, (True, False), (torch.int32, torch.int64), (True, False)))
    seed = 0
    for i, dtype in enumerate(dtypes):
        chosen = [options[i % len(options)]] if quick else options
        for mode, cumsum, index, offset in chosen:
            seed += 1
            yield random_case(seed, dtype=dtype, cache_mode=mode, is_seq_lens_cumsum=cumsum,
                              index_dtypes=(index, index, index), with_seq_offset=offset)  # fmt: skip
    for i in range(2 if quick else 8):
        yield with_value_dtype(random_case(500 + i), dtypes[(i + 3) % len(dtypes)], i)


def ort_gather_model(rows: list[torch.Tensor], tokens: int):
    """Two ONNX ``Gather`` nodes (axis 0) picking ``tokens`` rows of each cache's [slots, ...] view by
    an int64 index: ORT's own kernel doing the gather's work. Inputs key_rows, value_rows, index;
    outputs key, value."""
    from onnx import TensorProto, helper

    from pakv_onnx.spec import ONNX_ELEMENT_TYPE_OF

    names = ("key", "value")
    nodes = [helper.make_node("Gather", [f"{n}_rows", "index"], [n], axis=0) for n in names]
    inputs = [helper.make_tensor_value_info(f"{n}_rows", ONNX_ELEMENT_TYPE_OF[r.dtype], list(r.shape)) for n, r in zip(names, rows)]
    inputs.append(helper.make_tensor_value_info("index", TensorProto.INT64, [tokens]))
    outputs = [helper.make_tensor_value_info(n, ONNX_ELEMENT_TYPE_OF[r.dtype], [tokens, *r.shape[1:]]) for n, r in zip(names, rows)]
    graph = helper.make_graph(nodes, "ort_gather", inputs, outputs)
    return ort_readable(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def copy_paths_used(before: dict[str, int]) -> dict[str, int]:
    """Calls per copy path since ``before`` (native_lib.cuda_copy_paths())."""
    from pakv_onnx import native_lib

    after = native_lib.cuda_copy_paths()
    return {path: after[path] - before[path] for path in after if after[path] != before[path]}


def tally(results: dict, case, exact: bool) -> None:
    """One matrix case counted (a differing one named by its summary)."""
    results["cases"] += 1
    results["exact"] += int(exact)
    if not exact:
        results["failures"].append(case.summary())


def run_gather_matrix(target, quick: bool) -> dict:
    from pakv_onnx import native_lib, runtime_plugin
    from pakv_onnx.export import make_gather_model_for
    from pakv_onnx.spec import bitwise_equal

    sessions: dict[bytes, object] = {}
    results = {"cases": 0, "exact": 0, "failures": []}
    before = native_lib.cuda_copy_paths()
    for case in gather_cases(quick):
        model = ort_readable(make_gather_model_for(*case.inputs(), **case.attributes(), fallback=False, shapes=None))
        key = model.SerializeToString()
        if key not in sessions:
            sessions[key] = target.session(model)
        session = sessions[key]
        golden = case.golden()
        outs = {"key": torch.empty(golden[0].shape, dtype=golden[0].dtype, device=target.device),
                "value": torch.empty(golden[1].shape, dtype=golden[1].dtype, device=target.device)}  # fmt: skip
        target.check_placement(session)
        runtime_plugin.run(session, target.feeds(case), out=outs)
        target.sync()
        tally(results, case, bitwise_equal(outs["key"].cpu(), golden[0]) and bitwise_equal(outs["value"].cpu(), golden[1]))
    results["copy_paths"] = copy_paths_used(before)
    return results


def run_scatter_matrix(target) -> dict:
    """Every dtype x layout through the scatter's entry, each cache output bound to its cache's buffer
    (in place, as a serving host binds it): the caches afterwards equal the golden's bit for bit."""
    from pakv_onnx import runtime_plugin
    from pakv_onnx.cases import random_scatter_case
    from pakv_onnx.export import make_scatter_model_for
    from pakv_onnx.spec import CACHE_DTYPES, CacheMode, bitwise_equal

    results = {"cases": 0, "exact": 0, "failures": []}
    for seed, (dtype, mode) in enumerate(itertools.product([d.torch_dtype for d in CACHE_DTYPES], CacheMode)):
        case = random_scatter_case(700 + seed, dtype=dtype, cache_mode=mode, num_tokens=12)
        if case.key.numel() == 0:
            continue
        golden = case.golden()
        key, value, key_cache, value_cache, slots = case.fresh_inputs()
        model = ort_readable(make_scatter_model_for(*case.inputs(), **case.attributes(), fallback=False))
        session = target.session(model)
        target.check_placement(session)
        caches = {"key_cache": key_cache.to(target.device), "value_cache": value_cache.to(target.device)}
        feeds = {"key": key.to(target.device), "value": value.to(target.device), **caches, "slot_mapping": slots}
        runtime_plugin.run(session, feeds, out={"key_cache_out": caches["key_cache"], "value_cache_out": caches["value_cache"]})
        target.sync()
        tally(results, case, bitwise_equal(caches["key_cache"].cpu(), golden[0])
              and bitwise_equal(caches["value_cache"].cpu(), golden[1]))  # fmt: skip
    return results


def bench(target, label: str, case, repeats: int) -> dict:
    """The op (once per copy path on a GPU), one memcpy of the same bytes, and index_select, in
    alternating blocks of synchronized calls."""
    from _timing import blocked_medians_us

    from pakv_onnx import runtime_plugin
    from pakv_onnx.export import make_gather_model_for
    from pakv_onnx.spec import bitwise_equal
    from pakv_onnx.validator import plan_gather

    golden = case.golden()
    session = target.session(ort_readable(make_gather_model_for(*case.inputs(), **case.attributes(), fallback=False, shapes=None)))
    feeds = target.feeds(case)
    outs = {"key": torch.empty(golden[0].shape, dtype=golden[0].dtype, device=target.device),
            "value": torch.empty(golden[1].shape, dtype=golden[1].dtype, device=target.device)}  # fmt: skip
    binding = runtime_plugin.bind(session, feeds, out=outs)
    out_bytes = sum(t.numel() * t.element_size() for t in golden)
    src = torch.empty(out_bytes, dtype=torch.uint8, device=target.device)
    dst = torch.empty_like(src)
    plan = plan_gather(*case.inputs(), **case.attributes())
    block, slot = plan.token_slots()
    index = (block * plan.block_size + slot).to(target.device)
    rows = [feeds[n].view(-1, *golden[i].shape[1:]) for i, n in enumerate(("key_cache", "value_cache"))]

    def op_on(path: str | None):
        def op():
            if path:
                os.environ["PAKV_ONNX_CUDA_COPY"] = path
            try:
                session.run_with_iobinding(binding)
            finally:
                os.environ.pop("PAKV_ONNX_CUDA_COPY", None)
            target.sync()

        return op

    variants, ran = {}, {}
    for path in COPY_PATHS if not target.dry_run else (None,):
        name = f"op[{path}]" if path else "op"
        outs["key"].zero_()
        outs["value"].zero_()
        before = target.copy_paths()
        try:
            op_on(path)()
        except Exception as exc:  # a path this driver lacks: named, not timed
            ran[name] = f"unavailable: {str(exc).splitlines()[0][:200]}"
            continue
        assert bitwise_equal(outs["key"].cpu(), golden[0]) and bitwise_equal(outs["value"].cpu(), golden[1]), (label, path)
        ran[name] = ",".join(copy_paths_used(before)) if not target.dry_run else "cpu"
        variants[name] = op_on(path)

    def memcpy():
        dst.copy_(src)
        target.sync()

    try:  # ORT's own Gather (its CUDA kernel), bound like the op: the per-run floor of a session
        gather_session = target.session(ort_gather_model(rows, index.numel()))
        gather_binding = runtime_plugin.bind(
            gather_session, {"key_rows": rows[0], "value_rows": rows[1], "index": index.to(torch.int64)}, out=outs)

        def ort_gather():
            gather_session.run_with_iobinding(gather_binding)
            target.sync()

        outs["key"].zero_()
        ort_gather()
        assert bitwise_equal(outs["key"].cpu(), golden[0]), (label, "ORT Gather")
        variants["ort Gather"] = ort_gather
    except Exception as exc:  # a dtype ORT's Gather lacks on this EP: named, not timed
        ran["ort Gather"] = f"unavailable: {str(exc).splitlines()[0][:200]}"

    def index_select():
        torch.index_select(rows[0], 0, index, out=outs["key"])
        torch.index_select(rows[1], 0, index, out=outs["value"])
        target.sync()

    times = blocked_medians_us({**variants, "memcpy": memcpy, "index_select": index_select}, repeats,
                               block=max(3, min(30, repeats // 4)))  # fmt: skip
    gbps = {name: out_bytes / (us * 1e-6) / 1e9 for name, us in times.items()}
    best = min((name for name in variants if name.startswith("op")), key=lambda name: times[name])
    return {"case": label, "T": plan.num_tokens, "out_bytes": out_bytes, "us": times, "GB/s": gbps, "paths": ran,
            "best": best}  # fmt: skip


def run_bench(target, large_blocks: int, repeats: int) -> list[dict]:
    from _cases import capped_seed_case, large_case

    from pakv_onnx.spec import CacheMode

    rows = [bench(target, name, capped_seed_case(name, 64), repeats) for name in SEED_CASES]
    large = large_case(large_blocks)
    assert large.cache_mode is CacheMode.NORM
    rows.append(bench(target, f"large ({large_blocks}x128 tokens, 8x128 bf16)", large, max(10, repeats // 5)))
    return rows


def goals(rows: list[dict], large_blocks: int) -> list[dict]:
    """The issue's goals, on the path ``auto`` takes (the first the driver has: kernel, batch, runs), and
    beside them (not a goal) the op against ORT's own Gather through the same kind of session."""
    checks = []
    *seed, large = rows

    def auto(row: dict) -> str:
        return next((name for name in ("op[kernel]", "op[batch]", "op[runs]", "op") if name in row["us"]), row["best"])

    for row in seed:
        ratio = row["us"][auto(row)] / row["us"]["memcpy"]
        checks.append({"goal": f"{row['case']}: {auto(row)} <= 2x one memcpy launch", "value": f"{ratio:.2f}x",
                       "met": ratio <= 2.0})  # fmt: skip
        if "ort Gather" in row["us"]:
            versus = row["us"][auto(row)] / row["us"]["ort Gather"]
            checks.append({"goal": f"{row['case']}: {auto(row)} / ORT's Gather", "value": f"{versus:.2f}x",
                           "met": True, "reported": True})  # fmt: skip
    share = large["GB/s"][auto(large)] / large["GB/s"]["memcpy"]
    label = f"{large['case']}: {auto(large)} >= 80% of memcpy bandwidth"
    if large_blocks * 128 != LARGE_TOKENS_GOAL:
        label += f" (goal stated at {LARGE_TOKENS_GOAL} tokens)"
    checks.append({"goal": label, "value": f"{share:.0%}", "met": share >= 0.8})
    return checks


def report(rows: list[dict]) -> list[str]:
    lines = ["| case | T | output MB | variant (path that ran) | us | GB/s | / memcpy |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        for name, us in r["us"].items():
            path = r["paths"].get(name, "")
            lines.append(f"| {r['case']} | {r['T']} | {r['out_bytes'] / 1e6:.3f} | {name}{f' ({path})' if path else ''} | "
                         f"{us:.1f} | {r['GB/s'][name]:.1f} | {us / r['us']['memcpy']:.2f} |")  # fmt: skip
        for name, why in r["paths"].items():
            if why.startswith("unavailable"):
                lines.append(f"| {r['case']} | {r['T']} | | {name}: {why} | | | |")
    return lines
