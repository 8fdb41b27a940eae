"""``pakv-onnx demo``: the main job — sample attention graphs exported and run every way.

With ``--out DIR`` each graph is kept as ``DIR/<graph>.onnx`` next to its sample data:
``DIR/<graph>.inputs/<input>.pb`` (the feeds the demo ran) and ``DIR/<graph>.expected/<output>.pb``
(the torch reference outputs), one ONNX ``TensorProto`` file per tensor, named after the graph
input or output and keeping its element type (bf16 caches stay bf16). ``onnx.load_tensor(path)``
reads one; ``raw_data`` holds the little-endian bytes. A graph's files appear in ``DIR`` only once
they are complete: they are written in a hidden staging directory inside ``DIR`` that an
interrupted or failed run removes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from pakv_onnx.commands import _args, _interrupt

STAGING_PREFIX = ".pakv-onnx-partial-"
# Without --backend: these, and pypto-cpu where pypto is installed (demo.run_graph's add_pypto_cpu).
DEFAULT_BACKENDS = ("native", "golden")


def writable_dir(text: str) -> Path:
    """argparse type for ``--out``: a directory that exists or can be made, and can be written.

    Checked before any model is built, so a bad path costs nothing; the refusal names the path.
    """
    path = Path(text).expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=STAGING_PREFIX)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise argparse.ArgumentTypeError(f"cannot write to {path}: {err.strerror or err}") from None
    return path


def save_tensors(directory: Path, tensors: Mapping[str, object]) -> None:
    """Write each torch tensor as ``directory/<name>.pb``, an ONNX TensorProto of its element type."""
    import torch
    from onnx import helper

    from pakv_onnx.runtime_plugin._tensors import onnx_type_of

    directory.mkdir(parents=True, exist_ok=True)
    for name, tensor in tensors.items():
        if tensor is None:  # an absent optional input
            continue
        tensor = tensor.detach().cpu().contiguous()
        raw = tensor.view(-1).view(torch.uint8).numpy().tobytes()  # bf16/fp8 have no numpy type
        proto = helper.make_tensor(name, onnx_type_of(tensor.dtype), list(tensor.shape), raw, raw=True)
        (directory / f"{name}.pb").write_bytes(proto.SerializeToString())


def _publish(staging: Path, out_dir: Path) -> None:
    """Move every entry of ``staging`` into ``out_dir``, replacing entries of the same name."""
    for entry in sorted(staging.iterdir()):
        target = out_dir / entry.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(entry, target)


def run(args: argparse.Namespace) -> int:
    from pakv_onnx import demo  # imports torch.onnx/onnxruntime: only when the command runs

    graphs = demo.MODEL_CHOICES[args.model]
    need, have = demo.estimated_peak_bytes(graphs, args.tokens, seed=args.seed), _physical_memory_bytes()
    if have and need > have:
        return _args.usage_error(
            "demo",
            f"--tokens {args.tokens} needs about {need / 2**30:.0f} GiB (the sample graphs attend per sequence: "
            f"memory grows with the longest sequence squared) but this machine has {have / 2**30:.0f} GiB",
        )

    def progress(message: str) -> None:
        _interrupt.check()  # a Ctrl-C that a library swallowed ends the run at the next step
        print(f"  .. {message}", file=sys.stderr, flush=True)

    try:
        # With --out: stage inside DIR (same filesystem: publishing is a rename); else a temp dir.
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX if args.out else "pakv-onnx-demo-", dir=args.out))
    except OSError as err:
        where = args.out or "the temporary directory (TMPDIR)"
        return _args.usage_error("demo", f"cannot write to {where}: {err.strerror or err}")
    _interrupt.on_hard_exit(lambda: shutil.rmtree(staging, ignore_errors=True))
    try:
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
                progress=progress,
                on_data=keep_data if args.out else None,
                add_pypto_cpu=args.backend is None,  # the default set; a --backend list is run as given
            )
            print(demo.format_table(graph, args.tokens, results), flush=True)
            all_passed &= all(r.passed for r in results)
            if args.out:
                _publish(staging, args.out)
        if args.out:
            print(f"ONNX files and their sample inputs/expected outputs kept in {args.out}")
    finally:  # an interrupted or failed run leaves nothing half-written behind
        shutil.rmtree(staging, ignore_errors=True)
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
    parser.add_argument(
        "--out",
        metavar="DIR",
        type=writable_dir,
        help="keep the exported .onnx files and their sample inputs and expected outputs in DIR "
        "(default: a temporary directory)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, caches and block tables (default: 0)")
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
