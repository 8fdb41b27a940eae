"""The seed's case list, ``data/seed_sweep.json``, read without torch: its entries and ids.

:mod:`pakv_onnx.cases` builds the cases from these entries; this module only lists them, so the
command line checks a case id (``pakv-onnx cases level0 nope``) without importing torch.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any


@functools.cache
def sweep() -> dict[str, Any]:
    """The parsed ``seed_sweep.json``: ``cases`` (the network sweep) and ``manual`` (two shapes)."""
    return json.loads(resources.files("pakv_onnx").joinpath("data/seed_sweep.json").read_text())


def entries() -> list[tuple[dict[str, Any], bool]]:
    """Every entry with whether it is a manual shape: the sweep (``level0`` ...) first, then the manual ones."""
    data = sweep()
    return [(entry, False) for entry in data["cases"]] + [(entry, True) for entry in data["manual"]]


def case_ids() -> tuple[str, ...]:
    """The ids, in :func:`entries` order."""
    return tuple(entry["id"] for entry, _ in entries())


def check_case_id(case_id: str) -> str:
    """``case_id`` if it names a seed case; ``ValueError`` listing the ids otherwise."""
    if case_id not in case_ids():
        raise ValueError(f"unknown case id {case_id!r} (known: {', '.join(case_ids())})")
    return case_id
