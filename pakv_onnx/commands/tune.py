"""``pakv-onnx tune``: PyPTO's cost model (SIM) over candidate K/V tile row counts for one shape."""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor

from pakv_onnx.paths import cache_dir


def _case_id(args: argparse.Namespace) -> str:
    from pakv_onnx import pypto_sim

    if args.case:
        return args.case
    return "shape:" + pypto_sim.shape_spec(
        pypto_sim.KERNEL_DTYPES[args.dtype],
        (args.key_heads, args.key_dim),
        (args.value_heads, args.value_dim),
        args.block_size,
        args.q,
        args.tokens,
    )


def _parse_pair(text: str) -> tuple[int, int]:
    try:
        key, value = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"want K,V tile rows like 64,128, got {text!r}") from None
    if key < 1 or value < 1:
        raise argparse.ArgumentTypeError(f"tile rows must be >= 1, got {text!r}")
    return key, value


def candidate_rows(block_size: int) -> list[int]:
    """Row counts tried by default: powers of two dividing block_size, from 8 (or fewer for tiny blocks)."""
    rows = [r for r in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if r <= block_size and block_size % r == 0]
    large = [r for r in rows if r >= 8]
    return large or rows


def plan_rows(case_id: str, pairs: list[tuple[int, int]] | None, quick: bool):
    """(rows to run, chosen tiles, seed tiles, widths, itemsize) for one case."""
    from pakv_onnx import pypto_sim
    from pakv_onnx.kernels import pypto_nd
    from pakv_onnx.spec import plan_gather

    case = pypto_sim.build_case(case_id)
    plan = plan_gather(*case.inputs(), **case.attributes())
    reason = pypto_nd.unsupported_reason(plan, case.key_cache)
    if reason:
        raise ValueError(f"the PyPTO kernel cannot run {case_id}: {reason}")
    key_width, value_width = pypto_nd.token_widths(plan)
    itemsize = case.key_cache.element_size()
    chosen = pypto_nd.choose_tiles(plan)
    seed = pypto_nd.seed_tiles_for(key_width, value_width)
    if pairs:
        rows = list(pairs)
    elif quick:
        rows = []
    else:
        cands = candidate_rows(plan.block_size)
        rows = [(k, v) for k in cands for v in cands]
    for extra in ((seed.key_rows, seed.value_rows), (chosen.key_rows, chosen.value_rows)):
        if extra not in rows:
            rows.append(extra)
    return rows, chosen, seed, (key_width, value_width), itemsize, case


def run(args: argparse.Namespace) -> int:
    from pakv_onnx import pypto_sim
    from pakv_onnx.commands.verify_kernel import preflight
    from pakv_onnx.kernels import pypto_nd

    problem = preflight()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    case_id = _case_id(args)
    try:
        rows, chosen, seed, (key_width, value_width), itemsize, case = plan_rows(case_id, args.tiles, args.quick)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    chosen_pair = (chosen.key_rows, chosen.value_rows)
    seed_pair = (seed.key_rows, seed.value_rows)

    def fits(k: int, v: int) -> bool:
        return pypto_nd.tile_fits(k, key_width, itemsize) and pypto_nd.tile_fits(v, value_width, itemsize)

    def measure(pair: tuple[int, int]) -> dict:
        k, v = pair
        row = {
            "tile_k": k,
            "tile_v": v,
            "key_tile_bytes": pypto_nd.tile_bytes(k, key_width, itemsize),
            "value_tile_bytes": pypto_nd.tile_bytes(v, value_width, itemsize),
            "fits": fits(k, v),
            "aicore_us": None,
            "tasks": None,
            "utilisation_pct": None,
            "chosen": pair == chosen_pair,
            "seed_default": pair == seed_pair,
            "status": "",
        }
        if not row["fits"] and pair != seed_pair and not args.try_all:
            row["status"] = f"skipped: tile exceeds the {pypto_nd.VECTOR_BUFFER_BYTES}-byte vector buffer"
            return row
        tiles = pypto_nd.Tiles(k, key_width, v, value_width)
        result = pypto_sim.run_in_subprocess(
            {"mode": "cost", "case": case_id, "tiles": list(tiles.as_tuple())}, timeout=args.timeout
        )
        if result.ok and result.aicore_us is not None:
            row.update(aicore_us=result.aicore_us, tasks=result.tasks, utilisation_pct=result.utilisation, status="ok")
        else:
            row["status"] = f"compile failed: {result.detail}" + (f" (log: {result.log})" if result.log else "")
        if not args.json:
            print(
                f"  measured K,V rows {k},{v}: {row['status'] if row['status'] != 'ok' else str(row['aicore_us']) + ' us'}",
                file=sys.stderr,
                flush=True,
            )
        return row

    if not args.json:
        print(f"{case_id}: {case.summary()}", flush=True)
        print(f"cost model runs: {len(rows)} (SIM, one subprocess each; files under {cache_dir('pypto')})", flush=True)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        table = list(pool.map(measure, rows))
    table.sort(key=lambda r: (r["tile_k"], r["tile_v"]))
    if args.json:
        print(json.dumps({"case": case_id, "rows": table}, indent=1))
        return 0 if any(r["chosen"] and r["status"] == "ok" for r in table) else 1
    print(f"{'tile_k':>6} {'tile_v':>6} {'aicore_us':>9} {'tasks':>5} {'util%':>6}  mark")
    for r in table:
        marks = [m for m, on in (("chosen", r["chosen"]), ("seed default", r["seed_default"])) if on]
        if r["status"] != "ok":
            marks.append(r["status"])
        print(
            f"{r['tile_k']:>6} {r['tile_v']:>6} {_num(r['aicore_us'], '9.3f')} {_num(r['tasks'], '5d')} "
            f"{_num(r['utilisation_pct'], '6.2f')}  {', '.join(marks)}"
        )
    chosen_row = next(r for r in table if r["chosen"])
    seed_row = next(r for r in table if r["seed_default"])
    if chosen_row["aicore_us"] and seed_row["aicore_us"]:
        print(f"chosen / seed default = {chosen_row['aicore_us'] / seed_row['aicore_us']:.3f}")
    elif chosen_row["aicore_us"]:
        print("seed default does not compile for this shape; the chosen tiles do")
    return 0 if chosen_row["status"] == "ok" else 1


