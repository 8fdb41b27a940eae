"""``pakv-onnx tune``: PyPTO's cost model (SIM) over the kernel's chunk sizes for one case, against the copy floor."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from concurrent.futures import ThreadPoolExecutor

from pakv_onnx.commands import _args

DEFAULT_SHAPE = {"dtype": "bfloat16", "key_heads": 1, "key_dim": 512, "value_heads": 1, "value_dim": 64}


@dataclasses.dataclass
class TuneRow:
    """One measured specialisation: the entry kernel at one chunk, or the seed's kernel and rule."""

    kernel: str  # "entries" or "seed"
    chunk: int
    key_tile: tuple[int, int]
    value_tile: tuple[int, int]
    key_tile_bytes: int
    value_tile_bytes: int
    aicore_us: float | None = None
    tasks: int | None = None
    floor_us: float | None = None  # the contiguous copy at the same chunk
    status: str = ""
    chosen: bool = False
    seed: bool = False
    rule: bool = False

    @classmethod
    def before_costing(cls, tiles, shape, *, seed: bool, rule: bool) -> TuneRow:
        """The row of ``tiles`` (a :class:`~pakv_onnx.pypto.tiles.Tiles`) on ``shape``, its cost not run yet."""
        from pakv_onnx.pypto import tiles as tiles_mod

        key_bytes, value_bytes = tiles_mod.tile_bytes(tiles, shape)
        return cls(
            tiles.kind, tiles.chunk, tiles.key_tile, tiles.value_tile, key_bytes, value_bytes, seed=seed, rule=rule
        )


def case_id_for(args: argparse.Namespace) -> str:
    from pakv_onnx.pypto import cases

    if args.case:
        return args.case
    return "shape:" + cases.shape_spec(
        cases.dtype_by_name()[args.dtype],
        (args.key_heads, args.key_dim),
        (args.value_heads, args.value_dim),
        args.block_size,
        args.q,
        args.tokens,
    )


def _prepare(case_id: str):
    """(case, plan, kernel shape) or ``ValueError`` naming why the case cannot be tuned here."""
    from pakv_onnx.pypto import cases, host, runs
    from pakv_onnx.pypto import tiles as tiles_mod
    from pakv_onnx.validator import plan_gather

    case = cases.build_case(case_id)
    plan = plan_gather(*case.inputs(), **case.attributes())
    reason = host.unsupported_reason(plan, case.key_cache, case.value_cache)
    if reason:
        raise ValueError(f"the PyPTO kernel cannot run {case_id}: {reason}")
    if plan.num_tokens == 0:
        raise ValueError(f"{case_id} gathers no tokens: nothing to tune")
    refusal = runs.memory_refusal(runs.case_bytes(case), "cost")
    if refusal:
        raise ValueError(f"{case_id}: {refusal}")
    shape = tiles_mod.shape_of(plan, case.key_cache.element_size(), case.value_cache.element_size())
    return case, plan, shape


def _rows(shape, chunks: list[int] | None) -> tuple[list[TuneRow], list]:
    from pakv_onnx.pypto import tiles as tiles_mod

    bad = [c for c in chunks or () if shape.block_size % c]
    if bad:
        raise ValueError(f"--chunks {bad[0]} does not divide block_size {shape.block_size}")
    candidates = [tiles_mod.entry_tiles(shape, c) for c in chunks] if chunks else tiles_mod.candidate_tiles(shape)
    candidates = [t for t in candidates if t is not None]
    rule = tiles_mod.rule_tiles(shape)
    if rule not in candidates:
        candidates.append(rule)
    seed = tiles_mod.seed_tiles(shape)
    specs = candidates + ([seed] if seed else [])
    rows = [TuneRow.before_costing(t, shape, seed=t == seed, rule=t == rule) for t in specs]
    return rows, specs


def _floor_tiles(shape, chunk: int):
    """The copy kernel's tiles at ``chunk``: Norm row tiles of the same widths and dtypes."""
    from pakv_onnx.pypto import tiles as tiles_mod

    return tiles_mod.entry_tiles(dataclasses.replace(shape, mode="Norm"), chunk)


def _measure(case_id: str, shape, specs, jobs: int, timeout: float):
    """Cost-model results of every spec, then of the floor at every chunk (batched subprocesses)."""
    chunks = sorted({t.chunk for t in specs if t.kind == "entries"})
    floor_specs = [(c, _floor_tiles(shape, c)) for c in chunks]
    return _costs_and_floors({"case": case_id}, specs, floor_specs, jobs, timeout)


