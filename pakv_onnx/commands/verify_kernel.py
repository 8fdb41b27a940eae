"""``pakv-onnx verify-kernel``: the PyPTO kernel bit-exact vs the golden, on a CPU (PyPTO's toolchain) or an NPU."""

from __future__ import annotations

import argparse
import time

from pakv_onnx.commands import _args
from pakv_onnx.commands._report import case_line, totals_line

DEFAULT_KERNEL_CASES = 4
BATCH = 6  # cases per subprocess (a failure or the worker's memory cap ends it; the rest go to a fresh one)


def _build_all(case_ids: list[str], op: str = "gather"):
    """{id: (case, plan)}; ``ValueError`` on the first unknown or invalid id."""
    from pakv_onnx.pypto import cases, scatter_cases, scatter_host
    from pakv_onnx.validator import plan_gather, plan_scatter

    built = {}
    for case_id in case_ids:
        if op == "scatter":
            case = scatter_cases.build(case_id)
            built[case_id] = (case, scatter_host.from_validated(plan_scatter(*case.inputs(), **case.attributes())))
            continue
        case = cases.build_case(case_id)
        built[case_id] = (case, plan_gather(*case.inputs(), **case.attributes()))
    return built


def _summary(case, plan) -> str:
    if hasattr(plan, "written"):  # a scatter: its summary says T and the tokens written
        return case.summary()
    return f"{case.summary()} T={plan.num_tokens}"


def _default_ids(args) -> list[str]:
    from pakv_onnx.pypto import cases, scatter_cases

    if args.op == "scatter":
        return scatter_cases.default_case_ids(args.random, args.seed)
    return cases.default_case_ids(args.random, args.seed)


def _list(args: argparse.Namespace) -> int:
    try:
        built = _build_all(_default_ids(args), args.op)
    except ValueError as err:
        return _args.usage_error("verify-kernel", str(err))
    for case_id, (case, plan) in built.items():
        if args.op == "scatter":
            print(f"{case_id:<22} {case.summary()}")
        else:
            print(f"{case_id:<20} T={plan.num_tokens:<6} {case.summary()}")
    return 0


def _refusals(built, device: str, op: str = "gather") -> tuple[dict[str, str], list[str]]:
    """(kernel refusals by id, memory refusals): what the kernel cannot do, what cannot fit here.

    Memory is checked for ``device`` "cpu" only: the estimate models PyPTO's CPU interpreter.
    """
    from pakv_onnx.pypto import host, runs, scatter_host

    kernel, memory = {}, []
    for case_id, (case, plan) in built.items():
        if op == "scatter":
            reason = scatter_host.unsupported_reason(plan, case.inputs()[:4])
            size = scatter_host.input_bytes(*case.inputs())
        else:
            reason = host.unsupported_reason(plan, case.key_cache, case.value_cache)
            size = runs.case_bytes(case)
        if reason:
            kernel[case_id] = reason
            continue
        if device == "npu":
            continue
        refusal = runs.memory_refusal(size, "verify")
        if refusal:
            memory.append(f"{case_id}: {refusal}")
    return kernel, memory


def _run_cpu(args, case_ids: list[str]):
    """Results in order, a batch of cases per subprocess (yielded as each batch finishes)."""
    from pakv_onnx.pypto import runs

    extra = {"op": "scatter"} if args.op == "scatter" else {}
    for start in range(0, len(case_ids), BATCH):
        batch = case_ids[start : start + BATCH]
        yield from runs.run_batch(
            [{"mode": "verify", "case": c, **extra} for c in batch], timeout=args.timeout, keep=args.keep
        )


def _npu_outputs(case, op: str):
    """(name, got, golden) of one case run on the NPU: the caches go there once (the pypto backend
    works on the NPU's own buffers and refuses host caches); index tensors stay on the host."""
    if op == "scatter":
        from pakv_onnx.ops import scatter_pa_kv_cache

        key, value, key_cache, value_cache, slot_mapping = case.fresh_inputs()
        on_npu = [t.to("npu") for t in (key, value, key_cache, value_cache)]
        scatter_pa_kv_cache(*on_npu, slot_mapping, **case.attributes(), backend="pypto")
        return zip(("key_cache", "value_cache"), (on_npu[2].cpu(), on_npu[3].cpu()), case.golden())
    from pakv_onnx.ops import gather_pa_kv_cache

    key_cache, value_cache, *indices = case.inputs()
    key, value = gather_pa_kv_cache(key_cache.to("npu"), value_cache.to("npu"), *indices, **case.attributes(), backend="pypto")
    return zip(("key", "value"), (key.cpu(), value.cpu()), case.golden())


