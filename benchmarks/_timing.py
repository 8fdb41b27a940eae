"""Timing shared by the benchmarks: medians in microseconds, variants timed in turn round by round,
and ORT sessions driven through an IOBinding built once (checked bit-exact first)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import torch

from pakv_onnx import runtime_plugin
from pakv_onnx.spec import bitwise_equal


def prebound(
    session,
    feeds: Mapping[str, torch.Tensor | None],
    outs: dict[str, torch.Tensor],
    golden: tuple[torch.Tensor, torch.Tensor],
    label: str,
) -> Callable[[], object]:
    """``session.run_with_iobinding`` on an IOBinding built once (how a serving loop drives ORT).

    One ``runtime_plugin.run`` into ``outs`` first, its key and value checked bit-exact against
    ``golden`` (``label`` names the session if not); the binding writes into ``outs`` too.
    """
    result = runtime_plugin.run(session, feeds, out=outs)
    assert bitwise_equal(result["key"], golden[0]) and bitwise_equal(result["value"], golden[1]), label
    binding = runtime_plugin.bind(session, feeds, out=outs)
    return lambda: session.run_with_iobinding(binding)


def median_us(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` in microseconds over ``repeats`` calls (after ``warmup``)."""
    return interleaved_medians_us({"fn": fn}, repeats, warmup)["fn"]


def interleaved_medians_us(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 3) -> dict[str, float]:
    """Median us of each function, timed in turn round by round so machine drift hits all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}