def _num(value, spec: str) -> str:
    return format(value, spec) if value is not None else "-"


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "tune",
        help="cost-model (SIM) table of K/V vector tile rows for one shape",
        description=(
            "Run PyPTO's cost model (SIM mode, no NPU needed) on the GatherPaKvCache kernel for one "
            "shape over candidate key/value vector tile row counts, and print the AICore end-to-end "
            "time, task count and utilisation of each, marking the tiles the kernel picks (largest "
            "row count dividing block_size whose tile fits the 196,608-byte vector buffer) and the "
            "seed kernel's fixed rule ([16, 32] rows, [8, 8] when heads*dim >= 4096). Candidates whose "
            "tile does not fit are skipped (the seed default is always run, to show it failing). "
            "The cost model ignores valid rows and loop unrolling: times depend on the number of "
            "blocks, not on how full they are."
        ),
        epilog=(
            "examples:\n"
            "  pakv-onnx tune --case level5\n"
            "  pakv-onnx tune --case heads64_k128_v128 --json\n"
            "  pakv-onnx tune --case t4096 --quick\n"
            "  pakv-onnx tune --dtype float16 --key-heads 8 --key-dim 128 --value-heads 8 --value-dim 128 \\\n"
            "                 --block-size 64 --q 2 --tokens 300 --tiles 16,16 --tiles 64,64"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--case",
        metavar="ID",
        help="a seed or manual case id from `pakv-onnx cases --list` (run with 64-block caches), t4096, "
        "random-N or shape:...; otherwise give the shape options",
    )
    shape = parser.add_argument_group("explicit shape (when --case is not given)")
    shape.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "int8"))
    shape.add_argument("--key-heads", type=int, default=1)
    shape.add_argument("--key-dim", type=int, default=512)
    shape.add_argument("--value-heads", type=int, default=1)
    shape.add_argument("--value-dim", type=int, default=64)
    shape.add_argument("--block-size", type=int, default=128)
    shape.add_argument("--q", type=int, default=4, help="sequences (default: 4)")
    shape.add_argument("--tokens", type=int, default=55, help="total tokens T, split evenly (default: 55)")
    parser.add_argument(
        "--tiles",
        type=_parse_pair,
        action="append",
        metavar="K,V",
        help="candidate key,value tile rows (repeatable; default: every power-of-two divisor of block_size >= 8, "
        "both ways)",
    )
    parser.add_argument("--quick", action="store_true", help="only the kernel's pick and the seed's default")
    parser.add_argument("--try-all", action="store_true", help="also run candidates whose tile does not fit")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON objects")
    parser.add_argument("--jobs", type=int, default=1, help="cost-model subprocesses at once (default: 1)")
    parser.add_argument("--timeout", type=float, default=600, metavar="S", help="per-run timeout in seconds")
    parser.set_defaults(run=run)
