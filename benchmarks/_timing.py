"""Timing shared by the benchmarks: per-call medians in microseconds, variants timed in alternating
blocks of consecutive calls, and ORT sessions driven through an IOBinding built once (checked
bit-exact first)."""

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
    return blocked_medians_us({"fn": fn}, repeats, warmup)["fn"]


def blocked_medians_us(
    fns: dict[str, Callable[[], object]],
    calls: int,
    warmup: int = 3,
    block: int = 30,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Per-call median us of each function, timed in blocks of ``block`` consecutive calls.

    Blocks alternate between the functions (A-block, B-block, A-block ...), so machine drift
    hits all alike, while each block runs one function back to back, as a serving loop calls it:
    timing single calls in turn would make every function pay the caches the others evicted
    (which flatters whatever is compared with the fastest). The figure is the median over blocks
    of each block's median call; about ``calls`` calls of each function in all. ``clock`` is wall
    time; ``time.thread_time`` counts this thread's CPU time only (for functions that run on the
    calling thread: robust to other processes' load).
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    size = max(1, min(block, calls))
    rounds = max(1, -(-calls // size))
    blocks: dict[str, list[float]] = {name: [] for name in fns}
    times = [0.0] * size
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()  # one untimed call: the block starts with this function's own data in cache
            for i in range(size):
                start = clock()
                fn()
                times[i] = clock() - start
            blocks[name].append(statistics.median(times))
    return {name: statistics.median(b) * 1e6 for name, b in blocks.items()}
