"""What the subcommands share: one way to declare a command, and argument types that refuse nonsense.

:func:`add_command` lays every ``--help`` out alike (description, optional reference text,
examples, notes) and records the examples so a test parses each one. The argument types raise
:class:`argparse.ArgumentTypeError`, which argparse prints as
``pakv-onnx CMD: error: argument --X: <message>`` after the usage line (exit 2).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

PROG = "pakv-onnx"
EXIT_USAGE = 2  # a usage or environment error (argparse's code)
# Command name -> the argument lines of its --help examples (tests parse every one).
EXAMPLES: dict[str, tuple[str, ...]] = {}


def add_command(
    commands: argparse._SubParsersAction,
    name: str,
    *,
    help: str,  # noqa: A002 (argparse's own keyword)
    description: str,
    examples: Sequence[str],
    reference: str = "",
    notes: str = "",
) -> argparse.ArgumentParser:
    """Declare subcommand ``name`` and return its parser.

    Args:
        help: one line for ``pakv-onnx --help``.
        description: the paragraph ``pakv-onnx NAME --help`` opens with (wrapped by argparse).
        examples: the arguments after ``pakv-onnx NAME`` of each example (``""``: none), optionally
            followed by ``  # comment``; a ``\n`` continues the example on the next line.
        reference: preformatted text shown before the examples (e.g. a table of case ids).
        notes: preformatted text shown after them.
    """
    EXAMPLES[name] = tuple(examples)
    epilog = f"{reference}\n" if reference else ""
    epilog += "examples:\n" + "\n".join(_example_lines(name, examples))
    if notes:
        epilog += f"\n\n{notes}"
    return commands.add_parser(
        name, help=help, description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def error_prefix(command: str | None = None) -> str:
    """``pakv-onnx CMD: error:`` (``pakv-onnx: error:`` with no command): argparse's own form, so every
    refusal of the command line reads alike."""
    return f"{PROG} {command}: error:" if command else f"{PROG}: error:"


def usage_error(command: str | None, message: str) -> int:
    """Print ``message`` as one ``pakv-onnx CMD: error: ...`` line on stderr; returns the exit code, 2."""
    print(f"{error_prefix(command)} {message}", file=sys.stderr)
    return EXIT_USAGE


def _example_lines(name: str, examples: Sequence[str]) -> list[str]:
    """``  pakv-onnx NAME ARGS`` per example; comments aligned, continuations indented under ARGS."""
    split = [(args.rstrip(), comment) for args, _, comment in (e.partition("  # ") for e in examples)]
    commented = [len(f"{PROG} {name} {args}") for args, comment in split if comment and "\n" not in args]
    column = max(commented, default=0) + 2
    lines = []
    for args, comment in split:
        command = f"{PROG} {name} {args}".rstrip().replace("\n", " \\\n" + " " * (len(PROG) + len(name) + 4))
        lines.append(f"  {command.ljust(column)}# {comment.strip()}" if comment else f"  {command}")
    return lines


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1 (``--repeats``, ``--tokens``)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (``--random``)."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def int_in(low: int, high: int):
    """An argument type: an integer in ``low..high`` (``--batch``, ``--block-size``)."""

    def parse(text: str) -> int:
        value = _int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in {low}..{high}, got {value}")
        return value

    return parse


def runnable_backend(name: str, *, allow_auto: bool = True) -> str:
    """A backend name that exists and can run in this process (``auto`` always can).

    The refusal says why (e.g. "pypto is not installed") and which backends can run here, so a
    run that could only fail after building its inputs never starts.
    """
    from pakv_onnx import kernels

    if name == kernels.AUTO and allow_auto:
        return name
    try:
        backend = kernels.get_backend(name)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    reason = backend.unavailable_reason()
    if reason is not None:
        able = [other for other in kernels.backend_names() if kernels.get_backend(other).unavailable_reason() is None]
        raise argparse.ArgumentTypeError(
            f"backend {name!r} cannot run here: {reason} (backends that can: {', '.join(able) or 'none'})"
        )
    return name


def runnable_backend_list(text: str) -> list[str]:
    """Comma-separated :func:`runnable_backend` names, at least one."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"want comma-separated backend names, got {text!r}")
    return [runnable_backend(name) for name in names]


def add_precision_option(parser: argparse.ArgumentParser, *, what: str) -> None:
    """``--precision fp32|fp16|bf16`` (:data:`pakv_onnx.providers.PRECISIONS`; default fp32). ``what``:
    what the precision applies to, for the help line."""
    from pakv_onnx import providers  # light: no torch

    notes = "; ".join(f"{p.name}: {p.note}" for p in providers.PRECISIONS.values())
    parser.add_argument(
        "--precision",
        choices=tuple(providers.PRECISIONS),
        default=providers.DEFAULT_PRECISION,
        help=f"element types of {what} (default {providers.DEFAULT_PRECISION}). {notes}",
    )


def add_execution_provider_option(parser: argparse.ArgumentParser) -> None:
    """``--execution-provider cpu|cuda`` (:data:`pakv_onnx.providers.EXECUTION_PROVIDERS`; default cpu)."""
    from pakv_onnx import providers

    parser.add_argument(
        "--execution-provider",
        choices=providers.EXECUTION_PROVIDERS,
        default=providers.CPU,
        help="where og.Engine runs the folder, the one thing genai_config.json changes (model.onnx is the same): "
        "cpu (this library as custom_ops_library runs com.microsoft::PagedAttention) or cuda (ORT's CUDA "
        "provider and its own kernel of the op; --precision fp16 or bf16, and the other limits of ORT's kernel "
        "in docs/decoders.md, checked before anything is written). Default cpu",
    )
