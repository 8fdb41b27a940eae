"""The server's Prometheus metrics, written in the text exposition format (version 0.0.4) by hand: a
few counters, gauges and two histograms need no client library.

Counters and histograms are updated from the engine thread and the event loop; each update is one
small Python operation under the GIL, and a scrape reads whatever values are there.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Sequence
from typing import ClassVar

PREFIX = "pakv_serve_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Latency buckets (seconds): 1 ms .. 30 s, about 2.5x apart.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclasses.dataclass
class Histogram:
    """Cumulative buckets, a sum and a count."""

    buckets: Sequence[float]
    counts: list[int] = dataclasses.field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1


class Metrics:
    """What ``/metrics`` reports. ``gauges`` maps a gauge's name to a function that reads it now."""

    HELP: ClassVar[dict[str, tuple[str, str]]] = {
        "requests_total": ("counter", "HTTP requests to /v1 by response status code"),
        "finished_total": ("counter", "generations by how they ended (stop, length, cancelled, error)"),
        "prompt_tokens_total": ("counter", "prompt tokens of finished generations"),
        "generated_tokens_total": ("counter", "tokens generated"),
        "time_to_first_token_seconds": (
            "histogram",
            "from a request's arrival to its first token (queue wait included)",
        ),
        "inter_token_latency_seconds": ("histogram", "between consecutive tokens of one request"),
        "queue_depth": ("gauge", "requests waiting for admission into og.Engine"),
        "running_requests": ("gauge", "requests live in og.Engine"),
        "pool_blocks_total": ("gauge", "blocks in each layer's KV pool"),
        "pool_blocks_free": ("gauge", "pool blocks no live request's tokens occupy (derived: docs/serve.md)"),
        "pool_blocks_reserved": ("gauge", "pool blocks admission set aside for live requests"),
    }

    def __init__(self, gauges: dict[str, Callable[[], float]] | None = None) -> None:
        self.requests: dict[str, int] = {}
        self.finished: dict[str, int] = {}
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.itl = Histogram(LATENCY_BUCKETS)
        self.gauges = dict(gauges or {})

    def count_request(self, status: int) -> None:
        key = str(status)
        self.requests[key] = self.requests.get(key, 0) + 1

    def observe(self, name: str, value: float) -> None:
        """An engine measurement (:class:`~pakv_onnx.serve.engine.EngineLoop`'s ``observe``)."""
        if name == "ttft":
            self.ttft.observe(value)
        elif name == "itl":
            self.itl.observe(value)
        elif name == "prompt_tokens":
            self.prompt_tokens += int(value)
        elif name == "generated_tokens":
            self.generated_tokens += int(value)
        elif name.startswith("finished:"):
            reason = name.partition(":")[2]
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def render(self) -> str:
        """The exposition text."""
        lines: list[str] = []

        def head(name: str) -> str:
            kind, text = self.HELP[name]
            lines.extend([f"# HELP {PREFIX}{name} {text}", f"# TYPE {PREFIX}{name} {kind}"])
            return PREFIX + name

        full = head("requests_total")
        lines += [f'{full}{{status="{code}"}} {n}' for code, n in sorted(self.requests.items())]
        full = head("finished_total")
        lines += [f'{full}{{reason="{reason}"}} {n}' for reason, n in sorted(self.finished.items())]
        lines.append(f"{head('prompt_tokens_total')} {self.prompt_tokens}")
        lines.append(f"{head('generated_tokens_total')} {self.generated_tokens}")
        for name, histogram in (("time_to_first_token_seconds", self.ttft), ("inter_token_latency_seconds", self.itl)):
            full = head(name)
            running = 0
            for bound, n in zip([*histogram.buckets, float("inf")], histogram.counts):
                running += n
                le = "+Inf" if bound == float("inf") else repr(bound)
                lines.append(f'{full}_bucket{{le="{le}"}} {running}')
            lines += [f"{full}_sum {histogram.total!r}", f"{full}_count {histogram.count}"]
        for name, read in self.gauges.items():
            lines.append(f"{head(name)} {read()}")
        return "\n".join(lines) + "\n"
