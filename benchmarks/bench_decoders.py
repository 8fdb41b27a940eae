"""Benchmark: the exported decoder (each layer one com.microsoft::PagedAttention) against ORT GenAI's own
CPU model of the same weights, at two sizes, 1 and 2 intra-op threads, every variant's tokens checked.

Models (benchmarks/_genai.py, one ``save_pretrained`` folder per size, seeded weights):
  tiny  the sample Llama: 2 layers, hidden 128, 4/2 heads x 32, vocab 512
  mid   hidden 1024, 8 layers, 16/4 heads x 64, MLP 2816, vocab 32000 (about 0.6 GB of fp32 weights)
Variants, per row:
  genai      og.Generator over GenAI's builder model (-p fp32 -e cpu: GroupQueryAttention, dense cache)
  engine     og.Engine over ``pakv-onnx export``'s model (prefix caching off)
  dense run  GenAI's graph in a plain onnxruntime session (numpy host; the ORT run alone)
  paged run  the exported graph in a plain onnxruntime session with the plugin (the same host)
``engine / genai`` compares what a user runs (each with its own C++ host: og.Engine schedules and lays
out a paged step, og.Generator a static batch); ``paged run / dense run`` compares the two graphs
under one host. Parts:
  decode   B sequences of C-token prompts: prefill (untimed), then ``--steps`` greedy steps timed one
           by one; per round each variant's median step, the figure the median over rounds
  prefill  one prompt of P tokens: time to the first token (GenAI: append_tokens + the first
           generate_next_token; og.Engine: every run until the token; plain runs: the prefill run)
  kv       the paged graph with fp32, int8 and fp8 pools (``--kv-cache``): decode ms per step at long
           context, pool bytes per token, and greedy-token agreement with fp32 over a prompt set
  precision  the exported model in fp16 and bf16 (``--precision``) against fp32 on the CPU (plain host with
           the plugin): decode ms per step (the kv rows) and prefill (the prefill rows), greedy-token
           agreement with fp32
  calls    what one attention call costs inside each graph's decode step, per layer: the step's time less
           the step time of its twin without attention (``_genai.without_attention``: each attention node
           a Slice of its query), the fused op's against GroupQueryAttention's, the four graphs alternating
           round by round (plain host). One-node sessions of the op (benchmarks/bench_attention.py) keep
           its code and data in caches the model's other nodes evict: this is the call as the model pays it
  fp16     (informational) GenAI's own paged fp16 model (builder -e cuda, made CPU-ready by
           ``pakv-onnx genai-cpu``) under og.Engine beside ours (fp32) under og.Engine: decode and prefill
Variants alternate round by round. ``--clock thread`` (the default for 1-thread rows) times the calling
thread's CPU time (every host runs the model on the calling thread at 1 thread), so other processes'
load drops out; 2-thread rows are wall time. Tokens: every variant's must be equal, and equal to
transformers' greedy decoding for B = 1 rows. Prints Markdown tables of ratios.

    python benchmarks/bench_decoders.py [--sizes tiny,mid] [--parts decode,prefill,kv,precision,calls,fp16] [--threads 1,2]
                                        [--steps 16] [--rounds 3] [--clock auto|wall|thread]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import _genai
import numpy as np
import torch

from pakv_onnx.models.hf.genai import load_hf_model

DECODE_ROWS = {"tiny": [(1, 64), (1, 256), (4, 64), (4, 256), (8, 64), (8, 256)],
               "mid": [(1, 512), (1, 2048), (8, 512), (8, 2048)]}  # fmt: skip
PREFILL_ROWS = {"tiny": [512], "mid": [512, 2048]}
KV_ROWS = {"tiny": [(1, 256), (8, 256)], "mid": [(1, 2048), (8, 2048)]}
KV_KINDS = ("int8", "fp8")
PRECISIONS = ("fp16", "bf16")  # against the fp32 export (the `precision` part)
# Agreement prompt set: AGREE_PROMPTS seeded random prompts of AGREE_LENGTH tokens, AGREE_TOKENS greedy tokens each.
AGREE_PROMPTS, AGREE_LENGTH, AGREE_TOKENS = 16, 64, 32
BLOCK_SIZE = 16
VARIANTS = ("genai", "engine", "dense run", "paged run")


def prompts_for(batch: int, context: int, vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (batch, context)).astype(np.int32)


def transformers_tokens(model, prompts: np.ndarray, steps: int) -> list[list[int]]:
    return _genai.decode_transformers(model, prompts, steps)[1]


class Hosts:
    """The four variants of one size at one thread count (models loaded once)."""

    def __init__(self, folders: _genai.Folders, threads: int) -> None:
        self.dense_model = _genai.og_model(folders.dense, threads=threads)
        self.paged_model = _genai.og_model(folders.paged, threads=threads)
        self.dense_run = _genai.DenseRun(folders.dense, threads)
        self.paged_run = _genai.PagedRun(folders.paged, threads)

    def variants(self, clock):
        return {
            "genai": lambda p, s: _genai.run_generator(self.dense_model, p, s, clock),
            "engine": lambda p, s: _genai.run_engine(self.paged_model, p, s, clock),
            "dense run": lambda p, s: self.dense_run.run(p, s, clock),
            "paged run": lambda p, s: self.paged_run.run(p, s, clock),
        }


def until_eos(rows: list[list[int]], lengths: list[int]) -> list[list[int]]:
    return [row[:n] for row, n in zip(rows, lengths)]


def measure(variants: dict, prompts: np.ndarray, steps: int, rounds: int, want: list | None, label: str,
            reference_name: str = "paged run", agreement: dict | None = None, eos: frozenset = frozenset()):  # fmt: skip
    """``{variant: (median prefill seconds, median decode seconds per step)}`` over ``rounds`` rounds,
    variants alternating; raises when a variant's tokens differ from ``want`` (or from the
    ``reference_name`` variant's), unless ``agreement`` is given: then it collects, per variant, the
    share of its tokens equal to the reference's (fp16 against fp32 may differ where logits are close).
    Tokens are compared up to the reference's first ``eos`` token per sequence: past it each host
    follows its own EOS policy (seen at tiny B=4 C=256, 64 steps: og.Generator ended the sequence and
    repeated EOS, og.Engine gave another token where the plain hosts gave EOS and went on), so the
    tokens there say nothing about the model."""
    prefill: dict[str, list[float]] = {n: [] for n in variants}
    decode: dict[str, list[float]] = {n: [] for n in variants}
    for _ in range(rounds):
        tokens = {}
        for name, run in variants.items():
            first, times, tokens[name] = run(prompts, steps)
            prefill[name].append(first)
            if times:
                decode[name].append(statistics.median(times))
        reference = want if want is not None else [list(map(int, t)) for t in tokens[reference_name]]
        lengths = [next((i for i, t in enumerate(row) if t in eos), len(row)) for row in reference]
        reference = until_eos(reference, lengths)
        differ = [n for n, got in tokens.items() if until_eos([list(map(int, t)) for t in got], lengths) != reference]
        if agreement is not None:
            for name, got in tokens.items():
                pairs = [(int(a), b) for row, want_row in zip(got, reference) for a, b in zip(row, want_row)]
                agreement[name] = sum(a == b for a, b in pairs) / len(pairs)
        elif differ:
            raise AssertionError(f"{label}: {differ} tokens differ ({'transformers' if want else reference_name})")
    return {n: (statistics.median(prefill[n]), statistics.median(decode[n]) if decode[n] else float("nan"))
            for n in variants}  # fmt: skip


def bench_size(size: str, parts: list[str], threads_list: list[int], steps: int, rounds: int, clock_name: str):
    rows = []
    with tempfile.TemporaryDirectory(prefix=f"pakv-bench-decoders-{size}-") as tmp:
        longest = max([c for _, c in DECODE_ROWS[size]] + PREFILL_ROWS[size]) + steps + 2
        blocks = 8 * -(-longest // BLOCK_SIZE) + 8
        extra = {kind: ["--kv-cache", kind] for kind in KV_KINDS} if "kv" in parts else {}
        if "precision" in parts:
            extra.update({p: ["--precision", p] for p in PRECISIONS})
        print(f"  .. {size}: writing the folders ...", flush=True)
        folders = _genai.write_folders(Path(tmp), BLOCK_SIZE, blocks, 8, unfused=False, size=size, extra=extra)
        reference = load_hf_model(folders.hf)
        vocab = reference.config.vocab_size
        eos_id = reference.config.eos_token_id
        eos = frozenset([] if eos_id is None else [eos_id] if isinstance(eos_id, int) else eos_id)
        wants: dict = {}
        for threads in threads_list:
            thread_clock = clock_name == "thread" or (clock_name == "auto" and threads == 1)
            clock = time.thread_time if thread_clock else time.perf_counter
            clock_label = "thread CPU" if clock is time.thread_time else "wall"
            torch.set_num_threads(threads)
            hosts = Hosts(folders, threads)
            variants = hosts.variants(clock)
            if "decode" in parts:
                for batch, context in DECODE_ROWS[size]:
                    prompts = prompts_for(batch, context, vocab, batch * 1000 + context)
                    key = (batch, context, steps)
                    if batch == 1 and key not in wants:
                        wants[key] = transformers_tokens(reference, prompts, steps)
                    result = measure(variants, prompts, steps, rounds, wants.get(key), f"{size} B={batch} C={context}",
                                     eos=eos)  # fmt: skip
                    rows.append(("decode", size, threads, clock_label, f"B={batch} C={context}", result))
                    print(f"  .. {size} t={threads} decode B={batch} C={context}: " +
                          ", ".join(f"{n} {v[1] * 1e3:.3f}" for n, v in result.items()), flush=True)  # fmt: skip
            if "prefill" in parts:
                for tokens in PREFILL_ROWS[size]:
                    prompts = prompts_for(1, tokens, vocab, tokens)
                    key = (1, tokens, 1)
                    if key not in wants:
                        wants[key] = transformers_tokens(reference, prompts, 1)
                    result = measure(variants, prompts, 1, rounds, wants[key], f"{size} prefill {tokens}", eos=eos)
                    rows.append(("prefill", size, threads, clock_label, f"P={tokens}", result))
                    print(f"  .. {size} t={threads} prefill P={tokens}: " +
                          ", ".join(f"{n} {v[0] * 1e3:.1f}" for n, v in result.items()), flush=True)  # fmt: skip
            if "kv" in parts:
                rows += bench_kv(size, folders, threads, clock, clock_label, steps, rounds, vocab)
            if "precision" in parts:
                rows += bench_precision(size, folders, threads, clock, clock_label, steps, rounds, vocab)
            if "calls" in parts:
                rows += bench_calls(size, folders, threads, clock, clock_label, steps, rounds, vocab)
            del hosts, variants
            gc.collect()
        if "kv" in parts:
            rows.append(("agreement", size, 1, "", "", agreement(folders, vocab)))
        if "fp16" in parts:
            rows += bench_fp16(size, folders, threads_list, steps, rounds, clock_name, vocab, wants)
    return rows


def bench_fp16(size, folders, threads_list, steps, rounds, clock_name, vocab, wants) -> list:
    """og.Engine over GenAI's own paged fp16 model (the plugin serving its PagedAttention on the CPU) and
    over ours (fp32): decode ms per step and time to the first token; tokens checked against ours."""
    blocks = 8 * -(-(max(PREFILL_ROWS[size]) + steps + 2) // BLOCK_SIZE) + 8
    fp16 = _genai.write_genai_paged_fp16(folders.hf, folders.hf.parent / "genai-fp16", BLOCK_SIZE, blocks, 8)
    rows = []
    for threads in threads_list:
        thread_clock = clock_name == "thread" or (clock_name == "auto" and threads == 1)
        clock = time.thread_time if thread_clock else time.perf_counter
        models = {"engine": _genai.og_model(folders.paged, threads=threads),
                  "genai fp16": _genai.og_model(fp16, threads=threads)}  # fmt: skip
        variants = {n: (lambda p, s, m=m: _genai.run_engine(m, p, s, clock)) for n, m in models.items()}
        cases = [("decode", b, c, steps) for b, c in DECODE_ROWS[size]]
        cases += [("prefill", 1, p, 1) for p in PREFILL_ROWS[size]]
        for part, batch, context, n in cases:
            prompts = prompts_for(batch, context, vocab, 99 + batch * 1000 + context)
            agree: dict = {}
            result = measure(variants, prompts, n, rounds, None, f"{size} fp16 {part} B={batch} C={context}",
                             reference_name="engine", agreement=agree)  # fmt: skip
            result["agreement"] = (agree["genai fp16"], agree["genai fp16"])
            label = "thread CPU" if clock is time.thread_time else "wall"
            rows.append(("fp16", size, threads, label, f"{part} B={batch} C={context}", result))
            shown = ", ".join(f"{k} {v[0 if part == 'prefill' else 1] * 1e3:.3f}" for k, v in result.items()
                              if k != "agreement")  # fmt: skip
            print(f"  .. {size} t={threads} fp16 {part} B={batch} C={context}: {shown}", flush=True)
    return rows


def bench_kv(size, folders, threads, clock, clock_label, steps, rounds, vocab) -> list:
    """Decode ms/step of the paged graph over fp32, int8 and fp8 pools (plain host), and pool bytes per token."""
    runs = {"fp32": _genai.PagedRun(folders.paged, threads)}
    runs.update({kind: _genai.PagedRun(folders.extra[kind], threads) for kind in KV_KINDS})
    rows = []
    for batch, context in KV_ROWS[size]:
        prompts = prompts_for(batch, context, vocab, 7 + batch * 1000 + context)
        times: dict[str, list[float]] = {n: [] for n in runs}
        for _ in range(rounds):
            for name, run in runs.items():
                times[name].append(statistics.median(run.run(prompts, steps, clock)[1]))
        result = {n: (runs[n].bytes_per_token(), statistics.median(t)) for n, t in times.items()}
        rows.append(("kv", size, threads, clock_label, f"B={batch} C={context}", result))
        print(f"  .. {size} t={threads} kv B={batch} C={context}: " +
              ", ".join(f"{n} {v[1] * 1e3:.3f}" for n, v in result.items()), flush=True)  # fmt: skip
    return rows


def bench_calls(size, folders, threads, clock, clock_label, steps, rounds, vocab) -> list:
    """Per decode row, us per layer that the attention call costs inside each graph's step: the median over
    rounds of (step - the attention-free twin's step) / layers, the fused op's and GroupQueryAttention's."""
    runs = {"paged": _genai.PagedRun(folders.paged, threads), "dense": _genai.DenseRun(folders.dense, threads)}
    for name, run in list(runs.items()):
        bare = _genai.without_attention(run.folder, run.folder.parent / f"{run.folder.name}-no-attention")
        runs[f"{name} bare"] = type(run)(bare, threads)
    layers = json.loads((folders.paged / "genai_config.json").read_text())["model"]["decoder"]["num_hidden_layers"]
    rows = []
    for batch, context in DECODE_ROWS[size]:
        prompts = prompts_for(batch, context, vocab, 5 + batch * 1000 + context)
        per_call: dict[str, list[float]] = {"paged": [], "dense": []}
        for _ in range(rounds):
            step = {name: statistics.median(run.run(prompts, steps, clock)[1]) for name, run in runs.items()}
            for name in per_call:
                per_call[name].append((step[name] - step[f"{name} bare"]) / layers)
        result = {name: statistics.median(t) for name, t in per_call.items()}
        rows.append(("calls", size, threads, clock_label, f"B={batch} C={context}", result))
        print(f"  .. {size} t={threads} calls B={batch} C={context}: fused {result['paged'] * 1e6:.1f} us, "
              f"GQA {result['dense'] * 1e6:.1f} us per layer", flush=True)  # fmt: skip
    return rows


def bench_precision(size, folders, threads, clock, clock_label, steps, rounds, vocab) -> list:
    """The fp32, fp16 and bf16 exports under the plain host (plugin), variants alternating per round: decode
    ms per step (the kv rows) and time to the first token (the prefill rows), and the share of greedy tokens
    equal to fp32's."""
    runs = {"fp32": _genai.PagedRun(folders.paged, threads)}
    runs.update({p: _genai.PagedRun(folders.extra[p], threads) for p in PRECISIONS})
    cases = [("decode", b, c, steps) for b, c in KV_ROWS[size]] + [("prefill", 1, p, 1) for p in PREFILL_ROWS[size]]
    rows = []
    for part, batch, context, n in cases:
        prompts = prompts_for(batch, context, vocab, 31 + batch * 1000 + context)
        first: dict[str, list[float]] = {k: [] for k in runs}
        per_step: dict[str, list[float]] = {k: [] for k in runs}
        tokens = {}
        for _ in range(rounds):
            for name, run in runs.items():
                prefill, times, tokens[name] = run.run(prompts, n, clock)
                first[name].append(prefill)
                per_step[name].append(statistics.median(times) if times else float("nan"))
        pairs = {k: [(a, b) for x, y in zip(tokens[k], tokens["fp32"]) for a, b in zip(x, y)] for k in runs}
        result = {k: (statistics.median(first[k]) if part == "prefill" else statistics.median(per_step[k]),
                      sum(a == b for a, b in pairs[k]) / len(pairs[k])) for k in runs}  # fmt: skip
        rows.append(("precision", size, threads, clock_label, f"{part} B={batch} C={context}", result))
        print(f"  .. {size} t={threads} precision {part} B={batch} C={context}: " +
              ", ".join(f"{k} {v[0] * 1e3:.3f}" for k, v in result.items()), flush=True)  # fmt: skip
    return rows


def agreement(folders, vocab) -> dict:
    """Greedy tokens of int8 / fp8 pools against fp32 pools over the prompt set (plain host, 1 thread):
    ``{kind: (tokens equal / all, sequences fully equal, mean tokens before the first difference)}``."""
    prompts = prompts_for(AGREE_PROMPTS, AGREE_LENGTH, vocab, 12345)
    exact = _genai.PagedRun(folders.paged, 1).run(prompts, AGREE_TOKENS - 1)[2]
    result = {}
    for kind in KV_KINDS:
        got = _genai.PagedRun(folders.extra[kind], 1).run(prompts, AGREE_TOKENS - 1)[2]
        equal = sum(a == b for x, y in zip(exact, got) for a, b in zip(x, y))
        prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(exact, got)]
        result[kind] = (equal / (AGREE_PROMPTS * AGREE_TOKENS), sum(p == AGREE_TOKENS for p in prefix),
                        statistics.mean(prefix))  # fmt: skip
    return result


