"""The decode variants the GenAI benchmarks compare, all built offline from one ``save_pretrained`` folder.

- :func:`write_folders`: a tiny Llama with seeded weights (vocab :data:`GENAI_VOCAB`) and a word-level
  tokenizer; ``pakv-onnx export`` of it (fused, and ``--no-fuse``); ORT GenAI's dense CPU model of
  the same folder (``python -m onnxruntime_genai.models.builder -p fp32 -e cpu``).
- One decode run per variant: ``prefill`` (untimed) then ``steps`` greedy decode steps, each step
  timed alone; each returns ``(seconds per step, tokens [B][steps + 1])`` (the prefill's token first).

onnxruntime_genai is imported inside the functions that use it.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from pakv_onnx import cli, runtime_plugin
from pakv_onnx.models.hf import Workload, check, new_cache, present_bindings, save_sample_folder, step_inputs

# ORT GenAI's builder takes the LM head to be "the Linear whose out_features == vocab_size": the
# tiny Llama's vocab of 256 equals its MLP width and gets the wrong layer (silently). 512 is no
# other layer's width (128, 64, 256).
GENAI_VOCAB = 512
SEED = 0


@dataclasses.dataclass(frozen=True)
class Folders:
    hf: Path  # save_pretrained + tokenizer files
    paged: Path  # pakv-onnx export (fused, the default)
    unfused: Path  # pakv-onnx export --no-fuse
    dense: Path  # ORT GenAI's builder, -p fp32 -e cpu


def write_folders(root: Path, block_size: int, num_blocks: int, max_batch: int, unfused: bool = True) -> Folders:
    """Write every variant's model folder under ``root`` (a temp dir; ``unfused``: the ``--no-fuse``
    export too); about a minute."""
    folders = Folders(root / "hf", root / "paged", root / "unfused", root / "dense")
    save_sample_folder(folders.hf, "llama", SEED, vocab_size=GENAI_VOCAB)
    common = ["--block-size", str(block_size), "--num-blocks", str(num_blocks), "--max-batch-size", str(max_batch)]
    exports = [(folders.paged, [])] + ([(folders.unfused, ["--no-fuse"])] if unfused else [])
    for out, extra in exports:
        if cli.main(["export", str(folders.hf), str(out), *common, "--threads", "1", *extra]) != 0:
            raise RuntimeError(f"pakv-onnx export {folders.hf} {out} failed")
    builder = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(folders.hf)]
    builder += ["-o", str(folders.dense), "-p", "fp32", "-e", "cpu", "-c", str(root / "builder-cache")]
    done = subprocess.run(builder, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"onnxruntime_genai.models.builder failed:\n{done.stderr[-3000:]}")
    return folders


def og_model(folder: Path, *, profile_prefix: str | None = None):
    """``og.Model`` of ``folder`` with 1 intra-op thread and no EOS (``eos_token_id: []``: every
    sequence runs its full length, as transformers' reference does with EOS off)."""
    import onnxruntime_genai as og

    session_options: dict = {"intra_op_num_threads": 1}
    if profile_prefix:
        session_options["enable_profiling"] = profile_prefix
    config = og.Config(str(folder))
    config.overlay(json.dumps({"model": {"eos_token_id": [], "decoder": {"session_options": session_options}}}))
    return og.Model(config)


def decode_generator(model, prompts: np.ndarray, steps: int) -> tuple[list[float], list[list[int]]]:
    """ORT GenAI's ``og.Generator`` over the dense model: one batch of ``prompts`` int32 [B, C]."""
    import onnxruntime_genai as og

    batch, context = prompts.shape
    params = og.GeneratorParams(model)
    params.set_search_options(batch_size=batch, max_length=context + steps + 1, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(prompts)  # the prefill
    generator.generate_next_token()  # picks the prefill's token (the model ran in append_tokens)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        generator.generate_next_token()  # one decode step: the model on the last token, then argmax
        times.append(time.perf_counter() - start)
    return times, [generator.get_sequence(b)[context:].tolist() for b in range(batch)]


def decode_engine(model, prompts: np.ndarray, steps: int) -> tuple[list[float], list[list[int]]]:
    """``og.Engine`` over the paged model: B requests started together; one ``engine.run`` is one step."""
    import onnxruntime_genai as og

    engine = og.Engine(model)
    requests = []  # og closes a request nobody references
    for prompt in prompts:
        request = engine.create_request()
        options = og.TurnOptions(request)
        options.set_do_sample(False)
        options.set_max_generated_tokens(steps + 1)
        request.begin_turn(np.ascontiguousarray(prompt), options)
        requests.append(request)
    events = engine.create_event_buffer(4 * len(requests))
    tokens: list[list[int]] = [[] for _ in requests]
    times = []
    while engine.has_pending_requests():
        start = time.perf_counter()
        done = engine.run(events)
        elapsed = time.perf_counter() - start
        for event in done:
            tokens[next(i for i, r in enumerate(requests) if r == event.request)].append(int(event.token))
        if min(len(t) for t in tokens) >= 2:  # a decode step (the first run was the prefill)
            times.append(elapsed)
    return times, tokens


def paged_session(folder: Path):
    """An ORT session (plugin registered, 1 intra-op thread) over ``folder``'s model.onnx."""
    return check.make_runner_session("plugin:native", folder / "model.onnx", 1)


def decode_paged(
    session, config, prompts: np.ndarray, steps: int, block_size: int
) -> tuple[list[float], list[float], list[list[int]]]:
    """The exported step in ORT driven by the Python host (``step_inputs`` lays each step out, pools
    bound as input and present). Returns ``(ORT run seconds per step, whole step seconds per step
    (layout, binding, run, argmax), tokens)``."""
    batch = prompts.shape[0]
    workload = Workload(prompts.tolist(), [steps + 1] * batch)
    cache = new_cache(config, workload, block_size, SEED)
    ids = list(range(batch))
    for i in ids:
        cache.add_sequence(i)
    runs: list[float] = []

    def step(feeds):
        binding = runtime_plugin.bind(session, feeds, out=present_bindings(feeds))
        start = time.perf_counter()
        session.run_with_iobinding(binding)
        runs.append(time.perf_counter() - start)
        return {"logits": torch.from_numpy(binding.get_outputs()[0].numpy())}

    def advance(chunks):
        counts, _, feeds = step_inputs(cache, ids, chunks)
        chosen = step(feeds)["logits"].argmax(-1).tolist()
        cache.commit(ids, counts, {})  # the pools were written in place
        return chosen

    chosen = advance(workload.prompts)
    tokens = [[t] for t in chosen]
    walls = []
    for _ in range(steps):
        start = time.perf_counter()
        chosen = advance([[t] for t in chosen])
        walls.append(time.perf_counter() - start)
        for row, t in zip(tokens, chosen):
            row.append(t)
    return runs[1:], walls, tokens


def decode_transformers(model, prompts: np.ndarray, steps: int) -> tuple[list[float], list[list[int]]]:
    """transformers eager with its dense ``DynamicCache``: ``model(next_ids, cache=...)`` per step."""
    from transformers import DynamicCache

    times = []
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(prompts).long(), cache=DynamicCache(config=model.config), use_cache=True)
        next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        chosen = [next_ids]
        for _ in range(steps):
            start = time.perf_counter()
            out = model(input_ids=next_ids, cache=out.cache, use_cache=True)
            next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - start)
            chosen.append(next_ids)
    return times, torch.cat(chosen, dim=1).tolist()
