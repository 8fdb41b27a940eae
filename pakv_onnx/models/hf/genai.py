"""A Hugging Face model folder -> an ORT GenAI model folder that og.Engine serves with continuous
batching: what ``pakv-onnx export`` runs.

The folder holds ``model.onnx`` (the paged step of :mod:`~pakv_onnx.models.hf.step`: packed
``input_ids``, ``past_key_values.<l>.*`` pools bound to their ``present.<l>.*`` outputs, the write
and the read of every layer inside the graph; ``model.onnx.data`` beside it when the weights are
large), ``genai_config.json`` (``engine.dynamic_batching``, the ``paged_kv`` state group, and
``session_options.custom_ops_library`` naming the plugin), the plugin library copied next to it,
and the tokenizer files of the source folder when it has them. For ``execution_provider="cuda"`` the
session options name ORT's CUDA provider instead and no library is copied: the same model.onnx runs
with ORT's own CUDA kernel of com.microsoft::PagedAttention (:mod:`pakv_onnx.providers`). Nothing here imports
onnxruntime_genai, and nothing is fetched from a hub (``local_files_only``).

The export is one pass, one file per stage, each entered once (tests/test_hf_export_walk.py): the
config (:func:`~pakv_onnx.models.hf.servable.judge_export`: the form, og.Engine's pools, the provider's
limits; every refusal before a weight is read) -> the pools' geometry
(:func:`~pakv_onnx.models.hf.configs.cache_geometry`) -> the attention replacement
(:func:`~pakv_onnx.models.hf.forms.prepare_attention`) -> the step and its export
(:mod:`~pakv_onnx.models.hf.step`) -> the folder (here).

What og.Engine needs that its documentation does not say (0.18.0 on a CPU) is listed in
docs/decoders.md ("Serve it with ORT GenAI").
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import onnx
import torch

from pakv_onnx import providers
from pakv_onnx.export import cap_ir_version
from pakv_onnx.models.hf.cache import PAST_KEY, PAST_VALUE, PRESENT_KEY, PRESENT_VALUE
from pakv_onnx.models.hf.forms import prepare_attention
from pakv_onnx.models.hf.kwargs import ORT
from pakv_onnx.models.hf.servable import UnsupportedModelError, check_servable, judge_export
from pakv_onnx.models.hf.step import PagedDecoderStep, export_step, trace_feeds
from pakv_onnx.native_lib import LIBRARY_NAME, library_path

MODEL_FILE = "model.onnx"
GENAI_CONFIG = "genai_config.json"
# Written beside model.onnx when the weights exceed EXTERNAL_DATA_BYTES (protobuf stops at 2 GB).
EXTERNAL_DATA_FILE = "model.onnx.data"
EXTERNAL_DATA_BYTES = 1 << 30
# Copied from the source folder when present (og.Tokenizer reads them; og.Engine itself does not).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)
# genai_config's provider_options entry for ORT's CUDA provider: what ORT GenAI's own builder writes for a
# paged model (onnxruntime-genai 0.18, `-e cuda --extra_options use_paged_attention=true`).
CUDA_PROVIDER_OPTIONS = {"cuda": {"enable_cuda_graph": "0"}}
# genai_config's model.type: the generic decoder-only type og accepts for any such graph.
GENAI_MODEL_TYPE = "decoder"


@dataclasses.dataclass(frozen=True)
class GenaiExport:
    """What :func:`export_genai` wrote."""

    out_dir: Path
    files: list[str]  # written or copied, relative to out_dir
    config: dict
    seconds: float
    external_data: bool
    attention: str = ORT  # the step's form (PagedDecoderStep.attention: "ort", "fused" or "gather")
    kv_quant: object | None = None  # the quantized cache's KvQuant, or None (pools of the precision's T)
    precision: str = providers.DEFAULT_PRECISION
    execution_provider: str = providers.CPU


def load_hf_config(hf_dir: str | os.PathLike):
    """``AutoConfig.from_pretrained`` of a local folder: the model's config without its weights."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(os.fspath(hf_dir), local_files_only=True)


