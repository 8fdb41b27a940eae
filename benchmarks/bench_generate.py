"""Benchmark: decode ms/token of the ORT paged path vs transformers eager with its dense cache.

For each arch, batch size B and context length C: B random prompts of C tokens are prefilled
(untimed), then ``--steps`` greedy decode steps are timed, all sequences in one batch.
  transformers  ``model(next_ids, cache=DynamicCache)`` in eager torch (attn "eager", fp32)
  ort-native    the exported paged step (one GatherPaKvCache per layer, per-sequence Loop attention)
                in an ORT session with the plugin's C kernel, plus the host write of the new rows
  stock-ort     the same graph on stock ORT (the op runs as its fallback function body)
ms/token = decode wall time / (steps x B). torch and ORT get the same thread count (``--threads``).
The paths are timed in turn round by round (so machine noise hits them alike); the median round
is reported. Ratios < 1 mean the ORT path is faster.
Prints a Markdown table.

    python benchmarks/bench_generate.py [--archs llama,deepseek] [--batches 1,4,8]
                                        [--contexts 64,256] [--steps 16] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pakv_onnx.models.hf import Workload, build_model, check, make_workload, new_cache
from pakv_onnx.models.hf.generate import run_step


def decode_transformers(model, prompts: torch.Tensor, steps: int) -> float:
    """Seconds for ``steps`` greedy decode steps after an untimed prefill of ``prompts`` [B, C]."""
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=prompts, cache=cache, use_cache=True)
        next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=next_ids, cache=out.cache, use_cache=True)
            next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        return time.perf_counter() - start


def decode_paged(session, config, prompts: torch.Tensor, steps: int, block_size: int) -> float:
    """Seconds for ``steps`` decode steps of the paged ORT path after an untimed prefill."""
    batch = prompts.shape[0]
    workload = Workload(prompts.tolist(), [steps + 1] * batch)
    cache = new_cache(config, workload, block_size, seed=0)
    ids = list(range(batch))
    for i in ids:
        cache.add_sequence(i)
    step = check.session_step(session)
    chosen = run_step(step, cache, ids, workload.prompts)["logits"].argmax(-1).tolist()
    start = time.perf_counter()
    for _ in range(steps):
        chosen = run_step(step, cache, ids, [[t] for t in chosen])["logits"].argmax(-1).tolist()
    return time.perf_counter() - start


def bench_arch(
    arch: str, batches: list[int], contexts: list[int], steps: int, rounds: int, block_size: int, threads: int
) -> list:
    reference = build_model(arch, 0)
    config = reference.config
    rows = []
    with tempfile.TemporaryDirectory(prefix="pakv-bench-generate-") as tmp:
        path = Path(tmp) / f"{arch}.onnx"
        example = make_workload(batch=3, new_tokens=2, vocab_size=config.vocab_size, seed=0)
        check.export_for(arch, 0, example, block_size, path)
        sessions = {name: check.make_runner_session(name, path, threads) for name in ("plugin:native", check.STOCK_ORT)}
        for batch in batches:
            for context in contexts:
                generator = torch.Generator().manual_seed(batch * 1000 + context)
                prompts = torch.randint(0, config.vocab_size, (batch, context), generator=generator)
                paths = {
                    "transformers": lambda: decode_transformers(reference, prompts, steps),
                    **{
                        name: (lambda s=s: decode_paged(s, config, prompts, steps, block_size))
                        for name, s in sessions.items()
                    },
                }
                times: dict[str, list[float]] = {name: [] for name in paths}
                for _ in range(rounds + 1):  # the first round is a warm-up
                    for name, fn in paths.items():
                        times[name].append(fn())
                ms = {name: statistics.median(t[1:]) * 1e3 / (steps * batch) for name, t in times.items()}
                rows.append((arch, batch, context, ms))
                print(
                    f"  .. {arch} B={batch} C={context}: " + ", ".join(f"{k} {v:.3f}" for k, v in ms.items()),
                    flush=True,
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", default="llama,deepseek")
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--contexts", default="64,256")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch and ORT intra-op threads (default 1: steadier on a busy machine)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    rows = []
    for arch in args.archs.split(","):
        rows += bench_arch(
            arch, ints(args.batches), ints(args.contexts), args.steps, args.rounds, args.block_size, args.threads
        )
    print()
    print(
        "| arch | batch | context | transformers eager ms/token | ORT plugin native ms/token | ratio | "
        "stock ORT ms/token | ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for arch, batch, context, ms in rows:
        hf, native, stock = ms["transformers"], ms["plugin:native"], ms[check.STOCK_ORT]
        print(
            f"| {arch} | {batch} | {context} | {hf:.3f} | {native:.3f} | {native / hf:.2f} | "
            f"{stock:.3f} | {stock / hf:.2f} |"
        )


if __name__ == "__main__":
    main()