def _run_npu(case_ids: list[str], built, op: str = "gather"):
    """Each case on the NPU (the ``pypto`` backend; the scatter kernel directly), compared with the golden."""
    from pakv_onnx.pypto.runs import RunResult
    from pakv_onnx.spec import bitwise_equal

    for case_id in case_ids:
        case, _ = built[case_id]
        start = time.perf_counter()
        try:
            bad = [n for n, got, want in _npu_outputs(case, op) if not bitwise_equal(got, want)]
            ok, detail = not bad, ("bit-exact vs golden" if not bad else f"NOT bit-exact vs golden ({', '.join(bad)})")
        except Exception as err:  # noqa: BLE001  (reported as the case's FAIL reason)
            ok, detail = False, f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
        yield RunResult(case_id=case_id, ok=ok, detail=detail, seconds=time.perf_counter() - start)


def run(args: argparse.Namespace) -> int:
    from pakv_onnx.paths import cache_dir
    from pakv_onnx.pypto import adapter, runs

    if args.list:
        return _list(args)
    if args.device == "npu":
        from pakv_onnx.kernels.pypto_nd import unavailable_reason

        problem = unavailable_reason()
        if problem:
            return _args.usage_error(
                "verify-kernel", f"--device npu needs an Ascend NPU with pypto and torch_npu: {problem}"
            )
    else:
        problem = adapter.unavailable_reason()
        if problem:
            return _args.usage_error("verify-kernel", problem)
    case_ids = args.cases or _default_ids(args)
    try:
        built = _build_all(case_ids, args.op)  # an unknown id is a usage error, before anything runs
    except ValueError as err:
        return _args.usage_error("verify-kernel", str(err))
    refused, memory = _refusals(built, args.device, args.op)
    if memory:
        fits = "refusing cases that cannot fit in memory here:\n  " + "\n  ".join(memory)
        return _args.usage_error("verify-kernel", fits)
    runnable = [c for c in case_ids if c not in refused]
    total = len(case_ids)
    for index, case_id in enumerate((c for c in case_ids if c in refused), 1):
        summary = _summary(*built[case_id])
        print(f"[{index}/{total}] SKIP {case_id}: {summary} -> the kernel refuses it: {refused[case_id]}", flush=True)
    if args.device == "npu":
        print("PyPTO kernel on the Ascend NPU (backend 'pypto'), bit-exact vs golden", flush=True)
        results = _run_npu(runnable, built, args.op)
    else:
        print(f"PyPTO SIM compile + pass-verify interpreter; files under {cache_dir('pypto')}", flush=True)
        helper = runs.ensure_helper(args.timeout, say=lambda text: print(text, flush=True))
        if helper is not None and not helper.ok:
            print(f"FAIL helper build: {helper.detail} (log: {helper.log})")
            return 1
        results = _run_cpu(args, runnable)
    failures = 0
    for index, (case_id, result) in enumerate(zip(runnable, results), len(refused) + 1):
        failures += not result.ok
        print(_result_line(index, total, case_id, _summary(*built[case_id]), result), flush=True)
    what = "pypto on the NPU" if args.device == "npu" else "pypto SIM + pass-verify"
    skipped = f", {len(refused)} refused by the kernel" if refused else ""
    print(totals_line(len(runnable), failures, f"{what}, bit-exact vs golden{skipped}"))
    return 1 if failures else 0