def load_hf_model(hf_dir: str | os.PathLike) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` of a local folder (config + weights), fp32, eval; never
    fetches anything (``local_files_only``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.fspath(hf_dir), local_files_only=True, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def session_options(execution_provider: str, intra_op_threads: int | None = None) -> dict:
    """genai_config's ``model.decoder.session_options`` for ``execution_provider``: the CPU with this
    library as ``custom_ops_library`` (its kernel of com.microsoft::PagedAttention), or ORT's CUDA
    provider, whose own kernel runs the op (no library)."""
    if execution_provider == providers.CPU:
        options: dict = {"log_id": "onnxruntime-genai", "provider_options": [], "custom_ops_library": LIBRARY_NAME}
    elif execution_provider == providers.CUDA:
        options = {"log_id": "onnxruntime-genai", "provider_options": [CUDA_PROVIDER_OPTIONS]}
    else:
        raise UnsupportedModelError(
            f"--execution-provider {execution_provider!r} is unknown (choices: {', '.join(providers.EXECUTION_PROVIDERS)})"
        )
    if intra_op_threads:
        options["intra_op_num_threads"] = intra_op_threads
    return options


def genai_config(
    config,
    *,
    block_size: int,
    num_blocks: int,
    max_batch_size: int,
    intra_op_threads: int | None = None,
    attention: str = ORT,
    prefix_caching: bool | None = None,
    execution_provider: str = providers.CPU,
    pool_shape: tuple[int, int] | None = None,
) -> dict:
    """The genai_config.json of the exported step of ``config`` (a transformers config) in the
    ``attention`` form for ``execution_provider`` (:func:`session_options`: the one difference between
    two providers' folders). ``prefix_caching``: og.Engine's ``engine.dynamic_batching.prefix_caching``
    (None: left out, og.Engine 0.18's default, on for paged models). ``pool_shape``: ``(num_key_value_heads,
    head_size)`` of every pool as :func:`~pakv_onnx.models.hf.servable.judge_export` found it (default:
    :func:`~pakv_onnx.models.hf.servable.check_servable` of ``config``)."""
    kv_heads, head_size = pool_shape or check_servable(config, attention)
    layers = config.num_hidden_layers
    context = int(getattr(config, "max_position_embeddings", 0) or 4096)
    options = session_options(execution_provider, intra_op_threads)
    batching = {"block_size": block_size, "num_blocks": num_blocks, "max_batch_size": max_batch_size}
    if prefix_caching is not None:
        batching["prefix_caching"] = bool(prefix_caching)

    def token_id(name: str, default: int | None) -> int | list[int] | None:
        value = getattr(config, name, None)
        return default if value is None else value

    return {
        "model": {
            "type": GENAI_MODEL_TYPE,
            "bos_token_id": token_id("bos_token_id", 0),
            "eos_token_id": token_id("eos_token_id", 0),
            "pad_token_id": token_id("pad_token_id", token_id("eos_token_id", 0)),
            "vocab_size": config.vocab_size,
            "context_length": context,
            "decoder": {
                "session_options": options,
                "filename": MODEL_FILE,
                "head_size": head_size,
                "hidden_size": config.hidden_size,
                "num_attention_heads": config.num_attention_heads,
                "num_hidden_layers": layers,
                "num_key_value_heads": kv_heads,
                "inputs": {
                    "input_ids": "input_ids",
                    "block_table": "block_table",
                    "cumulative_sequence_lengths": "cumulative_sequence_lengths",
                    "past_sequence_lengths": "past_sequence_lengths",
                    "past_key_names": PAST_KEY.replace("{}", "%d"),
                    "past_value_names": PAST_VALUE.replace("{}", "%d"),
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": PRESENT_KEY.replace("{}", "%d"),
                    "present_value_names": PRESENT_VALUE.replace("{}", "%d"),
                },
                "state_groups": [{"kind": "paged_kv", "layer_ids": list(range(layers))}],
            },
        },
        "search": {"max_length": context, "do_sample": False, "num_beams": 1},
        "engine": {"dynamic_batching": batching},
    }


def export_genai(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    block_size: int = 16,
    num_blocks: int = 256,
    max_batch_size: int = 16,
    intra_op_threads: int | None = None,
    external_data: bool | None = None,
    fuse: bool = True,
    attention: str | None = None,
    kv_cache: str | None = None,
    prefix_caching: bool | None = None,
    precision: str = providers.DEFAULT_PRECISION,
    execution_provider: str = providers.CPU,
    progress: Callable[[str], None] = lambda message: None,
) -> GenaiExport:
    """Export the Hugging Face model in ``hf_dir`` to an ORT GenAI model folder ``out_dir`` (see the
    module docstring). ``external_data``: weights in ``model.onnx.data`` (default: when above
    :data:`EXTERNAL_DATA_BYTES`). ``fuse``: the graph-level fusions of
    :func:`~pakv_onnx.models.hf.fusion.fuse_step` (default on). ``attention``: ``ort`` (each layer one
    com.microsoft::PagedAttention; the default where served) or ``pakv``
    (:func:`~pakv_onnx.models.hf.servable.resolve_attention`).
    ``kv_cache``: ``int8`` or ``fp8`` pools (``ort`` only), their per-channel scales calibrated on
    the model (:func:`~pakv_onnx.models.hf.kv_quant.calibrate`). ``prefix_caching``: written into
    ``engine.dynamic_batching`` (None: og.Engine's default). ``precision``: a name of
    :data:`pakv_onnx.providers.PRECISIONS`. ``execution_provider``: ``cpu`` or ``cuda``, the one thing
    genai_config.json changes (the same model.onnx either way; ``cuda`` checked against
    :data:`pakv_onnx.providers.CUDA_LIMITS`, and no library copied).

    Raises:
        UnsupportedModelError: og.Engine cannot serve the model, or it cannot be exported in ``precision``
            or run on ``execution_provider`` (:func:`~pakv_onnx.models.hf.servable.judge_export`); raised
            before anything is written.
        OSError: the source folder cannot be read or ``out_dir`` written.
    """
    start = time.perf_counter()
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    # config -> geometry: every refusal the config allows, before the weights are read
    hf_config = load_hf_config(hf_dir)
    judged = judge_export(hf_config, attention=attention, precision=precision, block_size=block_size,
                          kv_cache=kv_cache, execution_provider=execution_provider)  # fmt: skip
    config = genai_config(
        hf_config,
        block_size=block_size,
        num_blocks=num_blocks,
        max_batch_size=max_batch_size,
        intra_op_threads=intra_op_threads,
        attention=judged.attention,
        prefix_caching=prefix_caching,
        execution_provider=execution_provider,
        pool_shape=judged.pool_shape,
    )
    progress(f"loading {hf_dir} ...")
    model = load_hf_model(hf_dir)
    kv_quant = None
    if kv_cache is not None:
        from pakv_onnx.models.hf.kv_quant import calibrate

        progress(f"calibrating {kv_cache} cache scales ...")
        kv_quant = calibrate(model, kv_cache, block_size=block_size)  # on the float32 model
    # attention replacement -> step
    prepared = prepare_attention(model, judged.attention, kv_quant, precision, judged=True)
    if prepared.rotary is not None:  # the exact rotary span: the step's own table
        exact = dataclasses.replace(judged.target, rotary_dim=2 * prepared.rotary[0].shape[1])
        refusal = providers.export_refusal(exact, execution_provider)
        if refusal:
            raise UnsupportedModelError(refusal)
    step = PagedDecoderStep(prepared)
    weight_bytes = sum(p.numel() * p.element_size() for p in step.parameters())
    progress(f"exporting one paged step in {precision} ({weight_bytes / 1e6:.1f} MB of weights) ...")
    proto = cap_ir_version(export_step(step, trace_feeds(step, block_size, judged.geometry), None, fuse=fuse))
    # the folder
    out_dir.mkdir(parents=True, exist_ok=True)
    external = weight_bytes > EXTERNAL_DATA_BYTES if external_data is None else external_data
    files = [MODEL_FILE]
    for stale in (out_dir / MODEL_FILE, out_dir / EXTERNAL_DATA_FILE):
        stale.unlink(missing_ok=True)
    if external:
        onnx.save_model(
            proto, str(out_dir / MODEL_FILE), save_as_external_data=True, all_tensors_to_one_file=True,
            location=EXTERNAL_DATA_FILE, size_threshold=1024,
        )  # fmt: skip
        files.append(EXTERNAL_DATA_FILE)
    else:
        onnx.save_model(proto, str(out_dir / MODEL_FILE))
    if execution_provider == providers.CPU:  # ORT's CUDA provider runs the op with its own kernel
        shutil.copyfile(library_path(), out_dir / LIBRARY_NAME)
        files.append(LIBRARY_NAME)
    for name in TOKENIZER_FILES:
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, out_dir / name)
            files.append(name)
    (out_dir / GENAI_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    files.append(GENAI_CONFIG)
    seconds = time.perf_counter() - start
    return GenaiExport(out_dir, files, config, seconds, external, step.attention, kv_quant, precision, execution_provider)
