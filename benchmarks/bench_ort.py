"""Benchmark of the ONNX Runtime plugin: session.run (IOBinding) medians and ratios.

Compared, on the same caches (bound zero-copy), outputs bound to reused buffers, every ORT variant
driven through an IOBinding built once (`session.run_with_iobinding`, as a serving loop does),
all variants timed in turn round by round (so machine noise hits them alike):
  native   the plugin's C kernel
  torch    the plugin's Python callback into the `torch` backend
  gather   ORT floor: one session of two native ORT `Gather` ops on precomputed token indices
  memcpy   a torch copy of the same output bytes into an already-touched buffer
  pyop     onnxruntime-extensions PyOp on a uint16 stand-in (PyOp cannot take BF16)

Shapes: seed sweep cases (812 MB caches; `--cases`) and a large-T case (T >= 256k tokens of an
8-head x 128 BF16 cache; `--large-blocks`). Prints a Markdown table.

A second table: the native kernel with ORT's intra_op_num_threads 1 and 2 (one session each, same
bound buffers, timed in alternating blocks): large copies are split over ORT's intra-op pool
(KernelContext_ParallelFor, ORT >= 1.17), so intra-op 2 should take <= 0.75x the time of intra-op 1
at large T (`--threads-blocks`, default 512 blocks = 65,536 tokens) on a 2-core machine, and small T
(the seed cases) never enters a parallel region (both the same).

    python benchmarks/bench_ort.py [--cases level0,level8,heads64_k128_v128] [--repeats 50]
    python benchmarks/bench_ort.py --max-blocks 64   # seed shapes with at most 64 cache blocks
    python benchmarks/bench_ort.py --threads-only --max-blocks 64   # just the intra-op table

``--max-blocks`` keeps every seed shape (T, heads, head dims, block size, tables) but caps the
caches' num_blocks: the seed cases read only their first few blocks, so the gather does the same
work while the caches take megabytes instead of 812 MB (for busy shared machines).
"""

from __future__ import annotations

import argparse

import numpy as np
import onnxruntime as ort
import torch
from _cases import capped_seed_case, large_case
from _timing import blocked_medians_us, median_us, prebound
from onnx import TensorProto, helper

from pakv_onnx import runtime_plugin
from pakv_onnx.cases import GatherCase
from pakv_onnx.export import cap_ir_version, make_gather_model_for
from pakv_onnx.spec import INPUT_NAMES
from pakv_onnx.validator import plan_gather


def gather_floor(case: GatherCase, plan, outs, golden):
    """Two ORT Gather ops over the caches viewed as token rows, indices precomputed (Norm only)."""
    block, slot = plan.token_slots()
    index = (block * plan.block_size + slot).contiguous()
    nodes = [helper.make_node("Gather", [f"{n}_rows", "index"], [n], axis=0) for n in ("key", "value")]
    inputs = [helper.make_tensor_value_info(f"{n}_rows", TensorProto.BFLOAT16, None) for n in ("key", "value")]
    inputs.append(helper.make_tensor_value_info("index", TensorProto.INT64, None))
    outputs = [helper.make_tensor_value_info(n, TensorProto.BFLOAT16, None) for n in ("key", "value")]
    model = cap_ir_version(
        helper.make_model(helper.make_graph(nodes, "floor", inputs, outputs), opset_imports=[helper.make_opsetid("", 17)])
    )
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    nb, bs = plan.num_blocks, plan.block_size
    feeds = {
        "key_rows": case.key_cache.view(nb * bs, *case.key_cache.shape[2:]),
        "value_rows": case.value_cache.view(nb * bs, *case.value_cache.shape[2:]),
        "index": index,
    }
    return prebound(session, feeds, outs, golden, "gather")


def pyop_time(case: GatherCase, plan, repeats: int) -> float | None:
    try:
        from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op
    except ImportError:
        return None
    block, slot = plan.token_slots()
    d = PyCustomOpDef
    if not _PYOP_DEFINED:
        _define_pyop(onnx_op, d)
    options = ort.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    return _run_pyop(case, block, slot, options, repeats)


_PYOP_DEFINED = []


def _define_pyop(onnx_op, d) -> None:
    """Register the PyOp once per process (onnxruntime-extensions refuses a second definition)."""

    @onnx_op(
        op_type="PakvGatherU16",
        inputs=[d.dt_uint16, d.dt_uint16, d.dt_int64, d.dt_int64],
        outputs=[d.dt_uint16, d.dt_uint16],
    )
    def _gather(key_cache, value_cache, blocks, slots):
        return key_cache[blocks, slots], value_cache[blocks, slots]

    _PYOP_DEFINED.append(_gather)


def _run_pyop(case, block, slot, options, repeats):
    node = helper.make_node("PakvGatherU16", ["kc", "vc", "b", "s"], ["key", "value"], domain="ai.onnx.contrib")
    inputs = [
        helper.make_tensor_value_info(n, t, None)
        for n, t in (
            ("kc", TensorProto.UINT16),
            ("vc", TensorProto.UINT16),
            ("b", TensorProto.INT64),
            ("s", TensorProto.INT64),
        )
    ]
    outputs = [helper.make_tensor_value_info(n, TensorProto.UINT16, None) for n in ("key", "value")]
    model = cap_ir_version(
        helper.make_model(
            helper.make_graph([node], "pyop", inputs, outputs),
            opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.contrib", 1)],
        )
    )
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {
        "kc": case.key_cache.view(torch.int16).numpy().view(np.uint16),
        "vc": case.value_cache.view(torch.int16).numpy().view(np.uint16),
        "b": block.numpy(),
        "s": slot.numpy(),
    }
    return median_us(lambda: session.run(None, feeds), repeats, warmup=1)


