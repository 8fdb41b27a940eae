"""``pakv-onnx genai-cpu DIR``: ORT GenAI's own paged model folder -> served by og.Engine on the CPU."""

from __future__ import annotations

import argparse
from pathlib import Path

from pakv_onnx.commands import _args


def run(args: argparse.Namespace) -> int:
    from pakv_onnx.models.hf import genai_cpu

    try:
        done = genai_cpu.serve_on_cpu(
            args.model_dir, num_blocks=args.num_blocks, block_size=args.block_size, max_batch_size=args.max_batch_size
        )
    except genai_cpu.NotAGenaiPagedModelError as err:
        return _args.usage_error("genai-cpu", str(err))
    print(genai_cpu.describe(args.model_dir, done))
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = _args.add_command(
        commands,
        "genai-cpu",
        help="serve ORT GenAI's own paged model (builder -e cuda, use_paged_attention=true) with og.Engine on a CPU",
        description=(
            "ORT GenAI's model builder writes paged models (python -m onnxruntime_genai.models.builder ... -e cuda "
            "--extra_options use_paged_attention=true) around com.microsoft::PagedAttention, which ONNX Runtime "
            "runs on CUDA and WebGPU only; this package's plugin library runs it on the CPU. This command edits "
            "MODEL_DIR/genai_config.json so og.Engine serves the folder on the CPU: the CPU execution provider "
            "(provider_options []), the plugin as custom_ops_library (copied into MODEL_DIR), and a fixed pool "
            "(engine.dynamic_batching.num_blocks; og.Engine otherwise sizes it from free device memory) in "
            "place of gpu_utilization_factor. model.onnx is not touched. It prints each change and the pool "
            "memory they imply. Exit 0 on success, 2 for a folder that is not a GenAI paged model."
        ),
        examples=[
            "./qwen-paged-fp16  # the builder's folder, edited in place",
            "./tiny-paged --num-blocks 512 --block-size 16 --max-batch-size 8",
        ],
    )
    parser.add_argument("model_dir", type=Path, metavar="MODEL_DIR", help="a folder ORT GenAI's builder wrote (paged)")
    parser.add_argument(
        "--num-blocks",
        type=_args.positive_int,
        default=None,
        help="blocks per layer pool (default: the folder's, else one request at the whole context_length)",
    )
    parser.add_argument(
        "--block-size",
        type=_args.positive_int,
        default=None,
        help="tokens per block (default: the builder's; the CPU kernel takes any size)",
    )
    parser.add_argument(
        "--max-batch-size",
        type=_args.positive_int,
        default=None,
        help="requests batched together (default: the builder's)",
    )
    parser.set_defaults(run=run)