def _costs_and_floors(request: dict, specs, floor_specs, jobs: int, timeout: float):
    """The cost model's result for each of ``specs`` and for each ``(chunk, tiles)`` of ``floor_specs``
    that has tiles (``{chunk: result}``), run as ``request`` items in ``jobs`` batched subprocesses."""
    from pakv_onnx.pypto import runs

    floor_specs = [(c, t) for c, t in floor_specs if t is not None]
    items = [{**request, "mode": "cost", "tiles": t.to_json()} for t in specs]
    items += [{**request, "mode": "floor", "tiles": t.to_json()} for _, t in floor_specs]
    groups = [items[i::jobs] for i in range(jobs)]  # round-robin: each subprocess gets every jobs-th item
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        done = list(pool.map(lambda group: runs.run_batch(group, timeout=timeout) if group else [], groups))
    results = [None] * len(items)
    for g, group_results in enumerate(done):
        for k, result in enumerate(group_results):
            results[g + k * jobs] = result
    floors = {c: r for (c, _), r in zip(floor_specs, results[len(specs) :])}
    return results[: len(specs)], floors


def run(args: argparse.Namespace) -> int:
    from pakv_onnx.paths import cache_dir
    from pakv_onnx.pypto import adapter
    from pakv_onnx.pypto import tiles as tiles_mod

    problem = adapter.unavailable_reason()
    if problem:
        return _args.usage_error("tune", problem)
    if args.op == "scatter":
        return run_scatter(args)
    case_id = case_id_for(args)
    try:
        case, plan, shape = _prepare(case_id)
        rows, specs = _rows(shape, args.chunks)
    except ValueError as err:
        return _args.usage_error("tune", str(err))
    say = (
        (lambda text: print(text, file=sys.stderr, flush=True)) if args.json else (lambda text: print(text, flush=True))
    )
    if not args.case:
        say(f"no --case given: tuning the shape options' case {case_id}")
    say(f"{case_id}: {case.summary()} T={plan.num_tokens}")
    floor_count = len({t.chunk for t in specs if t.kind == "entries"})
    say(
        f"cost model runs: {len(specs)} kernel specialisations + {floor_count} floor copies "
        f"(SIM, batched subprocesses, {args.jobs} at once; files under {cache_dir('pypto')})"
    )
    results, floors = _measure(case_id, shape, specs, args.jobs, args.timeout)
    for row, result in zip(rows, results):
        if result.ok and result.aicore_us is not None:
            row.aicore_us, row.tasks, row.status = result.aicore_us, result.tasks, "ok"
        else:
            row.status = f"failed: {result.detail}" + (f" (log: {result.log})" if result.log else "")
        floor = floors.get(row.chunk)
        row.floor_us = floor.aicore_us if floor is not None and floor.ok else None
    measured = [r for r in rows if r.status == "ok"]
    floor_values = [f.aicore_us for f in floors.values() if f.ok and f.aicore_us is not None]
    floor_us = min(floor_values) if floor_values else None
    chosen_row = min(measured, key=lambda r: r.aicore_us) if measured else None
    if chosen_row is not None:
        chosen_row.chosen = True
        chosen = specs[rows.index(chosen_row)]
        if not args.no_save:
            tiles_mod.remember(shape, chosen)
    seed_row = next((r for r in rows if r.seed), None)
    rule_row = next(r for r in rows if r.rule)
    summary = {
        "case": case_id,
        "num_tokens": plan.num_tokens,
        "floor_us": floor_us,
        "seed_us": seed_row.aicore_us if seed_row else None,
        "rule_us": rule_row.aicore_us,
        "chosen_us": chosen_row.aicore_us if chosen_row else None,
        "chosen": specs[rows.index(chosen_row)].to_json() if chosen_row else None,
        "chosen_over_floor": _ratio(chosen_row.aicore_us if chosen_row else None, floor_us),
        "seed_over_floor": _ratio(seed_row.aicore_us if seed_row else None, floor_us),
        "saved": bool(chosen_row) and not args.no_save,
    }
    if args.json:
        print(json.dumps({**summary, "rows": [dataclasses.asdict(r) for r in rows]}, indent=1))
    else:
        _print_table(rows, summary)
    return 0 if chosen_row is not None else 1


