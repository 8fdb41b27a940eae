"""ORT GenAI's own paged model on a CPU: what ``pakv-onnx genai-cpu DIR`` does to a builder folder.

ORT GenAI's model builder writes a paged model (``python -m onnxruntime_genai.models.builder ... -e cuda
--extra_options use_paged_attention=true``) with ``com.microsoft::PagedAttention``, for which ORT has
CUDA and WebGPU kernels only; the builder refuses ``-e cpu`` for it. The plugin library registers that
op for the CPU execution provider, so the same ``model.onnx`` runs under og.Engine on a CPU once
``genai_config.json`` says so. :func:`serve_on_cpu` edits only that file (and copies the library in):

- ``model.decoder.session_options.provider_options`` -> ``[]`` (the CPU execution provider);
- ``model.decoder.session_options.custom_ops_library`` -> the plugin's file name (og resolves it in
  the folder and refuses paths with ``..``: the library is copied there);
- ``engine.dynamic_batching.num_blocks`` -> a fixed pool (og.Engine sizes it from free device memory
  otherwise, which on a CPU dies with ``std::bad_alloc``); ``gpu_utilization_factor`` goes (the
  builder's own rule: the two are mutually exclusive); ``block_size`` and ``max_batch_size`` when
  given.

Nothing here imports onnxruntime_genai; the graph is read without its weights.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import onnx

from pakv_onnx.native_lib import LIBRARY_NAME, library_path

GENAI_CONFIG = "genai_config.json"
# The inputs ORT GenAI's paged convention adds to a decoder (genai_config's model.decoder.inputs).
PAGED_INPUTS = ("block_table", "cumulative_sequence_lengths", "past_sequence_lengths")
ELEMENT_BYTES = {onnx.TensorProto.FLOAT: 4, onnx.TensorProto.FLOAT16: 2, onnx.TensorProto.BFLOAT16: 2,
                 onnx.TensorProto.INT8: 1, onnx.TensorProto.FLOAT8E4M3FN: 1, onnx.TensorProto.UINT8: 1}  # fmt: skip


class NotAGenaiPagedModelError(ValueError):
    """The folder is not an ORT GenAI paged model (the message names what is missing)."""


class MisbuiltModelError(ValueError):
    """The folder's graph is not the model its genai_config.json describes (the message says how it
    differs, the likely cause and the fix)."""


@dataclasses.dataclass(frozen=True)
class CpuServing:
    """What :func:`serve_on_cpu` changed and the pools og.Engine will allocate.

    Attributes:
        changes: ``(genai_config key, before, after)`` per edited entry (``None``: absent).
        layers, kv_heads, head_size, element_type: the pools' geometry and ONNX element type name.
        num_blocks, block_size: the pool og.Engine allocates per layer, for keys and for values.
        pool_bytes: every pool together (layers x 2 x num_blocks x block_size x kv_heads x head_size x
            element size).
    """

    changes: list[tuple[str, object, object]]
    layers: int
    kv_heads: int
    head_size: int
    element_type: str
    num_blocks: int
    block_size: int
    pool_bytes: int


def _refuse(folder: Path, why: str) -> NotAGenaiPagedModelError:
    return NotAGenaiPagedModelError(f"{folder} is not an ORT GenAI paged model: {why}")


def read_paged_config(folder: Path) -> dict:
    """``genai_config.json`` of ``folder``, checked to describe a paged decoder.

    Raises:
        NotAGenaiPagedModelError: no or unreadable config, no decoder, no paged inputs, no
            ``engine.dynamic_batching``.
    """
    path = folder / GENAI_CONFIG
    if not path.is_file():
        raise _refuse(folder, f"no {GENAI_CONFIG}")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise _refuse(folder, f"{GENAI_CONFIG} is not JSON ({err})") from None
    decoder = config.get("model", {}).get("decoder") if isinstance(config, dict) else None
    if not isinstance(decoder, dict):
        raise _refuse(folder, f"{GENAI_CONFIG} has no model.decoder")
    missing = [name for name in PAGED_INPUTS if name not in decoder.get("inputs", {})]
    if missing:
        raise _refuse(folder, f"model.decoder.inputs has no {', '.join(missing)} (built without use_paged_attention?)")
    if not isinstance(config.get("engine", {}).get("dynamic_batching"), dict):
        raise _refuse(folder, f"{GENAI_CONFIG} has no engine.dynamic_batching")
    return config


def paged_pool_type(folder: Path, decoder: dict, graph: onnx.GraphProto | None = None) -> int:
    """The ONNX element type of the model's first key pool, after checking the graph holds a
    ``com.microsoft::PagedAttention`` (``graph``: the decoder's, else read without the weights).

    Raises:
        NotAGenaiPagedModelError: no model file, no such node, or no such pool input.
    """
    graph = graph if graph is not None else load_decoder_graph(folder, decoder)
    name = decoder.get("filename", "model.onnx")
    if not any(n.op_type == "PagedAttention" and n.domain == "com.microsoft" for n in graph.node):
        raise _refuse(folder, f"{name} has no com.microsoft::PagedAttention node")
    key = decoder["inputs"].get("past_key_names", "past_key_values.%d.key") % 0
    pool = next((i for i in graph.input if i.name == key), None)
    if pool is None:
        raise _refuse(folder, f"{name} has no input {key}")
    return pool.type.tensor_type.elem_type


def load_decoder_graph(folder: Path, decoder: dict) -> onnx.GraphProto:
    """The decoder's graph, read without its weights. Raises NotAGenaiPagedModelError: no model file."""
    path = folder / decoder.get("filename", "model.onnx")
    if not path.is_file():
        raise _refuse(folder, f"no model file {path.name}")
    return onnx.load(str(path), load_external_data=False).graph


def check_matches_config(folder: Path, config: dict, graph: onnx.GraphProto) -> None:
    """Check the graph is the model genai_config.json describes: its ``logits`` are as wide as
    ``model.vocab_size`` and are computed from every layer's ``com.microsoft::PagedAttention``.

    ORT GenAI's builder (0.18) finds a checkpoint's LM head by its width: when another Linear is as
    wide as the vocabulary (the sample Llama's MLP at vocab_size = intermediate_size = 256), it
    takes that layer for the LM head and wires ``logits`` to the middle of the first layer; every
    step runs, and the tokens are wrong. Such a folder is refused here.

    Raises:
        MisbuiltModelError: naming the difference, the likely cause and the fix.
    """
    logits_name = config["model"]["decoder"].get("outputs", {}).get("logits", "logits")
    logits = next((o for o in graph.output if o.name == logits_name), None)
    if logits is None:
        raise _refuse(folder, f"its graph has no output {logits_name}")
    vocab = config["model"].get("vocab_size")
    dims = logits.type.tensor_type.shape.dim
    width = dims[-1].dim_value if dims and dims[-1].HasField("dim_value") else None
    if vocab is not None and width is not None and width != int(vocab):
        raise MisbuiltModelError(
            f"{folder} is not the model its {GENAI_CONFIG} describes: its {logits_name} are {width} wide, "
            f"model.vocab_size is {vocab}; rebuild the folder from the Hugging Face model"
        )
    attention = [n.name for n in graph.node if n.op_type == "PagedAttention" and n.domain == "com.microsoft"]
    feeding = _producers_of(graph, logits_name)
    used = [name for name in attention if name in feeding]
    layers = int(config["model"]["decoder"].get("num_hidden_layers", len(attention)))
    if len(used) < layers:
        head = _producer(graph, logits_name)
        reads = f" (its LM head {head.name} reads {head.input[0]})" if head is not None and head.input else ""
        raise MisbuiltModelError(
            f"{folder} is not the model its {GENAI_CONFIG} describes: its {logits_name} are computed from "
            f"{len(used)} of its {layers} layers{reads}. ORT GenAI's builder does this when another layer is "
            f"as wide as the vocabulary ({vocab}): it takes that layer for the LM head. Its tokens would be "
            "wrong; build the folder from a model whose vocab_size differs from every other layer's width "
            "(e.g. intermediate_size)"
        )


def _producer(graph: onnx.GraphProto, name: str) -> onnx.NodeProto | None:
    return next((n for n in graph.node if name in n.output), None)


def _producers_of(graph: onnx.GraphProto, output: str) -> set[str]:
    """Names of the nodes ``output`` depends on (walking back from it through node inputs)."""
    producer = {o: n for n in graph.node for o in n.output if o}
    seen: set[str] = set()
    stack = [output]
    while stack:
        node = producer.get(stack.pop())
        if node is None or node.name in seen:
            continue
        seen.add(node.name)
        stack.extend(i for i in node.input if i)
    return seen


def serve_on_cpu(
    folder: str | os.PathLike,
    *,
    num_blocks: int | None = None,
    block_size: int | None = None,
    max_batch_size: int | None = None,
    before_writing: Callable[[], None] = lambda: None,
) -> CpuServing:
    """Edit ``folder``'s genai_config.json so og.Engine serves its paged model on the CPU with the
    plugin (see the module docstring) and copy the plugin library in. ``num_blocks`` (default: one
    request at the model's whole context, ``ceil(context_length / block_size)``), ``block_size``
    and ``max_batch_size`` (default: the builder's) go into ``engine.dynamic_batching``. Running it
    again on the folder changes only what differs. ``before_writing`` is called after every check
    and before the first write (the command line's last safe point); each file is replaced whole
    (written beside it, then renamed over it).

    Raises:
        NotAGenaiPagedModelError: :func:`read_paged_config`, :func:`paged_pool_type`.
        MisbuiltModelError: :func:`check_matches_config`.
        ValueError: a count below 1.
    """
    folder = Path(folder)
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("max_batch_size", max_batch_size)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    config = read_paged_config(folder)
    decoder = config["model"]["decoder"]
    graph = load_decoder_graph(folder, decoder)
    element = paged_pool_type(folder, decoder, graph)
    check_matches_config(folder, config, graph)
    del graph
    batching = config["engine"]["dynamic_batching"]
    changes: list[tuple[str, object, object]] = []

    def put(where: dict, key: str, value: object, label: str) -> None:
        if where.get(key) != value:
            changes.append((label, where.get(key), value))
            where[key] = value

    options = decoder.setdefault("session_options", {})
    put(options, "provider_options", [], "model.decoder.session_options.provider_options")
    put(options, "custom_ops_library", LIBRARY_NAME, "model.decoder.session_options.custom_ops_library")
    block_size = block_size or int(batching.get("block_size", 16))
    put(batching, "block_size", block_size, "engine.dynamic_batching.block_size")
    context = int(config["model"].get("context_length", 4096))
    put(batching, "num_blocks", num_blocks or batching.get("num_blocks") or math.ceil(context / block_size),
        "engine.dynamic_batching.num_blocks")  # fmt: skip
    if max_batch_size is not None:
        put(batching, "max_batch_size", max_batch_size, "engine.dynamic_batching.max_batch_size")
    if "gpu_utilization_factor" in batching:
        changes.append(("engine.dynamic_batching.gpu_utilization_factor", batching.pop("gpu_utilization_factor"), None))
    before_writing()
    _replace(folder / LIBRARY_NAME, lambda path: shutil.copyfile(library_path(), path))
    _replace(folder / GENAI_CONFIG, lambda path: path.write_text(json.dumps(config, indent=4) + "\n"))
    layers, kv_heads, head_size = (int(decoder[k]) for k in ("num_hidden_layers", "num_key_value_heads", "head_size"))
    pool_bytes = layers * 2 * batching["num_blocks"] * block_size * kv_heads * head_size * ELEMENT_BYTES.get(element, 4)
    return CpuServing(changes, layers, kv_heads, head_size, onnx.TensorProto.DataType.Name(element).lower(),
                      batching["num_blocks"], block_size, pool_bytes)  # fmt: skip


def _replace(path: Path, write: Callable[[Path], object]) -> None:
    """Write ``path`` whole: ``write`` a file beside it, then rename it over ``path``."""
    partial = path.with_name(f".{path.name}.partial")
    try:
        write(partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def describe(folder: Path, done: CpuServing) -> str:
    """What changed and the pools it implies, as ``pakv-onnx genai-cpu`` prints it."""
    lines = [f"{folder / GENAI_CONFIG}: ORT GenAI paged model, served on the CPU with {LIBRARY_NAME}"]
    for key, before, after in done.changes:
        shown = "(removed: num_blocks pins the pool)" if after is None else json.dumps(after)
        lines.append(f"  {key}: {'(absent)' if before is None else json.dumps(before)} -> {shown}")
    if not done.changes:
        lines.append("  (already set: nothing changed)")
    lines.append(
        f"pools: {done.layers} layers x key and value x {done.num_blocks} blocks x {done.block_size} tokens x "
        f"{done.kv_heads} heads x {done.head_size} {done.element_type} = {done.pool_bytes / 2**20:.1f} MiB "
        f"({done.num_blocks * done.block_size} tokens in all)"
    )
    lines.append(f"serve it: og.Engine(og.Model({str(folder)!r}))")
    return "\n".join(lines)
