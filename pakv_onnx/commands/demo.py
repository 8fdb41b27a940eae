"""``pakv-onnx demo``: the main job — sample attention graphs exported and run every way."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from pakv_onnx import kernels


def run(args: argparse.Namespace) -> int:
    from pakv_onnx import demo  # imports torch.onnx/onnxruntime: only when the command runs

    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    for name in backends:
        try:
            kernels.get_backend(name)
        except ValueError as err:
            print(f"error: --backend: {err}", file=sys.stderr)
            return 2
    if args.tokens < 1:
        print(f"error: --tokens must be >= 1, got {args.tokens}", file=sys.stderr)
        return 2
    graphs = demo.MODEL_CHOICES[args.model]
    need, have = demo.estimated_peak_bytes(graphs, args.tokens), _physical_memory_bytes()
    if have and need > have:
        print(
            f"error: --tokens {args.tokens} needs about {need / 2**30:.0f} GiB (the sample graphs attend densely "
            f"over the packed batch: memory grows with T^2) but this machine has {have / 2**30:.0f} GiB",
            file=sys.stderr,
        )
        return 2

    def progress(message: str) -> None:
        print(f"  .. {message}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="pakv-onnx-demo-") as tmp:
        out_dir = Path(args.out) if args.out else Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        all_passed = True
        for name in graphs:
            graph = demo.SAMPLE_GRAPHS[name]
            results = demo.run_graph(
                graph,
                out_dir=out_dir,
                backends=backends,
                num_tokens=args.tokens,
                seed=args.seed,
                repeats=args.repeats,
                progress=progress,
            )
            print(demo.format_table(graph, args.tokens, results), flush=True)
            all_passed &= all(r.passed for r in results)
        if args.out:
            print(f"ONNX files kept in {out_dir}")
    print(f"gather outputs bit-exact, attention max abs error <= {demo.ATTENTION_ATOL:g}")
    print("PASS" if all_passed else "FAIL")
    return 0 if all_passed else 1


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "demo",
        help="export the sample attention graphs and run them every way (the main job)",
        description=(
            "Build the sample attention models (DeepSeek-style MLA context attention; GQA with "
            "block size 16 and 128) with random paged caches (shuffled block ids, ragged lengths, "
            "non-zero seq_offset), export each to ONNX with a pakv::GatherPaKvCache node, and run "
            "the graph in ONNX Runtime with the plugin (each --backend) and on stock ORT through the "
            "graph's fallback function. Each run is compared with the torch reference forward: "
            "gathered key/value bit-exact, attention output within a fp32 tolerance. Prints one "
            "table per graph and PASS/FAIL; exit code 0/1."
        ),
        epilog="examples:\n  pakv-onnx demo\n  pakv-onnx demo --model mla --tokens 4096 --out ./onnx\n"
        "  pakv-onnx demo --backend native,golden,torch",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model", choices=("mla", "gqa", "all"), default="all", help="which sample graphs (default: all)"
    )
    parser.add_argument(
        "--backend",
        default="native,golden",
        help="comma-separated plugin backends to run each graph on, besides stock ORT (default: native,golden)",
    )
    parser.add_argument(
        "--out", metavar="DIR", help="keep the exported .onnx files in DIR (default: a temporary directory)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, caches and block tables (default: 0)")
    parser.add_argument(
        "--tokens",
        type=int,
        default=256,
        help="total tokens per batch, T (default: 256); memory grows with T^2 (about 7 GB at 2048)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per way, median reported (default: 5)")
    parser.set_defaults(run=run)
