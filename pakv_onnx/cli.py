"""The ``pakv-onnx`` command line.

Each subcommand is one module of :mod:`pakv_onnx.commands` with ``add_parser(subparsers)``
(which sets ``run``); this file only lists them, parses and dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# One line per subcommand, in --help order.
COMMAND_MODULES = (
    "pakv_onnx.commands.demo",
    "pakv_onnx.commands.cases",
    "pakv_onnx.commands.verify_kernel",
    "pakv_onnx.commands.tune",
    "pakv_onnx.commands.generate",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pakv-onnx",
        description="GatherPaKvCache (paged KV cache gather) through the ONNX life cycle.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        importlib.import_module(module).add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
