"""``pakv-onnx cases``: the seed sweep and manual shapes (and random cases) against the golden."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from pakv_onnx import kernels, seed_sweep  # neither imports torch: --help and usage errors stay quick
from pakv_onnx.commands import _args, _interrupt
from pakv_onnx.commands._report import case_line, totals_line

if TYPE_CHECKING:
    from pakv_onnx.cases import GatherCase

PRECISION_PASS = "[PRECISION_PASS]"
PRECISION_FAIL = "[PRECISION_FAIL]"


def check_case(case: GatherCase, backend: str) -> tuple[bool, str, str]:
    """Run ``case`` on ``backend`` and compare bit-exact with the golden: (passed, detail, backend run).

    The backend run is what ``auto`` resolved to for this case; the detail names it too.
    """
    from pakv_onnx.ops import gather_pa_kv_cache
    from pakv_onnx.spec import bitwise_equal
    from pakv_onnx.validator import plan_gather

    plan = plan_gather(*case.inputs(), **case.attributes())
    chosen = kernels.resolve_backend(backend, plan, case.key_cache).name
    key, value = gather_pa_kv_cache(*case.inputs(), **case.attributes(), backend=chosen)
    golden_key, golden_value = case.golden()
    mismatched = [
        name
        for name, got, want in (("key", key, golden_key), ("value", value, golden_value))
        if not bitwise_equal(got, want)
    ]
    shapes = f"on {chosen}: key={list(key.shape)} value={list(value.shape)}"
    if mismatched:
        return False, f"{shapes} mismatch in {', '.join(mismatched)}", chosen
    return True, shapes, chosen


def describe_backend(name: str) -> str:
    """``native`` or, for ``auto``, what it resolves to here: ``auto -> native (pypto: why not)``."""
    if name != kernels.AUTO:
        return name
    skipped = []
    for candidate in kernels.AUTO_PREFERENCE:
        reason = kernels.get_backend(candidate).unavailable_reason()
        if reason is None:
            why = f" (skipped {'; '.join(skipped)})" if skipped else ""
            return f"auto -> {candidate} where it can run a case{why}"
        skipped.append(f"{candidate}: {reason}")
    return f"auto -> no backend can run here ({'; '.join(skipped)})"


def known_case_id(text: str) -> str:
    """A seed case id (argparse type: an unknown id is a usage error listing the known ones)."""
    try:
        return seed_sweep.check_case_id(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def run(args: argparse.Namespace) -> int:
    from pakv_onnx.cases import random_case, seed_case, seed_cases  # imports torch

    specs = seed_cases()
    if args.list:
        for spec in specs:
            kind = "manual" if spec.manual else "sweep"
            print(
                f"{spec.case_id:<20} {kind:<6} Q={spec.q_count} T={spec.total_tokens} "
                f"key_cache={list(spec.key_cache_shape)} value_cache={list(spec.value_cache_shape)} "
                f"cols={spec.block_table_cols} seed={spec.seed}"
            )
        return 0
    # Ids and backend were checked while parsing, before any 800 MB cache is built.
    chosen = [seed_case(i) for i in args.ids] if args.ids else list(specs)
    print(f"backend: {describe_backend(args.backend)}", flush=True)
    builders = [(spec.case_id, spec.build) for spec in chosen]
    builders += [(f"random-{args.seed + i}", lambda s=args.seed + i: random_case(s)) for i in range(args.random)]
    failures, ran = 0, []
    for index, (case_id, build) in enumerate(builders, 1):
        _interrupt.check()  # a safe point: our own code, before each case
        start = time.perf_counter()
        case = build()
        try:
            passed, detail, backend = check_case(case, args.backend)
            ran += [backend] if backend not in ran else []
        except (ValueError, TypeError, kernels.BackendUnavailableError) as err:
            passed, detail = False, f"error: {err}"
        failures += not passed
        elapsed = time.perf_counter() - start
        print(case_line(index, len(builders), passed, case_id, case.summary(), detail, elapsed), flush=True)
        del case
    resolved = f" -> {', '.join(ran)}" if args.backend == kernels.AUTO and ran else ""
    print(totals_line(len(builders), failures, f"backend {args.backend}{resolved}"))
    print(PRECISION_FAIL if failures else PRECISION_PASS)
    return 1 if failures else 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = _args.add_command(
        commands,
        "cases",
        help="run the seed sweep and manual shapes against the golden",
        description=(
            "Build the seed's GatherPaKvCache cases (the network sweep level0-level9 and the two "
            "manual shapes, bf16 caches of up to 812 MB generated from fixed seeds), run each on "
            "a backend and compare the outputs bit-exact with the torch golden. Prints one "
            "PASS/FAIL line per case and ends with [PRECISION_PASS] or [PRECISION_FAIL]; exit code 0/1."
        ),
        examples=[
            "--list",
            "level0 level9 --backend torch",
            "--random 50 --seed 7",
        ],
    )
    parser.add_argument(
        "ids", nargs="*", metavar="ID", type=known_case_id, help="case ids to run (default: all 12; see --list)"
    )
    parser.add_argument("--list", action="store_true", help="list the case ids with their shapes and exit")
    parser.add_argument(
        "--backend",
        default=kernels.AUTO,
        type=_args.runnable_backend,
        help=f"backend to check: auto or one of {', '.join(kernels.backend_names())}; it must be able to run "
        "here (default: auto, the first of " + ", ".join(kernels.AUTO_PREFERENCE) + " that can run each case)",
    )
    _args.add_random_cases(
        parser,
        default=0,
        help="also run N random small cases (all dtypes and layouts)",
        seed_help="first seed of the random cases",
    )
    parser.set_defaults(run=run)
