"""``pakv-onnx generate``: transformers decoders generating over a paged cache in ONNX Runtime."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from pakv_onnx.commands import _args, _interrupt, _libraries, _outputs, _report

ARCH_CHOICES = ("llama", "qwen2", "mistral", "qwen3", "deepseek")  # models.hf.configs.ARCHS (a test ties them)
ATTENTION_CHOICES = ("ort", "pakv")  # models.hf.step.ATTENTION_CHOICES (a test ties them)
MAX_BATCH = 32
MAX_NEW_TOKENS = 512  # prompts are <= 40 tokens; the models know 1024 positions
# Without --backend: these, and pypto-cpu where it can run the step and the case is small.
DEFAULT_BACKENDS = ("native", "golden")


def run(args: argparse.Namespace) -> int:
    from pakv_onnx import providers  # light: no torch

    refusal = providers.precision_refusal(args.precision, args.attention)
    if refusal:
        return _args.usage_error("generate", refusal)
    try:
        check = _libraries.load_hf("check")
    except ImportError as err:
        return _args.usage_error("generate", str(err))

    with contextlib.ExitStack() as stack:  # --out: staged, published at the end; else a temporary folder
        if args.out:
            out_dir = stack.enter_context(_outputs.staged_folder(args.out))
        else:
            out_dir = stack.enter_context(_outputs.temporary_folder("pakv-onnx-generate-"))
        report = check.run_check(
            arch=args.arch,
            batch=args.batch,
            new_tokens=args.new_tokens,
            block_size=args.block_size,
            seed=args.seed,
            backends=args.backend or DEFAULT_BACKENDS,
            out_dir=out_dir,
            attention=args.attention,
            progress=_report.progress,
            add_pypto_cpu=args.backend is None,  # the default set; a --backend list is run as given
            precision=args.precision,
        )
        _interrupt.check()
    if args.json:
        runners = {r.runner: check.json_entry(r) for r in report.results}
        print(json.dumps({"arch": report.arch, "runners": runners}))
        for r in report.results:
            if r.error:
                print(f"error: {r.runner}: {r.error}", file=sys.stderr)
    else:
        print(check.format_table(report))
        if args.out:
            print(f"ONNX file kept in {args.out}")
        if args.precision == "fp32":
            print(f"tokens identical to transformers' greedy generate, logits max abs error <= {check.LOGIT_ATOL:g}")
        else:
            print(
                f"{args.precision} against float32 transformers: teacher-forced logits within "
                f"{check.PRECISION_LOGIT_ATOL[args.precision]:g}, greedy tokens identical up to a flip at a near "
                f"tie (top-2 gap <= {check.NEAR_TIE:g})"
            )
        print("PASS" if report.passed else "FAIL")
    return 0 if report.passed else 1


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = _args.add_command(
        commands,
        "generate",
        help="a transformers decoder generating over a paged KV cache in ONNX Runtime, checked against transformers",
        description=(
            "Build a small transformers decoder with seeded random weights (no downloads): Llama, Qwen2 "
            "(q/k/v biases, a sliding-window layer), Mistral (sliding window), Qwen3 (q/k norm), all GQA, or "
            "DeepSeek-V3 MLA (latent 512 + rope 64). One model step (prefill and decode share it; ORT GenAI's "
            "paged inputs and outputs, the pools bound in place) is exported to ONNX. With --attention ort "
            "(default) each layer's attention is one com.microsoft::PagedAttention: rotary, the write of the "
            "step's K/V into the paged pools and attention in one op, positions and slots derived inside it "
            "(DeepSeek-V3 in MLA's absorbed form over one LATENT pool); the plugin runs it. With --attention "
            "pakv each layer writes with pakv::ScatterPaKvCache and reads with pakv::PagedAttention (GQA) or "
            "pakv::GatherPaKvCache (MLA): the plugin runs those with each --backend (without --backend: "
            "native, golden, and pypto-cpu when that backend is registered, has a kernel for each op of the step "
            "and the case is small; a --backend list runs as given), and stock ONNX Runtime through the graph's "
            "fallback functions. The step drives "
            "greedy generation for a batch of prompts of different lengths (sequences finish at different "
            "steps and return their blocks) on each runner; each runner's tokens must equal transformers' "
            "generate(do_sample=False) with its dense cache, and its logits must be within a fp32 tolerance. "
            "Prints a table (or --json) and PASS/FAIL; exit 0/1."
        ),
        examples=[
            "  # Llama (the default --arch)",
            "--arch deepseek --batch 6 --new-tokens 24 --block-size 32 --json",
            "--arch mistral --attention pakv",
            "--arch qwen3 --precision bf16",
        ],
    )
    parser.add_argument("--arch", choices=ARCH_CHOICES, default="llama", help="model family (default llama)")
    parser.add_argument(
        "--attention",
        choices=ATTENTION_CHOICES,
        default="ort",
        help="ort (default): each layer one com.microsoft::PagedAttention (rotary, the cache write and attention "
        "in one op; runs with the plugin); pakv: pakv::ScatterPaKvCache + pakv::PagedAttention (GQA) or "
        "GatherPaKvCache (MLA), which every --backend and stock ORT (fallback functions) run",
    )
    parser.add_argument(
        "--batch",
        type=_args.int_in(1, MAX_BATCH),
        default=4,
        help=f"prompts generated together (1..{MAX_BATCH}; default 4)",
    )
    parser.add_argument(
        "--new-tokens",
        type=_args.int_in(1, MAX_NEW_TOKENS),
        default=16,
        help=f"tokens the longest sequence generates; others stop earlier (1..{MAX_NEW_TOKENS}; default 16)",
    )
    _args.add_block_size(parser)
    parser.add_argument(
        "--backend",
        type=_args.runnable_backend_list,
        default=None,
        help="comma-separated plugin backends to generate on, besides stock ORT, exactly these (default: "
        "native,golden, and pypto-cpu where it has a kernel for each op of the step and the case is small)",
    )
    _args.add_precision(parser, what="the exported step (--attention ort)")
    _args.add_seed(parser, help="seed of the weights, prompts and block order")
    _args.add_output_folder(
        parser, help="keep the exported .onnx step in DIR, new or empty (default: a temporary folder, removed at the end)"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help='print {"arch": ..., "runners": {NAME: {"tokens_match", "max_logit_err", "ms_per_token"}}} '
        "instead of the table",
    )
    parser.set_defaults(run=run)
