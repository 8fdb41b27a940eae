"""The decode variants the GenAI benchmarks compare, all built offline from one ``save_pretrained`` folder.

- :func:`write_folders`: a Llama with seeded weights at one of :data:`SIZES` and a word-level
  tokenizer; ``pakv-onnx export`` of it (each layer one com.microsoft::PagedAttention; optionally
  ``--no-fuse``, ``--attention pakv``, ``--kv-cache int8|fp8``); ORT GenAI's dense CPU model of the
  same folder (``python -m onnxruntime_genai.models.builder -p fp32 -e cpu``).
- Hosts: og.Generator over the dense model and og.Engine over the paged one (each its own C++ host;
  og.Engine with prefix caching off), and one plain-onnxruntime host for both graphs
  (:class:`DenseRun`, :class:`PagedRun`: numpy, pools bound as input and present, the ORT run timed
  alone), so the graphs are compared under one host. Each run: a prefill (timed: the first token),
  then ``steps`` greedy decode steps, each timed alone; ``(prefill seconds, seconds per step,
  tokens [B][steps + 1])`` (the prefill's token first). ``clock``: ``time.perf_counter`` (wall) or
  ``time.thread_time`` (the calling thread's CPU time: with 1 intra-op thread every host here runs
  the model on the calling thread, so other processes' load drops out).

onnxruntime_genai is imported inside the functions that use it.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Callable
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
# The Llamas the benchmarks build: the sample (2 layers, hidden 128, 4/2 heads x 32) and a mid-size one.
SIZES = {
    "tiny": {"vocab_size": GENAI_VOCAB},
    "mid": {
        "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 4096,
    },
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Folders:
    hf: Path  # save_pretrained + tokenizer files
    paged: Path  # pakv-onnx export (each layer one com.microsoft::PagedAttention, fused)
    unfused: Path  # pakv-onnx export --no-fuse
    dense: Path  # ORT GenAI's builder, -p fp32 -e cpu
    extra: dict = dataclasses.field(default_factory=dict)  # name -> pakv-onnx export with other options


def write_folders(
    root: Path,
    block_size: int,
    num_blocks: int,
    max_batch: int,
    unfused: bool = True,
    *,
    size: str = "tiny",
    extra: dict[str, list[str]] | None = None,
) -> Folders:
    """Write every variant's model folder under ``root`` (a temp dir): the Llama of ``size``, its
    export (``unfused``: the ``--no-fuse`` export too; ``extra``: name -> more ``pakv-onnx export``
    arguments, e.g. ``{"int8": ["--kv-cache", "int8"]}``) and GenAI's dense model; a minute or more."""
    extra = extra or {}
    folders = Folders(root / "hf", root / "paged", root / "unfused", root / "dense", {k: root / k for k in extra})
    save_sample_folder(folders.hf, "llama", SEED, **SIZES[size])
    common = ["--block-size", str(block_size), "--num-blocks", str(num_blocks), "--max-batch-size", str(max_batch)]
    exports = [(folders.paged, [])] + ([(folders.unfused, ["--no-fuse"])] if unfused else [])
    exports += [(folders.extra[name], args) for name, args in extra.items()]
    for out, extra_args in exports:
        if cli.main(["export", str(folders.hf), str(out), *common, "--threads", "1", *extra_args]) != 0:
            raise RuntimeError(f"pakv-onnx export {folders.hf} {out} failed")
    builder = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(folders.hf)]
    builder += ["-o", str(folders.dense), "-p", "fp32", "-e", "cpu", "-c", str(root / "builder-cache")]
    done = subprocess.run(builder, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"onnxruntime_genai.models.builder failed:\n{done.stderr[-3000:]}")
    return folders