# --------------------------------------------------------------------------- #
# --op scatter: the ScatterPaKvCache kernel
# --------------------------------------------------------------------------- #
def scatter_candidates(shape, chunks: list[int] | None) -> list:
    """What ``tune --op scatter`` measures: per chunk the rule's best pieces and groups, and at the
    rule's chunk every pieces value (its best groups)."""
    from pakv_onnx.pypto import scatter_host
    from pakv_onnx.pypto import tiles as tiles_mod

    bad = [c for c in chunks or () if shape.block_size % c]
    if bad:
        raise ValueError(f"--chunks {bad[0]} does not divide block_size {shape.block_size}")
    per_chunk = [scatter_host.chunk_tiles(shape, c) for c in chunks or tiles_mod.candidate_chunks(shape.block_size)]
    specs = [t for t in per_chunk if t is not None]
    if not specs:
        raise ValueError(tiles_mod.NO_TILE_FITS)
    rule = min(specs, key=lambda t: scatter_host.estimate_cycles(shape, t))
    for pieces in scatter_host.PIECES:
        options = scatter_host._tiles_at(shape, rule.chunk, pieces)
        if options:
            best = min(options, key=lambda t: scatter_host.estimate_cycles(shape, t))
            if best not in specs:
                specs.append(best)
    return specs


def scatter_measure(case_id: str, shape, specs, jobs: int, timeout: float):
    """Cost-model results of every scatter spec, then of the floor (the written rows copied
    contiguously) at every candidate chunk."""
    from pakv_onnx.pypto import scatter_host
    from pakv_onnx.pypto import tiles as tiles_mod

    floor_specs = [(c, scatter_host.floor_tiles(shape, c)) for c in tiles_mod.candidate_chunks(shape.block_size)]
    return _costs_and_floors({"op": "scatter", "case": case_id}, specs, floor_specs, jobs, timeout)


def tune_scatter(case_id: str, *, chunks=None, jobs: int = 1, timeout: float = 600, save: bool = True, say=None):
    """Measure the scatter kernel on ``case_id`` (a :mod:`pakv_onnx.pypto.scatter_cases` id) against its floor.

    Returns the summary dict (``floor_us``, ``rule_us``, ``chosen_us``, ``chosen``, ``chosen_over_floor``,
    ``rows``); ``ValueError`` when the case cannot be tuned here.
    """
    from pakv_onnx.pypto import runs, scatter_cases, scatter_host
    from pakv_onnx.validator import plan_scatter

    case = scatter_cases.build(case_id)
    plan = scatter_host.from_validated(plan_scatter(*case.inputs(), **case.attributes()))
    reason = scatter_host.unsupported_reason(plan, case.inputs()[:4])
    if reason:
        raise ValueError(f"the PyPTO scatter kernel cannot run {case_id}: {reason}")
    if plan.written == 0:
        raise ValueError(f"{case_id} writes no tokens: nothing to tune")
    refusal = runs.memory_refusal(scatter_host.input_bytes(*case.inputs()), "cost")
    if refusal:
        raise ValueError(f"{case_id}: {refusal}")
    shape = scatter_host.shape_of(plan)
    specs = scatter_candidates(shape, chunks)
    rule = (
        scatter_host.rule_tiles(shape)
        if not chunks
        else min(specs, key=lambda t: scatter_host.estimate_cycles(shape, t))
    )
    if say:
        say(f"{case_id}: {case.summary()}")
        say(f"cost model runs: {len(specs)} scatter specialisations + floor copies (SIM, batched subprocesses)")
    results, floors = scatter_measure(case_id, shape, specs, jobs, timeout)
    rows = []
    for spec, result in zip(specs, results):
        floor = floors.get(spec.chunk)
        key_bytes, value_bytes = scatter_host.tile_bytes(spec, shape)
        rows.append(
            {
                "kernel": "scatter",
                "chunk": spec.chunk,
                "pieces": spec.pieces,
                "key_tile": list(spec.key_tile),
                "value_tile": list(spec.value_tile),
                "key_tile_bytes": key_bytes,
                "value_tile_bytes": value_bytes,
                "aicore_us": result.aicore_us if result.ok else None,
                "tasks": result.tasks if result.ok else None,
                "floor_us": floor.aicore_us if floor is not None and floor.ok else None,
                "estimate_us": round(scatter_host.estimate_cycles(shape, spec) / 1800, 3),
                "status": "ok" if result.ok and result.aicore_us is not None else f"failed: {result.detail}",
                "rule": spec == rule,
                "chosen": False,
            }
        )
    measured = [r for r in rows if r["status"] == "ok"]
    floor_values = [f.aicore_us for f in floors.values() if f.ok and f.aicore_us is not None]
    floor_us = min(floor_values) if floor_values else None
    chosen_row = min(measured, key=lambda r: r["aicore_us"]) if measured else None
    chosen = specs[rows.index(chosen_row)] if chosen_row else None
    if chosen_row is not None:
        chosen_row["chosen"] = True
        if save:
            scatter_host.remember(shape, chosen)
    rule_row = next(r for r in rows if r["rule"])
    return {
        "op": "scatter",
        "case": case_id,
        "num_tokens": plan.num_tokens,
        "written": plan.written,
        "floor_us": floor_us,
        "rule_us": rule_row["aicore_us"],
        "rule_over_floor": _ratio(rule_row["aicore_us"], floor_us),
        "chosen_us": chosen_row["aicore_us"] if chosen_row else None,
        "chosen": chosen.to_json() if chosen else None,
        "chosen_over_floor": _ratio(chosen_row["aicore_us"] if chosen_row else None, floor_us),
        "saved": bool(chosen_row) and save,
        "rows": rows,
    }


