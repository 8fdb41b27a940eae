"""og.Engine for the tests (test-only): the onnxruntime-genai import (a failure under CI, a skip elsewhere)
and greedy generation of a workload with every request submitted at once."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from pakv_onnx.models.hf import Workload


def onnxruntime_genai():
    if os.environ.get("CI"):
        import onnxruntime_genai as og  # CI installs the genai extra: missing is a failure

        return og
    return pytest.importorskip("onnxruntime_genai", reason="the genai extra (onnxruntime-genai) is not installed")


def engine_tokens(folder: Path, workload: Workload) -> list[list[int]]:
    """og.Engine over ``folder`` (its genai_config as written): greedy tokens of every request of
    ``workload``, all submitted before the first run, each generating exactly its budget."""
    og = onnxruntime_genai()
    engine = og.Engine(og.Model(str(folder)))
    requests = []  # keep a reference to every request: og closes unreferenced ones
    for prompt, budget in zip(workload.prompts, workload.budgets):
        request = engine.create_request()
        options = og.TurnOptions(request)
        options.set_do_sample(False)
        options.set_max_generated_tokens(budget)
        options.set_min_generated_tokens(budget)  # no early stop at eos
        request.begin_turn(np.array(prompt, dtype=np.int32), options)
        requests.append(request)
    got: list[list[int]] = [[] for _ in requests]
    events = engine.create_event_buffer(64)
    while engine.has_pending_requests():
        for event in engine.run(events):
            got[next(i for i, r in enumerate(requests) if r == event.request)].append(int(event.token))
    return got
