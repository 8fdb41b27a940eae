"""``pakv-onnx verify-kernel``: the PyPTO kernel through PyPTO's own CPU toolchain, bit-exact vs the golden."""

from __future__ import annotations

import argparse
import sys

from pakv_onnx.commands._report import case_line, totals_line
from pakv_onnx.paths import cache_dir

DEFAULT_RANDOM = 8


def default_cases(random_count: int, first_seed: int) -> list[str]:
    from pakv_onnx import pypto_sim

    return [*pypto_sim.seed_case_ids(), pypto_sim.T4096_CASE] + [
        f"random-{first_seed + i}" for i in range(random_count)
    ]


def _case_summary(case_id: str) -> str:
    from pakv_onnx import pypto_sim

    try:
        return pypto_sim.build_case(case_id).summary()
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None


def preflight() -> str | None:
    """Why verification cannot run here (pypto missing or another version), else ``None``."""
    from pakv_onnx.kernels import _pypto_verify_adapter as adapter

    try:
        adapter.check_version()
    except adapter.AdapterError as err:
        return str(err)
    return None


def run(args: argparse.Namespace) -> int:
    from pakv_onnx import pypto_sim

    if args.list:
        for case_id in default_cases(args.random, args.seed):
            print(f"{case_id:<20} {_case_summary(case_id)}")
        return 0
    problem = preflight()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    case_ids = args.cases or default_cases(args.random, args.seed)
    summaries = {case_id: _case_summary(case_id) for case_id in case_ids}  # fail fast on a bad id
    print(f"PyPTO SIM compile + pass-verify interpreter; files under {cache_dir('pypto')}", flush=True)
    if not pypto_sim.helper_is_built():
        print("building PyPTO's interpreter helper library once (cmake + g++, about 1-2 min; cached) ...", flush=True)
        helper = pypto_sim.run_in_subprocess({"mode": "helper"}, timeout=args.timeout)
        if not helper.ok:
            print(f"FAIL helper build: {helper.detail} (log: {helper.log})")
            return 1
        print(f"helper library built ({helper.seconds:.0f}s)", flush=True)
    failures = 0
    for index, case_id in enumerate(case_ids, 1):
        result = pypto_sim.run_in_subprocess({"mode": "verify", "case": case_id}, timeout=args.timeout, keep=args.keep)
        failures += not result.ok
        extras = []
        if result.tiles:
            extras.append(f"tile rows K/V {result.tiles[0]}/{result.tiles[2]}")
        if result.aicore_us is not None:
            extras.append(f"cost model {result.aicore_us:g} us")
        extra = f" [{', '.join(extras)}]" if extras else ""
        where = f" (log: {result.log})" if result.log else ""
        detail = result.detail + extra
        print(
            case_line(index, len(case_ids), result.ok, case_id, summaries[case_id], detail, result.seconds) + where,
            flush=True,
        )
    print(totals_line(len(case_ids), failures, "pypto SIM + pass-verify, bit-exact vs golden"))
    return 1 if failures else 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "verify-kernel",
        help="check the PyPTO kernel bit-exact on a CPU (SIM compile + PyPTO's verify interpreter)",
        description=(
            "Compile the PyPTO GatherPaKvCache kernel in SIM mode on this CPU and run it through "
            "PyPTO's pass-verify interpreter with the real input data (a small adapter for pypto "
            "0.2.0 hands the interpreter the CPU tensors; other pypto versions are refused), then "
            "compare both outputs bit-exact with the torch golden. Default cases: the seed sweep "
            "and manual shapes with 64-block caches, a T=4096 case, and random cases (shuffled and "
            "repeated block ids, non-zero seq_offset, tail blocks, zero-length sequences, bf16/fp16/int8). "
            "Each case runs in its own subprocess; PyPTO's helper library is built once and cached; "
            "all PyPTO output, logs and run records go under the pakv-onnx cache directory "
            "($PAKV_ONNX_CACHE_DIR, else $XDG_CACHE_HOME/pakv-onnx or ~/.cache/pakv-onnx), the run "
            "directory of a failed case is kept and named. Prints one PASS/FAIL line per case; exit "
            "code 0 when all pass, 1 when any fails, 2 when pypto is missing or another version."
        ),
        epilog=(
            "case ids:\n"
            "  level0..level9, heads1_k128_v64, heads64_k128_v128   seed cases, num_blocks 64\n"
            "  t4096                                                 sweep shapes, Q=4, T=4096\n"
            "  random-N                                              random kernel case, seed N\n"
            "  shape:DTYPE:KH,KD:VH,VD:BLOCK_SIZE:Q:T                explicit shapes\n"
            "examples:\n"
            "  pakv-onnx verify-kernel\n"
            "  pakv-onnx verify-kernel --cases level0 heads64_k128_v128 random-3\n"
            "  pakv-onnx verify-kernel --random 50 --seed 100 --cases\n"
            "  pakv-onnx verify-kernel --list"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--cases",
        nargs="*",
        metavar="ID",
        help="case ids to verify (default: all seed cases, t4096 and the random ones)",
    )
    parser.add_argument(
        "--random",
        type=int,
        default=DEFAULT_RANDOM,
        metavar="N",
        help=f"random cases in the default list (default: {DEFAULT_RANDOM})",
    )
    parser.add_argument("--seed", type=int, default=0, help="first seed of the random cases (default: 0)")
    parser.add_argument("--list", action="store_true", help="list the default cases with their shapes and exit")
    parser.add_argument(
        "--timeout", type=float, default=900, metavar="S", help="per-case subprocess timeout in seconds (default: 900)"
    )
    parser.add_argument("--keep", action="store_true", help="keep every case's run directory (logs, PyPTO output)")
    parser.set_defaults(run=run)