def run_scatter(args: argparse.Namespace) -> int:
    from pakv_onnx.pypto import scatter_cases

    case_id = args.case or scatter_cases.REPRESENTATIVE[1]
    say = (
        (lambda text: print(text, file=sys.stderr, flush=True)) if args.json else (lambda text: print(text, flush=True))
    )
    if not args.case:
        say(f"no --case given: tuning {case_id}")
    if not scatter_cases.is_scatter_case(case_id):
        return _args.usage_error(
            "tune", f"--op scatter takes a scatter case id (e.g. {scatter_cases.REPRESENTATIVE[0]}), got {case_id!r}"
        )
    try:
        summary = tune_scatter(
            case_id, chunks=args.chunks, jobs=args.jobs, timeout=args.timeout, save=not args.no_save, say=say
        )
    except ValueError as err:
        return _args.usage_error("tune", str(err))
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0 if summary["chosen"] else 1
    print(
        f"{'kernel':<8} {'chunk':>5} {'pieces':>6} {'key tile':>10} {'value tile':>10} {'aicore_us':>9} {'tasks':>5} "
        f"{'floor@chunk':>11} {'estimate':>8}  mark"
    )
    for r in summary["rows"]:
        marks = [m for m, on in (("chosen", r["chosen"]), ("closed-form rule", r["rule"])) if on]
        if r["status"] != "ok":
            marks.append(r["status"])
        print(
            f"{r['kernel']:<8} {r['chunk']:>5} {r['pieces']:>6} {'x'.join(map(str, r['key_tile'])):>10} "
            f"{'x'.join(map(str, r['value_tile'])):>10} {_num(r['aicore_us'], '9.2f')} {_num(r['tasks'], '5d')} "
            f"{_num(r['floor_us'], '11.2f')} {_num(r['estimate_us'], '8.2f')}  {', '.join(marks)}"
        )
    print(
        f"floor {_num(summary['floor_us'], '.2f')} us | rule {_num(summary['rule_us'], '.2f')} us "
        f"({_num(summary['rule_over_floor'], '.2f')}x floor) | chosen {_num(summary['chosen_us'], '.2f')} us "
        f"({_num(summary['chosen_over_floor'], '.2f')}x floor)"
        + (" | saved as the kernel's tiles for this shape" if summary["saved"] else "")
    )
    return 0 if summary["chosen"] else 1


def _ratio(value: float | None, floor: float | None) -> float | None:
    return round(value / floor, 3) if value is not None and floor else None


def _print_table(rows: list[TuneRow], summary: dict) -> None:
    print(
        f"{'kernel':<8} {'chunk':>5} {'key tile':>10} {'value tile':>10} {'aicore_us':>9} {'tasks':>5} {'floor@chunk':>11}  mark"
    )
    for r in rows:
        marks = [m for m, on in (("chosen", r.chosen), ("seed rule", r.seed), ("closed-form rule", r.rule)) if on]
        if r.status != "ok":
            marks.append(r.status)
        chunk = "-" if r.kernel == "seed" else str(r.chunk)
        print(
            f"{r.kernel:<8} {chunk:>5} {'x'.join(map(str, r.key_tile)):>10} {'x'.join(map(str, r.value_tile)):>10} "
            f"{_num(r.aicore_us, '9.2f')} {_num(r.tasks, '5d')} {_num(r.floor_us, '11.2f')}  {', '.join(marks)}"
        )
    print(
        f"floor {_num(summary['floor_us'], '.2f')} us | seed {_num(summary['seed_us'], '.2f')} us "
        f"({_num(summary['seed_over_floor'], '.2f')}x floor) | chosen {_num(summary['chosen_us'], '.2f')} us "
        f"({_num(summary['chosen_over_floor'], '.2f')}x floor)"
        + (" | saved as the kernel's tiles for this shape" if summary["saved"] else "")
    )


