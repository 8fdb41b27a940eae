"""The lines the commands print, in one format: progress, and the checking commands' per-case lines."""

from __future__ import annotations

import sys

from pakv_onnx.commands import _interrupt


def progress(message: str) -> None:
    """A command's progress line on stderr (``  .. message``), at a safe point for Ctrl-C: our own code,
    between steps."""
    _interrupt.check()
    print(f"  .. {message}", file=sys.stderr, flush=True)


def case_line(index: int, total: int, passed: bool, case_id: str, summary: str, detail: str, seconds: float) -> str:
    """``[i/n] PASS|FAIL id: inputs -> outcome (secs)``."""
    return f"[{index}/{total}] {'PASS' if passed else 'FAIL'} {case_id}: {summary} -> {detail} ({seconds:.1f}s)"


def totals_line(total: int, failures: int, what: str) -> str:
    """``N passed, M failed (what)``: the closing line test runners read."""
    return f"{total - failures} passed, {failures} failed ({what})"
