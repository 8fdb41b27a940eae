"""Benchmark: a ragged workload under og.Engine, the paged model vs ORT GenAI's dense one.

One workload of ``--requests`` greedy requests (prompt lengths and generation lengths each spread
over a 4x range, shuffled; ``--join`` of them submitted only once the engine has emitted a given
number of tokens, i.e. mid-run), replayed on two engines built from one ``save_pretrained`` folder
(benchmarks/_genai.py: a tiny Llama, vocab 512, seeded weights), 1 intra-op thread each:
  paged   ``og.Engine`` over ``pakv-onnx export``'s model: continuous batching (requests join the
          running batch between steps, up to ``--max-batch``)
  dense   ``og.Engine`` over GenAI's builder model (``-p fp32 -e cpu``): its static scheduler on a
          CPU runs at most 4 requests per batch and finishes a batch before the next starts
Figure: the workload's total time (first submit to last token; engine construction left out; ``--clock
thread``, the default: the calling thread's CPU time, on which og.Engine runs the model at 1 intra-op
thread, so other processes' load drops out; ``wall``: wall time), median over ``--rounds`` rounds,
engines alternating round by round (og.Engine's prefix caching off); also steps
(``engine.run`` calls), the most requests one step served, tokens per second. Every request's
tokens must equal transformers' greedy ``generate`` (EOS off: ``eos_token_id: []`` in both
engines' config, so no request stops early).

    python benchmarks/bench_engine.py [--requests 16] [--join 4] [--prompts 32,128] [--generate 16,64]
                                      [--rounds 5] [--max-batch 16] [--clock thread|wall]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import _genai
import numpy as np

from pakv_onnx.models.hf import Workload, generate_reference
from pakv_onnx.models.hf.genai import load_hf_model


def spread(low: int, high: int, count: int, rng: random.Random) -> list[int]:
    """``count`` lengths evenly over ``[low, high]``, shuffled."""
    values = [round(low + (high - low) * i / max(1, count - 1)) for i in range(count)]
    rng.shuffle(values)
    return values


def make_workload(requests: int, prompts: tuple[int, int], generate: tuple[int, int], vocab: int, seed: int):
    rng = random.Random(seed)
    lengths, budgets = spread(*prompts, requests, rng), spread(*generate, requests, rng)
    return Workload([[rng.randrange(vocab) for _ in range(n)] for n in lengths], budgets)


def join_points(workload: Workload, join: int) -> dict[int, int]:
    """Late request index -> the emitted-token count at which it is submitted (spread over the first
    half of the workload's tokens): the same points for both engines."""
    first = len(workload.prompts) - join
    half = workload.generated_tokens // 2
    return {first + k: (k + 1) * half // (join + 1) for k in range(join)}


def serve(model, workload: Workload, joins: dict[int, int], clock=time.perf_counter) -> tuple[float, int, int, list]:
    """``(seconds, steps, most requests in one step, tokens per request)`` of ``workload`` on a
    fresh ``og.Engine`` of ``model``."""
    import onnxruntime_genai as og

    engine = og.Engine(model)
    requests: list = [None] * len(workload.prompts)  # og closes a request nobody references

    def submit(k: int) -> None:
        request = engine.create_request()
        options = og.TurnOptions(request)
        options.set_do_sample(False)
        options.set_max_generated_tokens(workload.budgets[k])
        request.begin_turn(np.array(workload.prompts[k], dtype=np.int32), options)
        requests[k] = request

    tokens: list[list[int]] = [[] for _ in workload.prompts]
    events = engine.create_event_buffer(4 * len(workload.prompts))
    pending = dict(joins)
    emitted = steps = widest = 0
    start = clock()
    for k in range(len(workload.prompts)):
        if k not in joins:
            submit(k)
    while engine.has_pending_requests() or pending:
        done = engine.run(events)
        steps += 1
        widest = max(widest, len(done))
        for event in done:
            k = next(i for i, r in enumerate(requests) if r is not None and r == event.request)
            tokens[k].append(int(event.token))
        emitted += len(done)
        for k in [k for k, at in pending.items() if emitted >= at]:
            submit(k)
            del pending[k]
    return clock() - start, steps, widest, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--join", type=int, default=4, help="requests submitted mid-run")
    parser.add_argument("--prompts", default="32,128", help="prompt lengths: min,max")
    parser.add_argument("--generate", default="16,64", help="generated tokens per request: min,max")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-batch", type=int, default=16, help="the paged engine's max_batch_size")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clock", choices=("thread", "wall"), default="thread")
    args = parser.parse_args()
    pair = lambda text: tuple(int(x) for x in text.split(","))
    with tempfile.TemporaryDirectory(prefix="pakv-bench-engine-") as tmp:
        workload = make_workload(args.requests, pair(args.prompts), pair(args.generate), _genai.GENAI_VOCAB, args.seed)
        joins = join_points(workload, args.join)
        blocks = sum(-(-(len(p) + b) // args.block_size) for p, b in zip(workload.prompts, workload.budgets))
        folders = _genai.write_folders(Path(tmp), args.block_size, blocks + 8, args.max_batch, unfused=False)
        reference = generate_reference(load_hf_model(folders.hf), workload).tokens
        models = {"paged": _genai.og_model(folders.paged), "dense": _genai.og_model(folders.dense)}
        load = os.getloadavg()[0]
        runs: dict[str, list] = {name: [] for name in models}
        for round_ in range(args.rounds + 1):  # the first round is a warm-up
            for name, model in models.items():
                clock = time.thread_time if args.clock == "thread" else time.perf_counter
                seconds, steps, widest, tokens = serve(model, workload, joins, clock)
                wrong = [k for k, (got, want) in enumerate(zip(tokens, reference)) if got != want]
                if wrong:
                    raise AssertionError(f"{name}: requests {wrong} differ from transformers' greedy generate")
                if round_:
                    runs[name].append((seconds, steps, widest))
        print(
            f"\n{args.requests} requests ({args.join} join mid-run), prompts {min(map(len, workload.prompts))}-"
            f"{max(map(len, workload.prompts))} tokens, generating {min(workload.budgets)}-{max(workload.budgets)} "
            f"({workload.generated_tokens} tokens in all); tokens identical to transformers; {args.clock} clock; "
            "load average "
            f"{load:.1f} -> {os.getloadavg()[0]:.1f}"
        )
        print("| engine | total ms | steps | most requests in a step | ms/step | tokens/s | total / dense |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        dense_total = statistics.median(r[0] for r in runs["dense"])
        for name, rows in runs.items():
            total = statistics.median(r[0] for r in rows)
            steps, widest = rows[0][1], max(r[2] for r in rows)
            print(
                f"| {name} | {total * 1e3:.1f} | {steps} | {widest} | {total * 1e3 / steps:.3f} | "
                f"{workload.generated_tokens / total:.0f} | **{total / dense_total:.2f}** |"
            )


if __name__ == "__main__":
    main()