def write_genai_paged_fp16(hf: Path, out: Path, block_size: int, num_blocks: int, max_batch: int) -> Path:
    """ORT GenAI's own paged model of ``hf`` (builder ``-p fp16 -e cuda``, ``use_paged_attention=true``)
    made to run on the CPU by ``pakv-onnx genai-cpu``."""
    builder = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out), "-p", "fp16",
               "-e", "cuda", "-c", str(out.parent / "builder-cache-fp16"),
               "--extra_options", "use_paged_attention=true"]
    done = subprocess.run(builder, capture_output=True, text=True, check=False)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"onnxruntime_genai.models.builder (paged fp16) failed:\n{done.stderr[-3000:]}")
    args = ["genai-cpu", str(out), "--num-blocks", str(num_blocks), "--block-size", str(block_size)]
    if cli.main([*args, "--max-batch-size", str(max_batch)]) != 0:
        raise RuntimeError(f"pakv-onnx genai-cpu {out} failed")
    return out


def without_attention(folder: Path, out: Path) -> Path:
    """``folder``'s model with each attention node (``com.microsoft`` PagedAttention or GroupQueryAttention)
    replaced by next to nothing: its output the first ``num_heads x head_size`` columns of its packed query
    (a ``Slice``), its cache outputs its cache inputs (``Identity``: the hosts bind both to one buffer, so
    nothing is copied). A step of this twin takes the model's time less its attention calls (tokens mean
    nothing), so the difference is what those calls cost as the model runs them, other nodes evicting
    caches between them: what a one-node session of the op cannot show. Weights are hard-linked, not copied."""
    import os
    import shutil

    import onnx
    from onnx import helper, numpy_helper

    out.mkdir(parents=True, exist_ok=True)
    for item in folder.iterdir():
        if item.name != "model.onnx" and not (out / item.name).exists():
            try:
                os.link(item, out / item.name)  # ORT refuses external data outside the model's folder: no symlink
            except OSError:
                shutil.copy2(item, out / item.name)
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    head_size = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]["head_size"]
    graph, nodes = model.graph, []
    for node in graph.node:
        if node.domain != "com.microsoft" or node.op_type not in ("PagedAttention", "GroupQueryAttention"):
            nodes.append(node)
            continue
        heads = next(a.i for a in node.attribute if a.name == "num_heads")
        columns = [numpy_helper.from_array(np.array([v], np.int64), f"{node.name}/bare/{k}")
                   for k, v in (("start", 0), ("end", heads * head_size), ("axis", -1))]  # fmt: skip
        graph.initializer.extend(columns)
        nodes.append(helper.make_node("Slice", [node.input[0], *(c.name for c in columns)], [node.output[0]]))
        nodes += [helper.make_node("Identity", [cache], [present])
                  for cache, present in zip(node.input[3:5], node.output[1:3]) if present]  # fmt: skip
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.save(model, str(out / "model.onnx"))
    return out


def og_model(folder: Path, *, threads: int = 1, profile_prefix: str | None = None):
    """``og.Model`` of ``folder`` with ``threads`` intra-op threads, no EOS (``eos_token_id: []``:
    every sequence runs its full length, as transformers' reference does with EOS off) and, for a
    paged folder, og.Engine's prefix caching off (0.18 turns it on for paged models: a repeated
    prompt would skip its prefill)."""
    import onnxruntime_genai as og

    session_options: dict = {"intra_op_num_threads": threads}
    if profile_prefix:
        session_options["enable_profiling"] = profile_prefix
    overlay: dict = {"model": {"eos_token_id": [], "decoder": {"session_options": session_options}}}
    if "dynamic_batching" in json.loads((folder / "genai_config.json").read_text()).get("engine", {}):
        overlay["engine"] = {"dynamic_batching": {"prefix_caching": False}}
    config = og.Config(str(folder))
    config.overlay(json.dumps(overlay))
    return og.Model(config)


Clock = Callable[[], float]


