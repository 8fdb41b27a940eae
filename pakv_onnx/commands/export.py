"""``pakv-onnx export HF_DIR OUT_DIR``: a Hugging Face model folder -> an ORT GenAI paged model folder."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pakv_onnx.commands import _args

MAX_BLOCK_SIZE = 1024


def run(args: argparse.Namespace) -> int:
    try:
        from pakv_onnx.models.hf import genai  # imports transformers: only when the command runs
    except ImportError as err:
        print(f"error: pakv-onnx export needs transformers (pip install 'pakv-onnx[hf]'): {err}", file=sys.stderr)
        return 2
    if not (args.hf_dir / "config.json").is_file():
        print(f"error: {args.hf_dir}: no config.json (want a folder as save_pretrained writes it)", file=sys.stderr)
        return 2

    def progress(message: str) -> None:
        print(f"  .. {message}", file=sys.stderr, flush=True)

    try:
        done = genai.export_genai(
            args.hf_dir,
            args.out_dir,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            max_batch_size=args.max_batch_size,
            intra_op_threads=args.threads,
            external_data=True if args.external_data else None,
            fuse=not args.no_fuse,
            progress=progress,
        )
    except genai.UnsupportedModelError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    batching = done.config["engine"]["dynamic_batching"]
    print(f"wrote {done.out_dir} in {done.seconds:.1f}s: {', '.join(done.files)}")
    print(
        f"paged: block_size {batching['block_size']}, num_blocks {batching['num_blocks']}, "
        f"max_batch_size {batching['max_batch_size']}; custom_ops_library "
        f"{done.config['model']['decoder']['session_options']['custom_ops_library']}"
    )
    print(f"serve it: og.Engine(og.Model({str(done.out_dir)!r}))  (pip install 'pakv-onnx[genai]')")
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = _args.add_command(
        commands,
        "export",
        help="a Hugging Face model folder -> an ORT GenAI model folder og.Engine serves (paged, continuous batching)",
        description=(
            "Load the transformers causal LM in HF_DIR (config + weights as save_pretrained writes them; "
            "nothing is downloaded) and write an ORT GenAI model folder to OUT_DIR: model.onnx (one step "
            "for prefill and decode; every layer writes its new K/V into its paged pools with "
            "pakv::ScatterPaKvCache and reads past + new back with pakv::GatherPaKvCache; "
            "model.onnx.data beside it when the weights are large), genai_config.json "
            "(engine.dynamic_batching, the paged_kv state group, custom_ops_library), the plugin library "
            "copied in, and HF_DIR's tokenizer files when present. og.Engine then runs it on a CPU "
            "with continuous batching (onnxruntime-genai: pip install 'pakv-onnx[genai]'). og.Engine gives "
            "both pools of a layer one shape: DeepSeek-V3's latent [c_kv | k_pe] is laid in two halves "
            "across them (attention in the absorbed form); models whose key and value rows differ "
            "otherwise are refused. Exit 0 on success, 2 for a usage error or a model og.Engine cannot serve."
        ),
        examples=[
            "./tiny-llama ./tiny-llama-genai",
            "./tiny-llama ./tiny-llama-genai --block-size 32 --num-blocks 1024 --max-batch-size 8 --threads 1",
        ],
    )
    parser.add_argument("hf_dir", type=Path, metavar="HF_DIR", help="Hugging Face model folder (config.json + weights)")
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="the ORT GenAI model folder to write")
    parser.add_argument(
        "--block-size",
        type=_args.int_in(1, MAX_BLOCK_SIZE),
        default=16,
        help=f"tokens per cache block (1..{MAX_BLOCK_SIZE}; default 16; fixed in the graph)",
    )
    parser.add_argument(
        "--num-blocks",
        type=_args.positive_int,
        default=256,
        help="blocks per layer pool og.Engine allocates (engine.dynamic_batching.num_blocks; default 256)",
    )
    parser.add_argument(
        "--max-batch-size",
        type=_args.positive_int,
        default=16,
        help="requests og.Engine batches together at most (default 16)",
    )
    parser.add_argument(
        "--threads",
        type=_args.positive_int,
        default=None,
        help="ORT intra-op threads written into genai_config.json (default: ORT chooses)",
    )
    parser.add_argument(
        "--external-data",
        action="store_true",
        help="weights in model.onnx.data even when small (default: only above 1 GiB)",
    )
    parser.add_argument(
        "--no-fuse",
        action="store_true",
        help="keep RMS norms and rotary embeddings as exported (default: fused into ORT contrib ops, "
        "com.microsoft SkipSimplifiedLayerNormalization and RotaryEmbedding)",
    )
    parser.set_defaults(run=run)
