"""The per-case lines the checking commands print, in one format."""

from __future__ import annotations


def case_line(index: int, total: int, passed: bool, case_id: str, summary: str, detail: str, seconds: float) -> str:
    """``[i/n] PASS|FAIL id: inputs -> outcome (secs)``."""
    return f"[{index}/{total}] {'PASS' if passed else 'FAIL'} {case_id}: {summary} -> {detail} ({seconds:.1f}s)"


def totals_line(total: int, failures: int, what: str) -> str:
    """``N passed, M failed (what)``: the closing line test runners read."""
    return f"{total - failures} passed, {failures} failed ({what})"
