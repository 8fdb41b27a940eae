"""Benchmark: decode ms/token of the exported paged step in ORT vs transformers eager with its dense cache.

For each arch, batch size B and context length C: B random prompts of C tokens are prefilled
(untimed), then ``--steps`` greedy decode steps are timed, all sequences in one batch.
  transformers  ``model(next_ids, cache=DynamicCache)`` in eager torch (attn "eager", fp32)
  ort           the exported step in its default form (each layer one com.microsoft::PagedAttention;
                DeepSeek-V3 over one LATENT pool) in an ORT session with the plugin, pools bound in place
  pakv          the step in the pakv form (ScatterPaKvCache + PagedAttention / GatherPaKvCache), plugin
  stock-ort     the pakv form on stock ORT (the ops run as their fallback function bodies)
ms/token = decode wall time / (steps x B). torch and ORT get the same thread count (``--threads``).
The paths are timed in turn round by round (so machine noise hits them alike); the median round
is reported. Ratios < 1 mean the ORT path is faster. Every path's last tokens must agree.

The write table (``--table write``) times one decode step (ms/step, host layout included) of the
pakv form's in-graph write against what it replaced and against the pool size:
  host write    the step without ScatterPaKvCache: new rows out, ``index_copy_`` on the host
                (benchmarks/_host_write.py), pools of 64 blocks
  in-graph      the exported step (ScatterPaKvCache + GatherPaKvCache per layer), present outputs
                bound to the pools, with pools of 64 and of 4,096 blocks (no pool is copied)
  stock ORT     the same graph on stock ORT: the write is the fallback's ScatterND, which copies
                every pool every step (64 and 4,096 blocks)
The comparison with ORT GenAI's own CPU model is benchmarks/bench_decoders.py.
Prints Markdown tables.

    python benchmarks/bench_generate.py [--table generate|write|all] [--archs llama,deepseek]
                                        [--batches 1,4,8] [--contexts 64,256] [--steps 16]
                                        [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pakv_onnx.models.hf import (
    PagedKVCache,
    Workload,
    build_model,
    cache_geometry,
    check,
    make_workload,
    new_cache,
    run_step,
    session_step,
    step_inputs,
)


def decode_transformers(model, prompts: torch.Tensor, steps: int) -> tuple[float, list[int]]:
    """Seconds for ``steps`` greedy decode steps after an untimed prefill of ``prompts`` [B, C], and the
    last tokens."""
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=prompts, cache=cache, use_cache=True)
        next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=next_ids, cache=out.cache, use_cache=True)
            next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        return time.perf_counter() - start, next_ids[:, 0].tolist()


def decode_paged(session, step_module, prompts: torch.Tensor, steps: int, block_size: int) -> tuple[float, list[int]]:
    """Seconds for ``steps`` decode steps of the paged ORT path after an untimed prefill, and the last
    tokens; the pools are laid out as ``step_module`` (the exported step) reads them."""
    batch = prompts.shape[0]
    workload = Workload(prompts.tolist(), [steps + 1] * batch)
    cache = check.step_cache(step_module, workload, block_size, 0)
    ids = list(range(batch))
    for i in ids:
        cache.add_sequence(i)
    step = check.session_step(session)
    chosen = run_step(step, cache, ids, workload.prompts)["logits"].argmax(-1).tolist()
    start = time.perf_counter()
    for _ in range(steps):
        chosen = run_step(step, cache, ids, [[t] for t in chosen])["logits"].argmax(-1).tolist()
    return time.perf_counter() - start, chosen


def bench_arch(
    arch: str, batches: list[int], contexts: list[int], steps: int, rounds: int, block_size: int, threads: int
) -> list:
    reference = build_model(arch, 0)
    config = reference.config
    rows = []
    with tempfile.TemporaryDirectory(prefix="pakv-bench-generate-") as tmp:
        example = make_workload(batch=3, new_tokens=2, vocab_size=config.vocab_size, seed=0)
        forms = {}
        for form in ("ort", "pakv"):
            path = Path(tmp) / f"{arch}-{form}.onnx"
            forms[form] = (path, check.export_for(arch, 0, example, block_size, path, attention=form))
        sessions = {
            "ort": (check.make_runner_session("plugin:native", forms["ort"][0], threads), forms["ort"][1]),
            "pakv": (check.make_runner_session("plugin:native", forms["pakv"][0], threads), forms["pakv"][1]),
            check.STOCK_ORT: (check.make_runner_session(check.STOCK_ORT, forms["pakv"][0], threads), forms["pakv"][1]),
        }
        for batch in batches:
            for context in contexts:
                generator = torch.Generator().manual_seed(batch * 1000 + context)
                prompts = torch.randint(0, config.vocab_size, (batch, context), generator=generator)
                paths = {
                    "transformers": lambda prompts=prompts: decode_transformers(reference, prompts, steps),
                    **{
                        name: (lambda s=s, m=m, prompts=prompts: decode_paged(s, m, prompts, steps, block_size))
                        for name, (s, m) in sessions.items()
                    },
                }
                times: dict[str, list[float]] = {name: [] for name in paths}
                for _ in range(rounds + 1):  # the first round is a warm-up
                    last = {}
                    for name, fn in paths.items():
                        seconds, last[name] = fn()
                        times[name].append(seconds)
                    assert len({tuple(t) for t in last.values()}) == 1, f"{arch}: the paths' tokens differ: {last}"
                ms = {name: statistics.median(t[1:]) * 1e3 / (steps * batch) for name, t in times.items()}
                rows.append((arch, batch, context, ms))
                print(
                    f"  .. {arch} B={batch} C={context}: " + ", ".join(f"{k} {v:.3f}" for k, v in ms.items()),
                    flush=True,
                )
    return rows


WRITE_CASES = ((1, 64), (4, 128), (8, 64))  # (batch, context): every case fits in 64 blocks of 16
POOL_BLOCKS = (64, 4096)


def decode_steps(step_fn, config, prompts: torch.Tensor, steps: int, block_size: int, num_blocks: int):
    """``(seconds, last tokens)`` of ``steps`` decode steps of ``step_fn(cache, ids, tokens)`` over fresh
    pools of ``num_blocks`` blocks, after an untimed prefill."""
    cache = PagedKVCache(
        num_layers=config.num_hidden_layers,
        geometry=cache_geometry(config),
        num_blocks=num_blocks,
        block_size=block_size,
    )
    for pool in (*cache.key_pools, *cache.value_pools):
        pool.fill_(0)  # touch every page now, as a server that allocated its pools at start-up
    ids = list(range(prompts.shape[0]))
    for i in ids:
        cache.add_sequence(i)
    chosen = step_fn(cache, ids, prompts.tolist())["logits"].argmax(-1).tolist()
    start = time.perf_counter()
    for _ in range(steps):
        chosen = step_fn(cache, ids, [[t] for t in chosen])["logits"].argmax(-1).tolist()
    return time.perf_counter() - start, chosen


def bench_write(arch: str, cases, steps: int, rounds: int, block_size: int, threads: int) -> list:
    from _host_write import export_host_write, host_write_step

    config = build_model(arch, 0).config
    rows = []
    with tempfile.TemporaryDirectory(prefix="pakv-bench-write-") as tmp:
        graph_path, host_path = Path(tmp) / f"{arch}.onnx", Path(tmp) / f"{arch}_host_write.onnx"
        example = make_workload(batch=3, new_tokens=2, vocab_size=config.vocab_size, seed=0)
        check.export_for(arch, 0, example, block_size, graph_path, attention="pakv")
        cache = new_cache(config, example, block_size, 0)
        for i in range(3):
            cache.add_sequence(i)
        export_host_write(build_model(arch, 0), step_inputs(cache, [0, 1, 2], example.prompts)[2], host_path)
        graph = check.make_runner_session("plugin:native", graph_path, threads)
        host = check.make_runner_session("plugin:native", host_path, threads)
        stock = check.make_runner_session(check.STOCK_ORT, graph_path, threads)
        variants = {
            "host write": (lambda c, i, t: host_write_step(host, c, i, t), POOL_BLOCKS[0]),
            "in-graph": (lambda c, i, t: run_step(session_step(graph), c, i, t), POOL_BLOCKS[0]),
            "in-graph 4096": (lambda c, i, t: run_step(session_step(graph), c, i, t), POOL_BLOCKS[1]),
            "stock": (lambda c, i, t: run_step(session_step(stock), c, i, t), POOL_BLOCKS[0]),
            "stock 4096": (lambda c, i, t: run_step(session_step(stock), c, i, t), POOL_BLOCKS[1]),
        }
        for batch, context in cases:
            generator = torch.Generator().manual_seed(batch * 1000 + context)
            prompts = torch.randint(0, config.vocab_size, (batch, context), generator=generator)
            times: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(rounds + 1):  # the first round is a warm-up
                last = {}
                for name, (fn, blocks) in variants.items():
                    seconds, last[name] = decode_steps(fn, config, prompts, steps, block_size, blocks)
                    times[name].append(seconds)
                assert len({tuple(t) for t in last.values()}) == 1, f"{arch}: the variants' tokens differ: {last}"
            ms = {name: statistics.median(t[1:]) * 1e3 / steps for name, t in times.items()}
            rows.append((arch, batch, context, ms))
            print(f"  .. {arch} B={batch} C={context}: " + ", ".join(f"{k} {v:.3f}" for k, v in ms.items()), flush=True)
    return rows


def print_write_table(rows: list) -> None:
    print()
    print(
        "| arch | batch | context | host write ms/step (64 blocks) | in-graph write (64) | in-graph / host write | "
        "in-graph (4,096 blocks) | 4,096 / 64 | stock ORT (64) | stock ORT (4,096) | stock 4,096 / 64 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for arch, batch, context, ms in rows:
        host, graph, big, stock, stock_big = (
            ms[k] for k in ("host write", "in-graph", "in-graph 4096", "stock", "stock 4096")
        )
        print(
            f"| {arch} | {batch} | {context} | {host:.3f} | {graph:.3f} | {graph / host:.2f} | {big:.3f} | "
            f"{big / graph:.2f} | {stock:.3f} | {stock_big:.3f} | {stock_big / stock:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", choices=("generate", "write", "all"), default="all")
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
    ints = lambda text: [int(x) for x in text.split(",")]
    if args.table in ("write", "all"):
        from _host_write import BASELINE_ARCHS, NO_BASELINE

        write_rows = []
        for arch in args.archs.split(","):
            if arch not in BASELINE_ARCHS:
                print(f"write table: {arch} left out ({NO_BASELINE})")
                continue
            write_rows += bench_write(arch, WRITE_CASES, args.steps, args.rounds, args.block_size, args.threads)
        print_write_table(write_rows)
        if args.table == "write":
            return
    rows = []
    for arch in args.archs.split(","):
        rows += bench_arch(
            arch, ints(args.batches), ints(args.contexts), args.steps, args.rounds, args.block_size, args.threads
        )
    print()
    print(
        "| arch | batch | context | transformers eager ms/token | ort (com.microsoft::PagedAttention) ms/token | "
        "**ort / transformers** | pakv ms/token | pakv / transformers | stock ORT (pakv) ms/token | "
        "stock / transformers |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for arch, batch, context, ms in rows:
        hf, ort, pakv, stock = ms["transformers"], ms["ort"], ms["pakv"], ms[check.STOCK_ORT]
        print(
            f"| {arch} | {batch} | {context} | {hf:.3f} | {ort:.3f} | **{ort / hf:.2f}** | {pakv:.3f} | "
            f"{pakv / hf:.2f} | "
            f"{stock:.3f} | {stock / hf:.2f} |"
        )


if __name__ == "__main__":
    main()