def run_generator(model, prompts: np.ndarray, steps: int, clock: Clock = time.perf_counter):
    """ORT GenAI's ``og.Generator`` over the dense model: one batch of ``prompts`` int32 [B, C].
    Prefill: ``append_tokens`` (the model runs there) and the first ``generate_next_token`` (picks its
    token); each decode step: one ``generate_next_token`` (the model on the last token, then argmax;
    ``get_logits`` is never called: it is lazy in og.Generator and would run the next step)."""
    import onnxruntime_genai as og

    batch, context = prompts.shape
    params = og.GeneratorParams(model)
    params.set_search_options(batch_size=batch, max_length=context + steps + 1, do_sample=False)
    generator = og.Generator(model, params)
    start = clock()
    generator.append_tokens(prompts)
    generator.generate_next_token()
    prefill = clock() - start
    times = []
    for _ in range(steps):
        start = clock()
        generator.generate_next_token()
        times.append(clock() - start)
    return prefill, times, [generator.get_sequence(b)[context:].tolist() for b in range(batch)]


def run_engine(model, prompts: np.ndarray, steps: int, clock: Clock = time.perf_counter):
    """``og.Engine`` over the paged model: B requests started together. Prefill: every ``engine.run``
    until each request has its first token (og.Engine may split prefills over several runs, so the
    requests start decoding at different runs); decode: the first ``steps`` runs after that in which
    every request emits a token (each request gets room for more tokens than that, so none has
    finished yet). Tokens: each request's first ``steps + 1``."""
    import onnxruntime_genai as og

    engine = og.Engine(model)
    requests = []  # og closes a request nobody references
    budget = 2 * steps + 2 + len(prompts)
    for prompt in prompts:
        request = engine.create_request()
        options = og.TurnOptions(request)
        options.set_do_sample(False)
        options.set_max_generated_tokens(budget)
        options.set_min_generated_tokens(budget)
        request.begin_turn(np.ascontiguousarray(prompt), options)
        requests.append(request)
    events = engine.create_event_buffer(4 * len(requests))
    tokens: list[list[int]] = [[] for _ in requests]
    prefill, times = 0.0, []
    while engine.has_pending_requests() and len(times) < steps:
        start = clock()
        done = engine.run(events)
        elapsed = clock() - start
        decoding = min(len(t) for t in tokens) >= 1
        for event in done:
            tokens[next(i for i, r in enumerate(requests) if r == event.request)].append(int(event.token))
        if not decoding:
            prefill += elapsed
        elif len(done) == len(requests):
            times.append(elapsed)
    if len(times) < steps:
        raise RuntimeError(f"og.Engine ran {len(times)} steps with every request, not {steps}")
    return prefill, times, [t[: steps + 1] for t in tokens]


def decode_generator(model, prompts: np.ndarray, steps: int) -> tuple[list[float], list[list[int]]]:
    """:func:`run_generator`'s decode steps and tokens (wall clock)."""
    return run_generator(model, prompts, steps)[1:]


def decode_engine(model, prompts: np.ndarray, steps: int) -> tuple[list[float], list[list[int]]]:
    """:func:`run_engine`'s decode steps and tokens (wall clock)."""
    return run_engine(model, prompts, steps)[1:]