def bench_case(label: str, case: GatherCase, repeats: int, with_pyop: bool) -> dict:
    plan = plan_gather(*case.inputs(), **case.attributes())
    # No fallback function (only the plugin can run the node); unranked inputs, as the timings always had.
    model = make_gather_model_for(*case.inputs(), **case.attributes(), fallback=False, shapes=None)
    feeds = {name: t for name, t in zip(INPUT_NAMES, case.inputs()) if t is not None}
    golden = case.golden()
    outs = {"key": torch.empty_like(golden[0]), "value": torch.empty_like(golden[1])}
    row = {"case": label, "T": plan.num_tokens, "out_bytes": golden[0].numel() * 2 + golden[1].numel() * 2}
    runs = {}
    for backend in ("native", "torch"):
        runs[backend] = prebound(runtime_plugin.make_session(model, backend=backend), feeds, outs, golden, backend)
    runs["gather"] = gather_floor(case, plan, outs, golden)
    src = [golden[0].clone(), golden[1].clone()]
    runs["memcpy"] = lambda: (outs["key"].copy_(src[0]), outs["value"].copy_(src[1]))
    row.update(blocked_medians_us(runs, repeats))
    row["pyop"] = pyop_time(case, plan, max(3, repeats // 10)) if with_pyop else None
    return row


def bench_threads(label: str, case: GatherCase, repeats: int) -> dict:
    """The native kernel in two sessions, intra_op_num_threads 1 and 2, timed in alternating blocks."""
    model = make_gather_model_for(*case.inputs(), **case.attributes(), fallback=False, shapes=None)
    feeds = {name: t for name, t in zip(INPUT_NAMES, case.inputs()) if t is not None}
    golden = case.golden()
    outs = {"key": torch.empty_like(golden[0]), "value": torch.empty_like(golden[1])}
    runs = {}
    for threads in (1, 2):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        session = runtime_plugin.make_session(model, sess_options=options)
        runs[threads] = prebound(session, feeds, outs, golden, f"intra-op {threads}")
    row = {"case": label, "T": golden[0].shape[0], "out_bytes": golden[0].numel() * 2 + golden[1].numel() * 2}
    row.update(blocked_medians_us(runs, repeats, block=max(3, min(30, repeats // 4))))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="level0,level8,heads64_k128_v128")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--large-blocks", type=int, default=2048, help="blocks of 128 tokens (2048 -> T = 262144)")
    parser.add_argument("--no-pyop", action="store_true")
    parser.add_argument("--max-blocks", type=int, default=0, help="cap the seed caches' num_blocks (0: as seeded)")
    parser.add_argument("--threads-blocks", type=int, default=512, help="large-T blocks of the intra-op table")
    parser.add_argument("--threads-only", action="store_true", help="only the intra-op 1 vs 2 table")
    args = parser.parse_args()
    if not args.threads_only:
        print_main_table(args)
    rows = [bench_threads(c, capped_seed_case(c, args.max_blocks), args.repeats) for c in args.cases.split(",") if c]
    if args.threads_blocks:
        large = large_case(args.threads_blocks)
        rows.append(bench_threads(f"large T ({args.threads_blocks}x128 tok, 8x128 bf16)", large, max(20, args.repeats // 5)))
    print()
    print("| case | T | output MB | intra-op 1 us | intra-op 2 us | intra-op 2 / 1 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['T']} | {r['out_bytes'] / 1e6:.3f} | {r[1]:.1f} | {r[2]:.1f} | {r[2] / r[1]:.2f} |")


def print_main_table(args) -> None:
    rows = []
    for case_id in [c for c in args.cases.split(",") if c]:
        case = capped_seed_case(case_id, args.max_blocks)
        rows.append(bench_case(case_id, case, args.repeats, not args.no_pyop))
        del case
    if args.large_blocks:
        rows.append(
            bench_case(
                f"large T ({args.large_blocks}x128 tok, 8x128 bf16)",
                large_case(args.large_blocks),
                max(5, args.repeats // 5),
                False,
            )
        )
    print(
        "| case | T | output MB | native us | torch (callback) us | ORT Gather floor us | memcpy us | PyOp u16 us "
        "| native / Gather | native / memcpy | PyOp / native |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        pyop = f"{r['pyop']:.0f}" if r["pyop"] else "-"
        pyop_ratio = f"{r['pyop'] / r['native']:.0f}x" if r["pyop"] else "-"
        print(
            f"| {r['case']} | {r['T']} | {r['out_bytes'] / 1e6:.3f} | {r['native']:.1f} | {r['torch']:.1f} | "
            f"{r['gather']:.1f} | {r['memcpy']:.1f} | {pyop} | {r['native'] / r['gather']:.2f} | "
            f"{r['native'] / r['memcpy']:.2f} | {pyop_ratio} |"
        )


if __name__ == "__main__":
    main()
