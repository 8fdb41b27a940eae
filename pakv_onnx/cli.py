"""The ``pakv-onnx`` command line.

Each subcommand is one module of :mod:`pakv_onnx.commands` with ``add_parser(subparsers)``
(which sets ``run``); this file only lists them, parses and dispatches.

Exit codes, the same in every command: 0 success; 1 a check failed; 2 a usage error (argparse's
code: bad arguments, unknown case ids, a backend that cannot run here) or an environment problem
this run cannot get past (an unwritable directory, no place for the cache), printed as one line;
130 interrupted (Ctrl-C), also one line, never a traceback.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
from collections.abc import Sequence

from pakv_onnx import __version__

# One line per subcommand, in --help order.
COMMAND_MODULES = (
    "pakv_onnx.commands.demo",
    "pakv_onnx.commands.cases",
    "pakv_onnx.commands.verify_kernel",
    "pakv_onnx.commands.tune",
    "pakv_onnx.commands.generate",
    "pakv_onnx.commands.export",
    "pakv_onnx.commands.genai_cpu",
    "pakv_onnx.commands.cache",
)

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C

# OSErrors that mean "this machine's files are not as the run needs" rather than a bug.
ENVIRONMENT_ERRNOS = frozenset(
    {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR, errno.EEXIST, errno.ENOENT}
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pakv-onnx",
        description="GatherPaKvCache (paged KV cache gather) through the ONNX life cycle.",
        epilog="exit codes: 0 ok, 1 a check failed, 2 usage or environment error, 130 interrupted",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        importlib.import_module(module).add_parser(commands)
    return parser


def environment_message(err: OSError) -> str | None:
    """One line for an environment problem (path + what to do), or ``None`` for other errors."""
    from pakv_onnx.paths import CacheDirError

    if isinstance(err, CacheDirError):
        return str(err)
    if err.errno not in ENVIRONMENT_ERRNOS or not err.filename:
        return None
    return f"{err.filename}: {err.strerror}{_cache_hint(str(err.filename))}"


def _cache_hint(filename: str) -> str:
    from pakv_onnx.paths import CACHE_DIR_ENV, CacheDirError, cache_root

    try:
        inside = os.path.abspath(filename).startswith(str(cache_root()) + os.sep)
    except CacheDirError:
        inside = False
    return f" (in the pakv-onnx cache: set {CACHE_DIR_ENV} to a writable directory)" if inside else ""


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the subcommand; returns the exit code (see the module docstring)."""
    if list(sys.argv[1:] if argv is None else argv) == ["--version"]:
        print(f"pakv-onnx {__version__}")  # without loading the subcommands (and torch)
        return 0
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as done:  # --help, --version, or argparse's usage error (2)
            return 0 if done.code is None else int(done.code)
        return args.run(args)
    except KeyboardInterrupt:
        print("pakv-onnx: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as err:
        message = environment_message(err)
        if message is None:
            raise
        print(f"pakv-onnx: error: {message}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
