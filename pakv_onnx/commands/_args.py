"""What the subcommands share: one way to declare a command, one definition of each shared option,
and argument types that refuse nonsense.

:func:`add_command` lays every ``--help`` out alike (description, optional reference text,
examples, notes) and records the examples so a test parses each one. The argument types raise
:class:`argparse.ArgumentTypeError`, which argparse prints as
``pakv-onnx CMD: error: argument --X: <message>`` after the usage line (exit 2).

Shared options: an option that more than one command takes is defined once, here, by an ``add_*``
function; a command calls it (with its own default or help where the option means something of its
own there) and gets the same name, range and refusal as every other command:

=====================================  ======================================================
:func:`add_block_size`                 ``--block-size``: tokens per cache block, 1..1024
:func:`add_num_blocks`                 ``--num-blocks``: blocks per layer pool, >= 1
:func:`add_max_batch_size`             ``--max-batch-size``: requests batched together, >= 1
:func:`add_threads`                    ``--threads``: ORT intra-op threads, >= 1
:func:`add_seed`                       ``--seed``: 0..2^32-1
:func:`add_random_cases`               ``--random N`` random cases, ``--seed`` the first one's
:func:`add_output_folder`              ``--out DIR`` or a positional OUT_DIR, with ``--force``
:func:`add_input_folder`               a folder the command reads (HF_DIR, MODEL_DIR)
:func:`add_precision`                  ``--precision``: fp32, fp16 or bf16 (:mod:`pakv_onnx.providers`)
:func:`add_execution_provider`         ``--execution-provider``: cpu or cuda
=====================================  ======================================================

The two folder options are checked after parsing and before the command runs (:func:`path_problem`,
called by the command line before any import of torch or transformers): an output folder must be
new or empty (``--force``: one with files in it), not a file, not an input folder, and writable
where the command stages it; an input folder must exist and hold what the command reads. A
refusal is one line naming the option: ``pakv-onnx CMD: error: argument --out: DIR: ...``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

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


# --------------------------------------------------------------------------- #
# Shared options: one definition each (see the module docstring)
# --------------------------------------------------------------------------- #
MAX_BLOCK_SIZE = 1024  # tokens per cache block, the largest any command takes
MAX_SEED = 2**32 - 1  # numpy's and torch's generators both take it
PATH_RULES = "_path_rules"  # the namespace attribute listing a command's folder options


def add_block_size(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, default: int | None = 16, help: str = ""
) -> None:
    """``--block-size N``: tokens per cache block, 1..:data:`MAX_BLOCK_SIZE`."""
    shown = "the model's" if default is None else str(default)
    parser.add_argument(
        "--block-size",
        type=int_in(1, MAX_BLOCK_SIZE),
        default=default,
        metavar="N",
        help=f"tokens per cache block (1..{MAX_BLOCK_SIZE}; default {shown}){'; ' + help if help else ''}",
    )


def add_num_blocks(parser: argparse.ArgumentParser, *, default: int | None, help: str) -> None:
    """``--num-blocks N``: blocks per layer pool (og.Engine's ``engine.dynamic_batching.num_blocks``), >= 1."""
    parser.add_argument("--num-blocks", type=positive_int, default=default, metavar="N", help=help)


def add_max_batch_size(parser: argparse.ArgumentParser, *, default: int | None, help: str) -> None:
    """``--max-batch-size N``: requests og.Engine batches together at most, >= 1."""
    parser.add_argument("--max-batch-size", type=positive_int, default=default, metavar="N", help=help)


def add_threads(parser: argparse.ArgumentParser, *, help: str) -> None:
    """``--threads N``: ONNX Runtime intra-op threads, >= 1 (default ``None``: ORT chooses)."""
    parser.add_argument("--threads", type=positive_int, default=None, metavar="N", help=help)


def add_seed(parser: argparse.ArgumentParser, *, help: str) -> None:
    """``--seed N``: 0..:data:`MAX_SEED`, default 0; ``help`` says what it seeds."""
    parser.add_argument("--seed", type=int_in(0, MAX_SEED), default=0, metavar="N", help=f"{help} (default 0)")


def add_random_cases(parser: argparse.ArgumentParser, *, default: int, help: str, seed_help: str) -> None:
    """``--random N``: how many random cases to add, >= 0 (``help`` says which), and :func:`add_seed`
    (``seed_help``) for the seed of the first of them."""
    parser.add_argument("--random", type=non_negative_int, default=default, metavar="N", help=help)
    add_seed(parser, help=seed_help)


@dataclasses.dataclass(frozen=True)
class PathRule:
    """A folder option checked after parsing (:func:`path_problem`).

    Attributes:
        dest: the namespace attribute holding the path (``None``: the option was not given).
        label: how refusals name it (``--out``, ``OUT_DIR``).
        output: an output folder (new or empty, or ``--force``) rather than an input one.
        check: an input folder's own check (what must be in it): a problem or ``None``.
    """

    dest: str
    label: str
    output: bool
    check: Callable[[Path], str | None] | None = None


def add_output_folder(parser: argparse.ArgumentParser, *, positional: str | None = None, help: str) -> None:
    """An output folder: ``--out DIR`` (optional, ``dest`` ``out``) or the positional ``positional``
    (``OUT_DIR``: ``dest`` its lower case), and ``--force``. Written through
    :func:`pakv_onnx.commands._outputs.staged_folder`."""
    if positional:
        dest = positional.lower()
        parser.add_argument(dest, type=folder_path, metavar=positional, help=help)
        label = positional
    else:
        dest, label = "out", "--out"
        parser.add_argument("--out", type=folder_path, metavar="DIR", default=None, help=help)
    parser.add_argument(
        "--force",
        action="store_true",
        help=f"write into {label} even when it has files in it (files of the output's names are replaced, "
        f"others are left; default: {label} must be new or empty)",
    )
    _add_rule(parser, PathRule(dest, label, output=True))


def add_input_folder(
    parser: argparse.ArgumentParser, metavar: str, *, help: str, check: Callable[[Path], str | None] | None = None
) -> None:
    """A positional input folder ``metavar`` (``dest`` its lower case) that must exist and pass ``check``."""
    dest = metavar.lower()
    parser.add_argument(dest, type=folder_path, metavar=metavar, help=help)
    _add_rule(parser, PathRule(dest, metavar, output=False, check=check))


def folder_path(text: str) -> Path:
    """A folder argument as given (``~`` expanded); what it must be is :func:`path_problem`'s."""
    return Path(text).expanduser()


def _add_rule(parser: argparse.ArgumentParser, rule: PathRule) -> None:
    parser.set_defaults(**{PATH_RULES: (*(parser.get_default(PATH_RULES) or ()), rule)})


def path_problem(args: argparse.Namespace) -> str | None:
    """The first refusal of ``args``' folder options, as ``argument LABEL: PATH: why`` (``None``: all fine).
    Reads the filesystem only (creates and removes one probe folder where an output is staged)."""
    rules = getattr(args, PATH_RULES, ())
    inputs = [(rule, getattr(args, rule.dest)) for rule in rules if not rule.output]
    for rule in rules:
        path = getattr(args, rule.dest)
        if path is None:
            continue
        if rule.output:
            problem = output_folder_problem(path, force=args.force, inputs=[(r.label, p) for r, p in inputs])
        else:
            problem = input_folder_problem(path, rule.check)
        if problem:
            return f"argument {rule.label}: {path}: {problem}"
    return None


def input_folder_problem(path: Path, check: Callable[[Path], str | None] | None = None) -> str | None:
    """Why ``path`` is not a folder the command can read (``None``: it is)."""
    if not path.exists():
        return "no such folder"
    if not path.is_dir():
        return "not a folder"
    return check(path) if check else None


def output_folder_problem(path: Path, *, force: bool, inputs: Sequence[tuple[str, Path]] = ()) -> str | None:
    """Why a command must not write the output folder ``path`` (``None``: it may): a file, a folder
    with files in it (unless ``force``), one of the command's input folders (``(label, path)``), a
    path under a file, or a place this user cannot write."""
    from pakv_onnx.commands._outputs import staging_base

    absolute = path.absolute()
    for label, source in inputs:
        if source is not None and absolute.resolve() == source.absolute().resolve():
            return f"it is {label}; give the output a folder of its own"
    if os.path.lexists(absolute):
        if not absolute.is_dir():
            return "exists and is not a folder"
        if not force and any(absolute.iterdir()):
            return (
                "exists and is not empty; pass --force to write into it (files of the output's names are "
                "replaced, others are left)"
            )
    base = staging_base(absolute)
    if not base.is_dir():
        return f"{base} is not a folder"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".pakv-onnx-probe-", dir=base))
    except OSError as err:
        return f"cannot write to {base}: {err.strerror or err}"
    return None


def add_precision(parser: argparse.ArgumentParser, *, what: str) -> None:
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


def add_execution_provider(parser: argparse.ArgumentParser) -> None:
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
