"""The ``pakv-onnx`` command line.

Each subcommand is one module of :mod:`pakv_onnx.commands` with ``add_parser(subparsers)``
(which sets ``run``); this file only lists them, parses and dispatches.

Exit codes, the same in every command: 0 success; 1 a check failed; 2 a usage error (argparse's
code: bad arguments, unknown case ids, a backend that cannot run here) or an environment problem
this run cannot get past (an unwritable directory, no place for the cache), printed as one line;
130 interrupted (Ctrl-C), also one line, never a traceback, within seconds wherever the command was,
leaving none of its outputs (:mod:`pakv_onnx.commands._interrupt`, :mod:`pakv_onnx.commands._outputs`).
Folder options are checked before the command runs (:func:`pakv_onnx.commands._args.path_problem`).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
import threading
from collections.abc import Sequence

from pakv_onnx import __version__
from pakv_onnx.commands import _args, _interrupt

# One line per subcommand, in --help order.
COMMAND_MODULES = (
    "pakv_onnx.commands.demo",
    "pakv_onnx.commands.cases",
    "pakv_onnx.commands.verify_kernel",
    "pakv_onnx.commands.tune",
    "pakv_onnx.commands.generate",
    "pakv_onnx.commands.export",
    "pakv_onnx.commands.genai_cpu",
    "pakv_onnx.commands.serve",
    "pakv_onnx.commands.cache",
)

EXIT_USAGE = _args.EXIT_USAGE
EXIT_INTERRUPTED = _interrupt.EXIT_INTERRUPTED

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


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """argparse's parse, except that an unknown option before the command is named as such (argparse
    alone says only that COMMAND is missing). Raises SystemExit as argparse does."""
    parser = build_parser()
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        parser.error(f"unrecognized arguments: {argv[0]} (a command comes first: pakv-onnx COMMAND [options])")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: the process's command line, after which SIGINT stays ignored while the
    process exits) and run the subcommand; returns the exit code (see the module docstring)."""
    as_program = argv is None  # the process's own command line: it exits when this returns
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--version"]:
        print(f"pakv-onnx {__version__}")  # without loading the subcommands
        return 0
    with _interrupt.handling(then_ignore=as_program) as interrupt:
        command = None
        try:
            try:
                args = parse(argv)
            except SystemExit as done:  # --help, --version, or argparse's usage error (2)
                if not interrupt.requested:
                    return 0 if done.code is None else int(done.code)
                raise
            command = args.command
            problem = _args.path_problem(args)  # before the command imports torch or does any work
            code = _args.usage_error(command, problem) if problem else args.run(args)
        except BaseException as err:
            if interrupt.requested and not interrupt.committed:  # a safe point's KeyboardInterrupt, or on its way
                return _interrupted(interrupt)
            message = environment_message(err) if isinstance(err, OSError) else None
            if message is None:
                raise
            return _args.usage_error(command, message)
        if interrupt.requested and not interrupt.committed:  # Ctrl-C after the last safe point
            return _interrupted(interrupt)
        return code


def _interrupted(interrupt: _interrupt.State) -> int:
    """The one line and 130, unless the watchdog's hard exit is printing it (then wait for it)."""
    if not _interrupt.end_run(interrupt):
        threading.Event().wait()  # os._exit comes from the watchdog
    print(_interrupt.MESSAGE, file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED

if __name__ == "__main__":
    sys.exit(main())
