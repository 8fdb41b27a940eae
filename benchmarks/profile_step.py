"""Where a decode step's microseconds go: ORT's profiler over the paged step and ORT GenAI's dense one.

Builds the folders of benchmarks/_genai.py (a tiny Llama, vocab 512, seeded weights; ``pakv-onnx
export`` fused and ``--no-fuse``; GenAI's builder ``-p fp32 -e cpu``), runs ``--steps`` decode steps
of B sequences of C-token prompts on each with ORT's profiler on (``enable_profiling``, files in a
temp dir; for GenAI through genai_config's ``session_options.enable_profiling``), 1 intra-op thread,
and prints per model: the main graph's nodes by op type, then per decode step the kernel
microseconds and calls by category and by op type (a ``Loop``'s time includes its body; the body's
own kernels are listed apart: events inside a Loop's time window).

The profiler adds a few microseconds to every node, so shares mean more than totals; the
unprofiled step times are in ``bench_generate.py --table genai``.

    python benchmarks/profile_step.py [--batch 4] [--context 256] [--steps 20] [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import gc
import glob
import json
import tempfile
from pathlib import Path

import _genai
import numpy as np
import onnx
import onnxruntime as ort

from pakv_onnx import runtime_plugin
from pakv_onnx.models.hf.fusion import op_counts
from pakv_onnx.models.hf.genai import load_hf_model

# Coarse categories by op type (Mul/Add serve norms, rotary, residuals and the MLP alike: "other").
NORM_OPS = (
    "SkipSimplifiedLayerNormalization",
    "SimplifiedLayerNormalization",
    "Pow",
    "ReduceMean",
    "Sqrt",
    "Reciprocal",
)
LAYOUT_OPS = (
    "Transpose",
    "Reshape",
    "Unsqueeze",
    "Squeeze",
    "Gather",
    "GatherND",
    "Expand",
    "Slice",
    "Concat",
    "Split",
)
CATEGORIES = {
    "attention (Loop incl. body, GQA)": {"Loop", "GroupQueryAttention"},
    "pakv cache ops": {"GatherPaKvCache", "ScatterPaKvCache"},
    "MatMul": {"MatMul", "FusedMatMul"},
    "RMS norm": set(NORM_OPS),
    "rotary": {"RotaryEmbedding", "Cos", "Sin", "Neg"},
    "layout and copies": set(LAYOUT_OPS),
    "Cast": {"Cast"},
}


def category(op: str) -> str:
    return next((name for name, ops in CATEGORIES.items() if op in ops), "other (elementwise, shape arithmetic)")


def step_kernels(profile: str) -> tuple[int, float, collections.Counter, collections.Counter, collections.Counter]:
    """``(decode steps, profiled us per step, us by op, calls by op, us by op inside Loop bodies)``
    from a profile file; the first run (the prefill) is left out."""
    events = json.loads(Path(profile).read_text())
    runs = [e for e in events if e.get("name") == "model_run"][1:]
    start = runs[0]["ts"]
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= start]
    loops = [(e["ts"], e["ts"] + e["dur"]) for e in nodes if e["args"].get("op_name") == "Loop"]
    us, calls, body = collections.Counter(), collections.Counter(), collections.Counter()
    for e in nodes:
        op = e["args"]["op_name"]
        if any(a < e["ts"] < b for a, b in loops):
            body[op] += e["dur"]
        else:
            us[op] += e["dur"]
            calls[op] += 1
    return len(runs), sum(r["dur"] for r in runs) / len(runs), us, calls, body


def report(name: str, model_file: Path, profile: str, top: int) -> None:
    graph = onnx.load(str(model_file), load_external_data=False)
    nodes = op_counts(graph)
    loop_nodes = sum(
        len(a.g.node) for n in graph.graph.node for a in n.attribute if n.op_type == "Loop" and a.name == "body"
    )
    steps, run_us, us, calls, body = step_kernels(profile)
    total = sum(us.values())
    print(f"\n## {name}: {sum(nodes.values())} nodes in the main graph (+ {loop_nodes} in Loop bodies)")
    print("nodes by op type: " + ", ".join(f"{op} {k}" for op, k in nodes.most_common()))
    print(f"profiled: {run_us:.0f} us per decode step (model_run), kernels {total / steps:.0f} us in "
          f"{sum(calls.values()) / steps:.0f} top-level calls")  # fmt: skip
    by_category: collections.Counter = collections.Counter()
    for op, t in us.items():
        by_category[category(op)] += t
    print("| category | us/step | share |\n|---|---:|---:|")
    for cat, t in by_category.most_common():
        print(f"| {cat} | {t / steps:.0f} | {t / total:.0%} |")
    print(f"| op (top {top}) | us/step | calls/step | share |\n|---|---:|---:|---:|")
    for op, t in us.most_common(top):
        print(f"| {op} | {t / steps:.0f} | {calls[op] / steps:.0f} | {t / total:.0%} |")
    if body:
        inside = sum(body.values())
        print(f"inside the Loops: {inside / steps:.0f} us of kernels per step; " + ", ".join(
            f"{op} {t / steps:.0f}" for op, t in body.most_common(6)))  # fmt: skip


def profile_paged(folder: Path, tmp: Path, config, prompts: np.ndarray, steps: int, block_size: int) -> str:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp / f"{folder.name}-profile")
    session = runtime_plugin.make_session(folder / "model.onnx", sess_options=options)
    _genai.decode_paged(session, config, prompts, steps, block_size)
    return session.end_profiling()


def profile_dense(folder: Path, tmp: Path, prompts: np.ndarray, steps: int) -> str:
    prefix = str(tmp / "dense-profile")
    model = _genai.og_model(folder, profile_prefix=prefix)
    _genai.decode_generator(model, prompts, steps)
    del model
    gc.collect()  # the profile is written when og's session goes
    return max(glob.glob(prefix + "*.json"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pakv-profile-") as tmp:
        root = Path(tmp)
        blocks = args.batch * -(-(args.context + args.steps + 2) // args.block_size) + 8
        folders = _genai.write_folders(root, args.block_size, blocks, args.batch)
        config = load_hf_model(folders.hf).config
        prompts = np.random.default_rng(0).integers(0, config.vocab_size, (args.batch, args.context)).astype(np.int32)
        print(f"# B={args.batch} C={args.context}, {args.steps} decode steps, 1 intra-op thread")
        for folder, label in ((folders.paged, "paged (pakv-onnx export)"), (folders.unfused, "paged --no-fuse")):
            profile = profile_paged(folder, root, config, prompts, args.steps, args.block_size)
            report(label, folder / "model.onnx", profile, args.top)
        report("ORT GenAI dense (builder -p fp32 -e cpu)", folders.dense / "model.onnx",
               profile_dense(folders.dense, root, prompts, args.steps), args.top)  # fmt: skip


if __name__ == "__main__":
    main()