def _print_variants_table(rows: list, title: str, label: str, which: int, digits: int) -> None:
    """One table of the four variants' times (``which``: 0 prefill, 1 decode step; seconds -> ms) and their ratios."""
    if not rows:
        return
    print(f"\n### {title}\n")
    print(f"| size | threads (clock) | {label} | GenAI og.Generator | og.Engine (ours) | **engine / genai** | "
          "dense run | paged run | **paged / dense run** |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for _, size, threads, clock, row, r in rows:
        g, e, d, p = (r[v][which] * 1e3 for v in VARIANTS)
        print(f"| {size} | {threads} ({clock}) | {row} | {g:.{digits}f} | {e:.{digits}f} | **{e / g:.2f}** | "
              f"{d:.{digits}f} | {p:.{digits}f} | **{p / d:.2f}** |")  # fmt: skip


def _print_part(rows: list, part: str, title: str, columns: str, cells) -> None:
    """One Markdown table of ``part``'s rows: size, threads (clock), row, then ``columns`` filled by ``cells(row,
    result)`` (strings)."""
    chosen = [r for r in rows if r[0] == part]
    if not chosen:
        return
    print(f"\n### {title}\n")
    print(f"| size | threads (clock) | row | {columns} |")
    print("|---|---|---|" + "---:|" * len(columns.split(" | ")))
    for _, size, threads, clock, row, result in chosen:
        print(f"| {size} | {threads} ({clock}) | {row} | " + " | ".join(cells(row, result)) + " |")


def _kv_cells(row: str, r: dict) -> list[str]:
    f, i, e = (r[k][1] * 1e3 for k in ("fp32", "int8", "fp8"))
    return [f"{f:.3f}", f"{i:.3f}", f"{i / f:.2f}", f"{e:.3f}", f"{e / f:.2f}",
            *(f"{r[k][0]:.0f}" for k in ("fp32", "int8", "fp8"))]  # fmt: skip


def _precision_cells(row: str, r: dict) -> list[str]:
    f, h, b = (r[k][0] * 1e3 for k in ("fp32", "fp16", "bf16"))
    return [f"{f:.3f}", f"{h:.3f}", f"{h / f:.2f}", f"{b:.3f}", f"{b / f:.2f}", f"{r['fp16'][1]:.0%}, {r['bf16'][1]:.0%}"]


def _calls_cells(row: str, r: dict) -> list[str]:
    fused, gqa = r["paged"] * 1e6, r["dense"] * 1e6
    return [f"{fused:.1f}", f"{gqa:.1f}", f"**{fused / gqa:.2f}**"]


def _fp16_cells(row: str, r: dict) -> list[str]:
    k = 0 if row.startswith("prefill") else 1
    ours, theirs = r["engine"][k] * 1e3, r["genai fp16"][k] * 1e3
    return [f"{ours:.3f}", f"{theirs:.3f}", f"{theirs / ours:.2f}", f"{r['agreement'][0]:.0%}"]


def print_tables(rows: list, load: tuple[float, float]) -> None:
    print(f"\nload average (1 min) {load[0]:.1f} at the start, {load[1]:.1f} at the end")
    for part, title, label, which, digits in (
        ("decode", "Decode, ms per step (ratios < 1: the exported model is faster)", "row", 1, 3),
        ("prefill", "Prefill: time to the first token, ms (one prompt)", "prompt", 0, 1),
    ):
        _print_variants_table([r for r in rows if r[0] == part], title, label, which, digits)
    _print_part(rows, "kv", "Quantized KV cache: decode ms per step (paged run), pool bytes per token per layer",
                "fp32 ms | int8 ms | int8 / fp32 | fp8 ms | fp8 / fp32 | bytes/token fp32 | int8 | fp8", _kv_cells)
    _print_part(rows, "precision", "Precision on the CPU: decode ms per step / time to the first token ms (plain host, "
                "plugin)", "fp32 | fp16 | fp16 / fp32 | bf16 | bf16 / fp32 | tokens = fp32 fp16, bf16", _precision_cells)
    _print_part(rows, "calls", "The attention call inside the step, us per layer (step less its attention-free twin's)",
                "fused PagedAttention | GroupQueryAttention | **fused / GQA**", _calls_cells)
    _print_part(rows, "fp16", "(Informational) GenAI's own paged fp16 model on the CPU (og.Engine, the plugin) vs ours "
                "(fp32)", "ours fp32 ms | GenAI fp16 ms | fp16 / ours | fp16 tokens = fp32", _fp16_cells)
    for _, size, _, _, _, r in (x for x in rows if x[0] == "agreement"):
        print(f"\nGreedy agreement with fp32 pools ({size}: {AGREE_PROMPTS} prompts of {AGREE_LENGTH} random tokens, "
              f"{AGREE_TOKENS} tokens each): " + "; ".join(
                  f"{k}: {a:.1%} of tokens equal, {full}/{AGREE_PROMPTS} sequences equal throughout, first difference "
                  f"after {prefix:.1f} tokens on average" for k, (a, full, prefix) in r.items()))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,mid")
    parser.add_argument("--parts", default="decode,prefill,kv,precision,calls,fp16")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-rows", default="", help="BxC,... in place of the size's decode rows (1x512,8x2048)")
    parser.add_argument("--prefill-rows", default="", help="P,... in place of the size's prefill prompts")
    parser.add_argument("--clock", choices=("auto", "wall", "thread"), default="auto",
                        help="auto: thread CPU time for 1-thread rows, wall time for more")  # fmt: skip
    args = parser.parse_args()
    split = lambda text: [x for x in text.split(",") if x]
    for size in split(args.sizes):
        if args.decode_rows:
            DECODE_ROWS[size] = KV_ROWS[size] = [tuple(int(x) for x in r.split("x")) for r in split(args.decode_rows)]
        if args.prefill_rows:
            PREFILL_ROWS[size] = [int(x) for x in split(args.prefill_rows)]
    load = os.getloadavg()[0]
    rows = []
    for size in split(args.sizes):
        rows += bench_size(size, split(args.parts), [int(t) for t in split(args.threads)], args.steps, args.rounds,
                           args.clock)  # fmt: skip
    print_tables(rows, (load, os.getloadavg()[0]))


if __name__ == "__main__":
    main()
