"""``pakv-onnx genai-cpu DIR``: ORT GenAI's own paged model folder -> served by og.Engine on the CPU.

MODEL_DIR is checked before anything is imported (it exists and holds genai_config.json), then its
config and graph (:func:`pakv_onnx.models.hf.genai_cpu.serve_on_cpu`: a paged model, and the model
its config describes) before anything is written; the edits are published after the last safe
point (:func:`pakv_onnx.commands._interrupt.commit`), so a Ctrl-C leaves the folder as it was.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pakv_onnx.commands import _args, _interrupt

GENAI_CONFIG = "genai_config.json"  # models.hf.genai_cpu.GENAI_CONFIG (a test ties them)


def model_dir_problem(folder: Path) -> str | None:
    """What ``folder`` lacks to be an ORT GenAI model folder, checked before any import."""
    return None if (folder / GENAI_CONFIG).is_file() else f"is not an ORT GenAI paged model: no {GENAI_CONFIG}"


def run(args: argparse.Namespace) -> int:
    from pakv_onnx.models.hf import genai_cpu

    _interrupt.check()
    try:
        done = genai_cpu.serve_on_cpu(
            args.model_dir,
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            max_batch_size=args.max_batch_size,
            before_writing=_interrupt.commit,
        )
    except (genai_cpu.NotAGenaiPagedModelError, genai_cpu.MisbuiltModelError) as err:
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
            "memory they imply. It refuses a folder whose graph is not the model its config describes (logits "
            "not vocab_size wide, or computed from fewer layers than num_hidden_layers: the builder's trap when "
            "another layer is as wide as the vocabulary) before writing anything. Exit 0 on success, 2 for a "
            "folder that is not a GenAI paged model or not the model its config describes."
        ),
        examples=[
            "./qwen-paged-fp16  # the builder's folder, edited in place",
            "./tiny-paged --num-blocks 512 --block-size 16 --max-batch-size 8",
        ],
    )
    _args.add_input_folder(
        parser, "MODEL_DIR", help="a folder ORT GenAI's builder wrote (paged)", check=model_dir_problem
    )
    _args.add_num_blocks(
        parser,
        default=None,
        help="blocks per layer pool (default: the folder's, else one request at the whole context_length)",
    )
    _args.add_block_size(parser, default=None, help="the CPU kernel takes any size")
    _args.add_max_batch_size(parser, default=None, help="requests batched together (default: the builder's)")
    parser.set_defaults(run=run)