def plain_session(path: Path, threads: int, plugin: bool):
    """A plain onnxruntime session (the plugin registered by path when ``plugin``), ``threads`` intra-op
    threads that do not spin between runs."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if plugin:
        options.register_custom_ops_library(runtime_plugin.library_path())
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class _PlainRun:
    """A plain-onnxruntime host over one graph: pools bound as input and present output (one
    OrtValue each), ``logits`` bound first, an IOBinding built per step as a host does."""

    def __init__(self, folder: Path, threads: int, plugin: bool) -> None:
        self.folder = folder
        self.session = plain_session(folder / "model.onnx", threads, plugin)
        self.config = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
        self.pools: dict[str, object] = {}

    def pool_inputs(self) -> list:
        return [i for i in self.session.get_inputs() if i.name.startswith("past_key_values.")]

    def step(self, feeds: dict[str, np.ndarray], clock: Clock) -> tuple[float, np.ndarray]:
        """``(seconds of the ORT run, logits)`` of one step over ``feeds`` and the pools."""
        binding = self.session.io_binding()
        binding.bind_output("logits")
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        for name, pool in self.pools.items():
            binding.bind_ortvalue_input(name, pool)
            binding.bind_ortvalue_output(name.replace("past_key_values.", "present."), pool)
        start = clock()
        self.session.run_with_iobinding(binding)
        elapsed = clock() - start
        return elapsed, binding.get_outputs()[0].numpy()


class DenseRun(_PlainRun):
    """GenAI's dense graph (GroupQueryAttention; past and present share one ``[B, Hk, max, D]``
    buffer per pool, ``attention_mask`` ones over the total length) under the plain host."""

    def __init__(self, folder: Path, threads: int) -> None:
        super().__init__(folder, threads, plugin=False)

    def run(self, prompts: np.ndarray, steps: int, clock: Clock = time.perf_counter):
        import onnxruntime as ort

        batch, context = prompts.shape
        shape = (batch, self.config["num_key_value_heads"], context + steps + 1, self.config["head_size"])
        self.pools = {i.name: ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32)) for i in self.pool_inputs()}
        ids, total, times, chosen = prompts.astype(np.int64), context, [], []
        prefill = 0.0
        for step in range(steps + 1):
            elapsed, logits = self.step({"input_ids": ids, "attention_mask": np.ones((batch, total), np.int64)}, clock)
            token = logits[:, -1].argmax(-1)
            chosen.append(token)
            if step:
                times.append(elapsed)
            else:
                prefill = elapsed
            ids, total = token[:, None].astype(np.int64), total + 1
        return prefill, times, np.stack(chosen, 1).tolist()


class PagedRun(_PlainRun):
    """The paged graph (pools ``[nb, bs, Hk, D]`` in the graph's element type, each sequence's blocks
    in its block-table row) under the plain host."""

    POOL_TYPES = {
        "tensor(float)": (np.float32, 1), "tensor(int8)": (np.int8, 3), "tensor(float8e4m3fn)": (np.uint8, 17),
        "tensor(float16)": (np.float16, 10), "tensor(bfloat16)": (np.uint16, 16),
    }  # fmt: skip

    def __init__(self, folder: Path, threads: int) -> None:
        super().__init__(folder, threads, plugin=True)

    def bytes_per_token(self) -> int:
        """Pool bytes one token takes in one layer (its key and value rows)."""
        _, _, heads, dim = self.pool_inputs()[0].shape
        return 2 * heads * dim * np.dtype(self.POOL_TYPES[self.pool_inputs()[0].type][0]).itemsize

    def run(self, prompts: np.ndarray, steps: int, clock: Clock = time.perf_counter):
        import onnxruntime as ort

        batch, context = prompts.shape
        _, block_size, heads, dim = self.pool_inputs()[0].shape
        per_sequence = -(-(context + steps + 1) // block_size)
        numpy_type, onnx_type = self.POOL_TYPES[self.pool_inputs()[0].type]
        shape = (batch * per_sequence, block_size, heads, dim)
        self.pools = {
            i.name: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np.zeros(shape, numpy_type), onnx_type)
            for i in self.pool_inputs()
        }
        table = np.arange(batch * per_sequence, dtype=np.int32).reshape(batch, per_sequence)
        ids, past, times, chosen = prompts.reshape(-1).astype(np.int64), 0, [], []
        prefill = 0.0
        for step in range(steps + 1):
            new = len(ids) // batch
            feeds = {"input_ids": ids, "cumulative_sequence_lengths": (np.arange(batch + 1) * new).astype(np.int32),
                     "past_sequence_lengths": np.full(batch, past, np.int32), "block_table": table}  # fmt: skip
            elapsed, logits = self.step(feeds, clock)
            token = logits.argmax(-1)
            chosen.append(token)
            if step:
                times.append(elapsed)
            else:
                prefill = elapsed
            ids, past = token.astype(np.int64), past + new
        return prefill, times, np.stack(chosen, 1).tolist()


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