def _num(value, spec: str) -> str:
    return format(value, spec) if value is not None else "-"


def add_parser(commands: argparse._SubParsersAction) -> None:
    from pakv_onnx.pypto import SUPPORTED_DTYPE_NAMES  # names: --help without torch

    parser = _args.add_command(
        commands,
        "tune",
        help="cost-model (SIM) table of the PyPTO kernel's chunk sizes for one case, with the copy floor",
        description=(
            "Run PyPTO's cost model (SIM mode, no NPU needed) on the GatherPaKvCache kernel for one case at "
            "every candidate chunk (token slots per task: power-of-two divisors of block_size whose vector "
            "tiles fit the 196,608-byte buffer), on the seed's kernel with the seed's tile rule ([16, 32] rows, "
            "[8, 8] when heads*dim >= 4096; Norm only), and on the floor: a PyPTO kernel copying the same "
            "output bytes contiguously (no block table). Prints the AICore end-to-end time of each, marks the "
            "closed-form rule's pick and the chosen (cheapest) one, and saves the chosen tiles in the cache so "
            "the kernel uses them for this shape from then on. The cost model charges static view shapes, not "
            "valid rows."
        ),
        examples=[
            "  # the shape options' defaults: the seed sweep's shapes, T=55",
            "--case level5",
            "--case heads64_k128_v128 --json",
            "--case nz-bfloat16 --chunks 4 16",
            "--op scatter --case scatter:bfloat16:8,128:8,128:128:1024:prefill4:4096:PA_NZ",
            "--dtype float16 --key-heads 8 --key-dim 128 --value-heads 8 --value-dim 128\n"
            "--block-size 64 --q 2 --tokens 300",
        ],
    )
    parser.add_argument(
        "--op",
        choices=("gather", "scatter"),
        default="gather",
        help="the kernel to tune: GatherPaKvCache (default) or the ScatterPaKvCache write kernel "
        "(then --case takes a scatter case id, e.g. scatter:bfloat16:8,128:8,128:128:1024:decode:16)",
    )
    parser.add_argument(
        "--case",
        metavar="ID",
        help="a case id of `pakv-onnx verify-kernel --list` (seed ids run with 64-block caches), or random-N, "
        "kernel-N, shape:...; otherwise the shape options make a Norm case",
    )
    shape = parser.add_argument_group("explicit shape (when --case is not given)")
    shape.add_argument("--dtype", default=DEFAULT_SHAPE["dtype"], choices=SUPPORTED_DTYPE_NAMES)
    shape.add_argument("--key-heads", type=_args.positive_int, default=DEFAULT_SHAPE["key_heads"])
    shape.add_argument("--key-dim", type=_args.positive_int, default=DEFAULT_SHAPE["key_dim"])
    shape.add_argument("--value-heads", type=_args.positive_int, default=DEFAULT_SHAPE["value_heads"])
    shape.add_argument("--value-dim", type=_args.positive_int, default=DEFAULT_SHAPE["value_dim"])
    _args.add_block_size(shape, default=128)
    shape.add_argument("--q", type=_args.positive_int, default=4, help="sequences (default: 4)")
    shape.add_argument(
        "--tokens", type=_args.positive_int, default=55, help="total tokens T, split evenly (default: 55)"
    )
    parser.add_argument(
        "--chunks", type=_args.positive_int, nargs="+", metavar="C", help="chunks to try (default: every candidate)"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON (top-level floor_us, rows)")
    parser.add_argument("--no-save", action="store_true", help="do not save the chosen tiles in the cache")
    parser.add_argument(
        "--jobs", type=_args.positive_int, default=1, help="cost-model subprocesses at once (default: 1)"
    )
    parser.add_argument("--timeout", type=float, default=600, metavar="S", help="per-subprocess timeout in seconds")
    parser.set_defaults(run=run)