def _result_line(index: int, total: int, case_id: str, summary: str, result) -> str:
    from pakv_onnx.pypto.scatter_host import ScatterTiles
    from pakv_onnx.pypto.tiles import Tiles

    extras = []
    if result.tiles:
        kind = ScatterTiles if "pieces" in result.tiles else Tiles
        extras.append(kind.from_json(result.tiles).label())
    if result.aicore_us is not None:
        extras.append(f"cost model {result.aicore_us:g} us")
    detail = result.detail + (f" [{', '.join(extras)}]" if extras else "")
    where = f" (log: {result.log})" if result.log else ""
    return case_line(index, total, result.ok, case_id, summary, detail, result.seconds) + where


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = _args.add_command(
        commands,
        "verify-kernel",
        help="check the PyPTO kernel bit-exact vs the golden (CPU: SIM compile + PyPTO's interpreter; or --device npu)",
        description=(
            "Compile the PyPTO GatherPaKvCache kernel in SIM mode on this CPU and run it through PyPTO's "
            "pass-verify interpreter with the real input data (a small adapter for pypto 0.2.0 hands the "
            "interpreter the CPU tensors; other pypto versions are refused), then compare both outputs "
            "bit-exact with the torch golden. With --device npu the same cases run on an Ascend NPU through "
            "the 'pypto' backend instead. Default cases: the seed sweep and manual shapes (64-block caches), "
            "t4096, every supported dtype in Norm (dtype-NAME) and PA_NZ (nz-NAME), lengths-mode seq_lens, "
            "non-multiple seq_offset, mixed key/value dtypes (where the contract allows them), and random "
            "kernel cases (kernel-N). Cases run several per subprocess; PyPTO's helper library is built once "
            "and cached; all PyPTO output and logs go under the pakv-onnx cache directory "
            "($PAKV_ONNX_CACHE_DIR, else $XDG_CACHE_HOME/pakv-onnx or ~/.cache/pakv-onnx); the run directory "
            "of a failure is kept (the newest 10 within 256 MB). A case the kernel cannot do (e.g. fp8, rows not a multiple "
            "of 32 bytes) is listed as SKIP with the reason. Exit code 0 when all pass, 1 when any fails, 2 "
            "for a usage or environment problem (unknown case id, pypto missing or another version, no NPU "
            "for --device npu, a case that cannot fit in memory)."
        ),
        reference=(
            "case ids:\n"
            "  level0..level9, heads1_k128_v64, heads64_k128_v128   seed cases, num_blocks 64\n"
            "  t4096                                                 sweep shapes, Q=4, T=4096\n"
            "  dtype-NAME, nz-NAME                                   Norm / PA_NZ case of cache dtype NAME\n"
            "  lengths, offsets, mixed                               lengths-mode seq_lens, partial seq_offset,\n"
            "                                                        key/value dtypes differ\n"
            "  kernel-N                                              random case inside the kernel's support\n"
            "  random-N                                              the random case N of `pakv-onnx cases`\n"
            "  shape:DTYPE:KH,KD:VH,VD:BLOCK_SIZE:Q:T[:PA_NZ]        explicit shapes (Norm unless :PA_NZ)\n"
            "with --op scatter:\n"
            "  scatter-norm-NAME, scatter-nz-NAME                    Norm / PA_NZ scatter of dtype NAME (runs, decode\n"
            "                                                        tokens, padding)\n"
            "  scatter-mixed-norm, scatter-mixed-nz, scatter-pad     key/value dtypes differ; mostly padding, int64\n"
            "  scatter-kernel-N                                      random scatter inside the kernel's support\n"
            "  scatter:DTYPE:KH,KD:VH,VD:BS:NB:decode|prefillQ:T[:PA_NZ]  explicit shapes (zero caches)"
        ),
        examples=[
            "",
            "--cases level0 nz-int8 kernel-3",
            "--op scatter --cases scatter-nz-bfloat16 scatter-pad scatter-kernel-2",
            "--list",
            "--device npu  # on a machine with an Ascend NPU",
        ],
    )
    parser.add_argument(
        "--op",
        choices=("gather", "scatter"),
        default="gather",
        help="the kernel to check: GatherPaKvCache (default) or the ScatterPaKvCache write kernel (scatter-* case "
        "ids; the caches must match the torch reference bit for bit, unwritten rows untouched)",
    )
    parser.add_argument("--cases", nargs="+", metavar="ID", help="case ids to verify (default: the list above)")
    _args.add_random_cases(
        parser,
        default=DEFAULT_KERNEL_CASES,
        help=f"random kernel-N cases in the default list (default: {DEFAULT_KERNEL_CASES})",
        seed_help="first N of the kernel-N cases",
    )
    parser.add_argument("--list", action="store_true", help="list the default cases with T and their shapes, and exit")
    parser.add_argument("--device", choices=("cpu", "npu"), default="cpu", help="where the kernel runs (default: cpu)")
    parser.add_argument(
        "--timeout",
        type=_args.positive_int,
        default=900,
        metavar="S",
        help="per-subprocess timeout in seconds (default: 900)",
    )
    parser.add_argument("--keep", action="store_true", help="keep every run directory (logs, PyPTO output)")
    parser.set_defaults(run=run)
