"""``pakv-onnx demo``: the main job — sample attention graphs exported and run every way.

With ``--out DIR`` each graph is kept as ``DIR/<graph>.onnx`` next to its sample data:
``DIR/<graph>.inputs/<input>.pb`` (the feeds the demo ran) and ``DIR/<graph>.expected/<output>.pb``
(the torch reference outputs), one ONNX ``TensorProto`` file per tensor, named after the graph
input or output and keeping its element type (bf16 caches stay bf16). ``onnx.load_tensor(path)``
reads one; ``raw_data`` holds the little-endian bytes. ``DIR`` is new or empty (``--force``: files
of the same names are replaced). The files appear in ``DIR`` only when every graph has run: they
are written in a staging folder (:mod:`pakv_onnx.commands._outputs`) that an interrupted run removes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Mapping
from pathlib import Path

from pakv_onnx.commands import _args, _interrupt, _outputs, _report

# Without --backend: these, and pypto-cpu where pypto is installed (demo.run_graph's add_pypto_cpu).
DEFAULT_BACKENDS = ("native", "golden")


def save_tensors(directory: Path, tensors: Mapping[str, object]) -> None:
    """Write each torch tensor as ``directory/<name>.pb``, an ONNX TensorProto of its element type."""
    import torch
    from onnx import helper

    from pakv_onnx.runtime_plugin._tensors import onnx_type_of

    directory.mkdir(exist_ok=True)  # never its parents: a staging folder removed by Ctrl-C stays removed
    for name, tensor in tensors.items():
        if tensor is None:  # an absent optional input
            continue
        tensor = tensor.detach().cpu().contiguous()
        raw = tensor.view(-1).view(torch.uint8).numpy().tobytes()  # bf16/fp8 have no numpy type
        proto = helper.make_tensor(name, onnx_type_of(tensor.dtype), list(tensor.shape), raw, raw=True)
        (directory / f"{name}.pb").write_bytes(proto.SerializeToString())


def run(args: argparse.Namespace) -> int:
    from pakv_onnx import demo  # imports torch.onnx/onnxruntime: only when the command runs

    _interrupt.check()
    graphs = demo.MODEL_CHOICES[args.model]
    need, have = demo.estimated_peak_bytes(graphs, args.tokens, seed=args.seed), _physical_memory_bytes()
    if have and need > have:
        return _args.usage_error(
            "demo",
            f"--tokens {args.tokens} needs about {need / 2**30:.0f} GiB (the sample graphs attend per sequence: "
            f"memory grows with the longest sequence squared) but this machine has {have / 2**30:.0f} GiB",
        )

    with contextlib.ExitStack() as stack:
        # With --out: staged beside DIR and published when every graph has run; else a temporary folder.
        if args.out:
            staging = stack.enter_context(_outputs.staged_folder(args.out))
        else:
            staging = stack.enter_context(_outputs.temporary_folder("pakv-onnx-demo-"))
        all_passed = True
        for name in graphs:
            graph = demo.SAMPLE_GRAPHS[name]

            def keep_data(inputs: dict, expected: dict, name: str = name) -> None:
                save_tensors(staging / f"{name}.inputs", inputs)
                save_tensors(staging / f"{name}.expected", expected)

            results = demo.run_graph(
                graph,
                out_dir=staging,
                backends=args.backend or DEFAULT_BACKENDS,
                num_tokens=args.tokens,
                seed=args.seed,
                repeats=args.repeats,
                progress=_report.progress,
                on_data=keep_data if args.out else None,
                add_pypto_cpu=args.backend is None,  # the default set; a --backend list is run as given
            )
            _interrupt.check()
            print(demo.format_table(graph, args.tokens, results), flush=True)
            all_passed &= all(r.passed for r in results)
    if args.out:
        print(f"ONNX files and their sample inputs/expected outputs kept in {args.out}")
    print(f"gather outputs bit-exact, attention max abs error <= {demo.ATTENTION_ATOL:g}")
    print("PASS" if all_passed else "FAIL")
    return 0 if all_passed else 1


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = _args.add_command(
        commands,
        "demo",
        help="export the sample attention graphs and run them every way (the main job)",
        description=(
            "Build the sample attention models (DeepSeek-style MLA context attention; GQA with "
            "block size 16 and 128) with random paged caches (shuffled block ids, ragged lengths, "
            "non-zero seq_offset), export each to ONNX with a pakv::GatherPaKvCache node, and run "
            "the graph in ONNX Runtime with the plugin (each --backend) and on stock ORT through the "
            "graph's fallback function. Each run is compared with the torch reference forward: "
            "gathered key/value bit-exact, attention output within a fp32 tolerance. Prints one "
            "table per graph and PASS/FAIL; exit code 0/1 (2: bad arguments)."
        ),
        examples=[
            "",
            "--model mla --tokens 4096 --out ./onnx",
            "--backend native,golden,torch",
        ],
        notes=(
            "--out DIR keeps, per graph: DIR/<graph>.onnx, DIR/<graph>.inputs/<input>.pb (the feeds) and\n"
            "DIR/<graph>.expected/<output>.pb (torch reference outputs), ONNX TensorProto files\n"
            "(onnx.load_tensor) keeping each tensor's element type (bf16 caches stay bf16)."
        ),
    )
    parser.add_argument(
        "--model", choices=("mla", "gqa", "all"), default="all", help="which sample graphs (default: all)"
    )
    parser.add_argument(
        "--backend",
        type=_args.runnable_backend_list,
        default=None,
        help="comma-separated plugin backends to run each graph on, besides stock ORT, exactly these; each "
        "must be able to run here (default: native,golden, and pypto-cpu where pypto is installed: its rows "
        "take seconds per run)",
    )
    _args.add_output_folder(
        parser,
        help="keep the exported .onnx files and their sample inputs and expected outputs in DIR, new or empty "
        "(default: a temporary folder, removed at the end)",
    )
    _args.add_seed(parser, help="seed of the weights, caches and block tables")
    parser.add_argument(
        "--tokens",
        type=_args.positive_int,
        default=256,
        help="total tokens per batch, T (default: 256); memory grows with the longest sequence squared",
    )
    parser.add_argument(
        "--repeats", type=_args.positive_int, default=5, help="timed runs per way, median reported (default: 5)"
    )
    parser.set_defaults(run=run)
