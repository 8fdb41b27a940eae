"""``pakv-onnx export HF_DIR OUT_DIR``: a Hugging Face model folder -> an ORT GenAI paged model folder.

Everything the command line can check is checked before torch is imported or a weight is read
(:func:`pakv_onnx.commands._args.path_problem`): HF_DIR holds a config and weights, and OUT_DIR is
new or empty (``--force``: a folder with files in it, whose files of the export's names are
replaced; others are left). The export is written to a staging folder and published at the end
(:mod:`pakv_onnx.commands._outputs`): an interrupted export leaves nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pakv_onnx.commands import _args, _libraries, _outputs, _report

ATTENTION_CHOICES = ("ort", "pakv")  # models.hf.step.ATTENTION_CHOICES (a test ties them)
KV_CACHE_CHOICES = ("int8", "fp8")  # models.hf.ort_layer.KV_CACHE_DTYPES (a test ties them)
ATTENTION_LABELS = {
    "ort": "each layer one com.microsoft::PagedAttention (rotary, the cache write and attention)",
    "fused": "pakv::ScatterPaKvCache + pakv::PagedAttention per layer",
    "gather": "pakv::ScatterPaKvCache + pakv::GatherPaKvCache per layer (MLA, absorbed)",
}
CALIBRATION_PROMPTS, CALIBRATION_TOKENS = 8, 128  # models.hf.kv_quant's (a test ties them)
# The weight files AutoModelForCausalLM.from_pretrained reads from a local folder (one of them).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def source_problem(hf_dir: Path) -> str | None:
    """What ``hf_dir`` (a folder) lacks to be a model folder the export can load (``None``: nothing)."""
    if not (hf_dir / "config.json").is_file():
        return "no config.json (want a Hugging Face model folder, as save_pretrained writes it)"
    if not any((hf_dir / name).is_file() for name in WEIGHT_FILES):
        return f"no weights (none of {', '.join(WEIGHT_FILES)}; nothing is downloaded)"
    return None


def options_problem(args: argparse.Namespace) -> str | None:
    """Why the options alone cannot make a folder (a precision the form is not exported in, a ``cuda``
    folder ORT's CUDA kernel cannot run: :func:`pakv_onnx.providers.export_refusal`), before anything
    is loaded; what needs the model's config is checked when it is read."""
    from pakv_onnx import providers  # light: no torch

    target = providers.ExportTarget(args.precision, args.attention, args.block_size, args.kv_cache)
    return providers.export_refusal(target, args.execution_provider)


def run(args: argparse.Namespace) -> int:
    problem = options_problem(args)  # before anything is imported or written
    if problem:
        return _args.usage_error("export", problem)
    try:  # HF_DIR and OUT_DIR were checked before (cli.main: _args.path_problem)
        genai = _libraries.load_hf("genai")
    except ImportError as err:
        return _args.usage_error("export", str(err))

    try:
        with _outputs.staged_folder(args.out_dir, replace=(genai.MODEL_FILE, genai.EXTERNAL_DATA_FILE)) as staging:
            done = genai.export_genai(
                args.hf_dir,
                staging,
                block_size=args.block_size,
                num_blocks=args.num_blocks,
                max_batch_size=args.max_batch_size,
                intra_op_threads=args.threads,
                external_data=True if args.external_data else None,
                fuse=not args.no_fuse,
                attention=args.attention,
                kv_cache=args.kv_cache,
                prefix_caching=None if args.prefix_caching is None else args.prefix_caching == "on",
                precision=args.precision,
                execution_provider=args.execution_provider,
                progress=_report.progress,
            )
    except genai.UnsupportedModelError as err:
        return _args.usage_error("export", str(err))
    batching = done.config["engine"]["dynamic_batching"]
    print(f"wrote {args.out_dir} in {done.seconds:.1f}s: {', '.join(done.files)}")
    print(f"attention: {ATTENTION_LABELS[done.attention]}" + (
        f"; KV cache {done.kv_quant.kind} (per-channel scales calibrated on {CALIBRATION_PROMPTS} prompts of "
        f"{CALIBRATION_TOKENS} random tokens)" if done.kv_quant else ""))  # fmt: skip
    options = done.config["model"]["decoder"]["session_options"]
    runs_on = (
        f"the CPU, custom_ops_library {options['custom_ops_library']}"
        if "custom_ops_library" in options
        else "ORT's CUDA provider (its own com.microsoft::PagedAttention kernel)"
    )
    print(
        f"paged: block_size {batching['block_size']}, num_blocks {batching['num_blocks']}, "
        f"max_batch_size {batching['max_batch_size']}; precision {done.precision}; runs on {runs_on}"
    )
    print(f"serve it: og.Engine(og.Model({str(args.out_dir)!r}))  (pip install 'pakv-onnx[genai]')")
    print(f"or over HTTP: pakv-onnx serve {args.out_dir}  (OpenAI API; pip install 'pakv-onnx[serve]')")
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = _args.add_command(
        commands,
        "export",
        help="a Hugging Face model folder -> an ORT GenAI model folder og.Engine serves (paged, continuous batching)",
        description=(
            "Load the transformers causal LM in HF_DIR (config + weights as save_pretrained writes them; "
            "nothing is downloaded) and write an ORT GenAI model folder to OUT_DIR (new or empty; --force "
            "writes into one with files in it): model.onnx (one step for prefill and decode; by default each layer's attention is one com.microsoft::PagedAttention "
            "that rotates q/k, writes the step's K/V into the layer's paged pools and attends over them, with "
            "no position or slot computed in the graph; --attention pakv writes with pakv::ScatterPaKvCache and "
            "reads with pakv::PagedAttention or GatherPaKvCache; model.onnx.data beside it when the weights "
            "are large), genai_config.json (engine.dynamic_batching, the paged_kv state group, "
            "custom_ops_library), the plugin library copied in, and HF_DIR's tokenizer files when present. "
            "og.Engine then runs it on a CPU with continuous batching (onnxruntime-genai: pip install "
            "'pakv-onnx[genai]'); with --execution-provider cuda (and --precision fp16 or bf16) genai_config.json "
            "names ORT's CUDA provider instead, whose own kernel runs the op, and no library is copied: the "
            "model.onnx of both is the same file. og.Engine gives both pools of a layer one shape: DeepSeek-V3's latent "
            "[c_kv | k_pe] lies whole in the key pool (LATENT; the value pool og.Engine allocates goes unread) "
            "or, with --attention pakv, in two halves across both; models whose key and value rows differ "
            "otherwise are refused. Exit 0 on success, 2 for a usage error or a model og.Engine cannot serve."
        ),
        examples=[
            "./tiny-llama ./tiny-llama-genai",
            "./tiny-llama ./tiny-llama-genai --block-size 32 --num-blocks 1024 --max-batch-size 8 --threads 1",
            "./tiny-llama ./tiny-llama-int8 --kv-cache int8 --prefix-caching off",
            "./tiny-llama ./tiny-llama-gpu --precision fp16 --execution-provider cuda  # ORT's CUDA kernel",
            "./tiny-llama ./tiny-llama-fp16 --precision fp16  # the same model.onnx, on the CPU",
        ],
    )
    _args.add_input_folder(
        parser, "HF_DIR", help="Hugging Face model folder (config.json + weights)", check=source_problem
    )
    _args.add_output_folder(parser, positional="OUT_DIR", help="the ORT GenAI model folder to write (new or empty)")
    _args.add_block_size(parser, help="fixed in the graph")
    _args.add_num_blocks(
        parser,
        default=256,
        help="blocks per layer pool og.Engine allocates (engine.dynamic_batching.num_blocks; default 256)",
    )
    _args.add_max_batch_size(parser, default=16, help="requests og.Engine batches together at most (default 16)")
    _args.add_threads(parser, help="ORT intra-op threads written into genai_config.json (default: ORT chooses)")
    parser.add_argument(
        "--external-data",
        action="store_true",
        help="weights in model.onnx.data even when small (default: only above 1 GiB)",
    )
    parser.add_argument(
        "--attention",
        choices=ATTENTION_CHOICES,
        default=None,
        help="ort (default for Llama, Qwen2, Mistral, Qwen3, DeepSeek-V3): each layer's attention one "
        "com.microsoft::PagedAttention (packed QKV in, rotary, the cache write and attention inside it, slots "
        "derived from the block table; DeepSeek-V3 over one LATENT pool); pakv: the pakv ops "
        "(ScatterPaKvCache + PagedAttention or GatherPaKvCache), which stock ORT also runs through fallbacks",
    )
    parser.add_argument(
        "--kv-cache",
        choices=KV_CACHE_CHOICES,
        default=None,
        help="quantized pools (--attention ort): int8 or fp8 (float8e4m3fn) with fixed per-channel scales "
        f"calibrated on the float32 model ({CALIBRATION_PROMPTS} prompts of {CALIBRATION_TOKENS} seeded random "
        "tokens), with any --precision; default: pools of the --precision's attention type",
    )
    _args.add_precision(parser, what="the weights, activations, com.microsoft::PagedAttention's T and the pools")
    _args.add_execution_provider(parser)
    parser.add_argument(
        "--prefix-caching",
        choices=("on", "off"),
        default=None,
        help="og.Engine's engine.dynamic_batching.prefix_caching (default: left out; og.Engine 0.18 turns it on "
        "for paged models)",
    )
    parser.add_argument(
        "--no-fuse",
        action="store_true",
        help="keep RMS norms and rotary embeddings as exported (default: fused into ORT contrib ops, "
        "com.microsoft SkipSimplifiedLayerNormalization and RotaryEmbedding)",
    )
    parser.set_defaults(run=run)
