"""Argument types shared by the subcommands: refuse nonsense while parsing (exit 2, argparse's way).

Each raises :class:`argparse.ArgumentTypeError`, which argparse prints as
``pakv-onnx CMD: error: argument --X: <message>`` after the usage line.
"""

from __future__ import annotations

import argparse


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
