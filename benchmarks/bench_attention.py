"""Benchmark of the attention core (issue 29): pakv::PagedAttention against its floors and against
ORT's own CPU GroupQueryAttention, in one run.

Shapes: the issue's Llama (16 query / 4 KV heads x 64), a paged pool of block size 16 (``--block-size``;
vLLM's page, the smallest GenAI's builder accepts: its default is 256), blocks shuffled over the pool.

- decode: B sequences (1 and 8) each at a context of 512 / 2048 / 8192 positions, one new token each;
- prefill: one prompt of 512 / 2048 / 4096 tokens (causal, no past);

each with fp32 and bf16 caches (the query of the caches' dtype, as pakv::PagedAttention takes it),
on ORT's intra_op_num_threads 1 and 2.

Columns:
- ``paged``: pakv::PagedAttention in a one-node ORT session (IOBinding built once, output bound).
- ``floor``: decode: the K/V bytes the step reads over this machine's single-thread copy bandwidth,
  measured in the same run on a buffer of those bytes (torch ``copy_``, 1 thread: bytes copied per
  second); prefill: the causal FLOPs (2 x QK^T + 2 x PV multiply-adds over the visible half) over the
  fp32 GEMM rate torch.matmul reaches on 1 thread on one head's dense products of a 512-token tile
  ([512, D] x [D, 512] and [512, 512] x [512, D]: cache-resident, so the core's compute rate, not the
  memory's; a bigger dense S x S would be memory-bound and flatter the kernel).
- ``GQA``: com.microsoft.GroupQueryAttention in a one-node ORT session on the same shapes with a dense
  cache [B, kvH, ctx, D] shared between past and present (no copy of the past: its in-place path),
  which also writes the new tokens' K/V (rotary off). ORT's CPU GQA has no bfloat16 kernel: the bf16
  rows run it in float16 (the same bytes per element).
- ratios: ``paged / floor`` (goal decode <= 1.3; prefill: ``floor / paged`` is the share of the GEMM
  rate, goal >= 0.5) and ``paged / GQA`` (goal <= 1.0).

The rows above time one session over one pool: at B8 ctx 512 its 8 MiB of K/V stay in this machine's
32 MiB L3 from call to call, which flatters the paged core (memory-bound) far more than GQA
(compute-bound). ``--only model`` (also in the default run) times what a decoder's step runs instead:

- ``fused``: com.microsoft::PagedAttention as the exported decoder calls it (query the packed QKV
  projection ``[N, (Hq + 2 Hk) x D]``, rotary from cos/sin caches, the new rows written into its
  pools, the cache outputs bound to the pools), fp32;
- ``GQA``: GroupQueryAttention as ORT GenAI's builder emits it (packed QKV, ``do_rotary`` with cos/sin
  caches, past and present one ``[B, Hk, max, D]`` buffer: genai_config's past_present_share_buffer);
  both ops' cos/sin caches are initializers, as in the models;

each over ``--layers`` (8) separate sessions and buffers called in turn, as a step calls its layers
(each layer's data evicted by the others', as in the model); per-layer figures. ``hot`` repeats the
first layer's session alone (the old rows' way), to show the difference. Shapes: the mid-size Llama
(16 / 4 heads x 64; ``1x64t`` rows: the tiny Llama's 4 / 2 heads x 32).

Every variant of a row is timed in alternating blocks of consecutive calls (benchmarks/_timing.py);
the figures are per-call medians. Other processes on the machine slow everything alike: read ratios.
``--clock thread`` times the calling thread's CPU time instead of wall time, for the 1-thread rows
only (every 1-thread variant runs on the calling thread): on a machine other processes load, the
ratios of time actually spent computing (a loaded machine's wall time is mostly waiting for a core).

    python benchmarks/bench_attention.py [--calls 40] [--only decode|prefill|model] [--dtypes fp32,bf16]
                                         [--clock wall|thread]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import onnx
import onnxruntime as ort
import torch
from _timing import blocked_medians_us
from onnx import TensorProto, helper

from pakv_onnx import runtime_plugin
from pakv_onnx.export import cap_ir_version, make_attention_model_for

HEADS, KV_HEADS, DIM = 16, 4, 64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GEMM_TOKENS = 512  # the prefill floor's GEMM tile (tokens)
GQA_TYPE = {torch.float32: (TensorProto.FLOAT, torch.float32), torch.bfloat16: (TensorProto.FLOAT16, torch.float16)}


# --------------------------------------------------------------------------- #
# Inputs
# --------------------------------------------------------------------------- #
def paged_inputs(batch: int, past: int, new: int, dtype: torch.dtype, block_size: int) -> dict[str, torch.Tensor]:
    """pakv::PagedAttention's feeds: `batch` sequences of `past` + `new` positions in a shuffled pool."""
    gen = torch.Generator().manual_seed(0)
    cols = -(-(past + new) // block_size)
    blocks = batch * cols
    pool = (blocks, block_size, KV_HEADS, DIM)
    return {
        "query": torch.randn(batch * new, HEADS, DIM, generator=gen).to(dtype),
        "key_cache": torch.randn(pool, generator=gen).to(dtype),
        "value_cache": torch.randn(pool, generator=gen).to(dtype),
        "block_table": torch.randperm(blocks, generator=gen).to(torch.int32).reshape(batch, cols),
        "cumulative_sequence_lengths": torch.arange(batch + 1, dtype=torch.int32) * new,
        "past_sequence_lengths": torch.full((batch,), past, dtype=torch.int32),
    }


def paged_runner(feeds: dict[str, torch.Tensor], threads: int):
    model = make_attention_model_for(*feeds.values(), fallback=False)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = runtime_plugin.make_session(model, sess_options=options)
    q = feeds["query"]
    out = {"output": torch.empty(q.shape[0], HEADS, DIM, dtype=q.dtype)}
    binding = runtime_plugin.bind(session, feeds, out=out)
    return lambda: session.run_with_iobinding(binding)


def gqa_model(elem: int) -> bytes:
    names = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"]
    types = [elem] * 5 + [TensorProto.INT32] * 2
    inputs = [helper.make_tensor_value_info(n, t, None) for n, t in zip(names, types)]
    outputs = [helper.make_tensor_value_info(n, elem, None) for n in ("output", "present_key", "present_value")]
    node = helper.make_node(
        "GroupQueryAttention", names, ["output", "present_key", "present_value"], domain="com.microsoft",
        num_heads=HEADS, kv_num_heads=KV_HEADS,
    )  # fmt: skip
    graph = helper.make_graph([node], "gqa", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return cap_ir_version(model).SerializeToString()


def gqa_runner(batch: int, past: int, new: int, dtype: torch.dtype, threads: int):
    """GroupQueryAttention over a dense cache of past + new positions, past and present one buffer."""
    elem, torch_type = GQA_TYPE[dtype]
    gen = torch.Generator().manual_seed(1)
    total = past + new
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(gqa_model(elem), options, providers=["CPUExecutionProvider"])
    tensors = {
        "query": torch.randn(batch, new, HEADS * DIM, generator=gen).to(torch_type),
        "key": torch.randn(batch, new, KV_HEADS * DIM, generator=gen).to(torch_type),
        "value": torch.randn(batch, new, KV_HEADS * DIM, generator=gen).to(torch_type),
        "past_key": torch.randn(batch, KV_HEADS, total, DIM, generator=gen).to(torch_type),
        "past_value": torch.randn(batch, KV_HEADS, total, DIM, generator=gen).to(torch_type),
        "seqlens_k": torch.full((batch,), total - 1, dtype=torch.int32),
        "total_sequence_length": torch.tensor(total, dtype=torch.int32),
    }
    binding = session.io_binding()
    for name, t in tensors.items():
        binding.bind_input(name, "cpu", 0, runtime_plugin.onnx_type_of(t.dtype), list(t.shape), t.data_ptr())
    out = torch.empty(batch, new, HEADS * DIM, dtype=torch_type)
    binding.bind_output("output", "cpu", 0, elem, list(out.shape), out.data_ptr())
    for name in ("key", "value"):  # present = past: ORT's shared-buffer path writes the new rows in place
        t = tensors[f"past_{name}"]
        binding.bind_output(f"present_{name}", "cpu", 0, elem, list(t.shape), t.data_ptr())
    binding.pakv_keep = (tensors, out)
    return lambda: session.run_with_iobinding(binding)


# --------------------------------------------------------------------------- #
# Floors
# --------------------------------------------------------------------------- #
def copy_runner(nbytes: int):
    """A copy of `nbytes` (the decode floor's measure of bandwidth; torch runs on 1 thread here)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)

    return lambda: dst.copy_(src)


def gemm_runner(tokens: int):
    """One head's dense QK^T and PV products with torch.matmul, 1 thread (the prefill floor's rate)."""
    q, k, v = torch.randn(tokens, DIM), torch.randn(tokens, DIM), torch.randn(tokens, DIM)
    scores = torch.empty(tokens, tokens)
    out = torch.empty(tokens, DIM)

    def gemm():
        torch.matmul(q, k.T, out=scores)
        torch.matmul(scores, v, out=out)

    return gemm


# --------------------------------------------------------------------------- #
# Model rows: the fused op and GenAI's GQA as a decoder's layers call them
# --------------------------------------------------------------------------- #
MODEL_POSITIONS = 4096  # the cos/sin caches' rows (the mid Llama's max_position_embeddings)
MODEL_HEADS = {"mid": (16, 4, 64), "tiny": (4, 2, 32)}


def rotary_caches(dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos / sin caches ``[MODEL_POSITIONS, dim / 2]`` (rope base 10000)."""
    inverse = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.outer(torch.arange(MODEL_POSITIONS).float(), inverse)
    return angles.cos().contiguous(), angles.sin().contiguous()


def with_initializers(model, constants: dict[str, torch.Tensor]):
    """``model`` with the graph inputs named in ``constants`` turned into initializers of those values (as the
    decoders hold their rotary caches)."""
    from onnx import numpy_helper

    graph = model.graph
    kept = [i for i in graph.input if i.name not in constants]
    del graph.input[:]
    graph.input.extend(kept)
    graph.initializer.extend(numpy_helper.from_array(t.numpy(), name) for name, t in constants.items())
    return model


def fused_layer(batch: int, context: int, heads: tuple[int, int, int], block_size: int, seed: int):
    """One layer's com.microsoft::PagedAttention decode call (1 thread): ``batch`` sequences at ``context``
    positions after the write, each sequence's blocks consecutive in a pool of exactly their blocks."""
    from pakv_onnx.export.ort_attention import make_ort_attention_model_for

    q_heads, kv_heads, dim = heads
    gen = torch.Generator().manual_seed(seed)
    cols = -(-context // block_size)
    pool = (batch * cols, block_size, kv_heads, dim)
    cos, sin = rotary_caches(dim)
    feeds = {
        "query": torch.randn(batch, (q_heads + 2 * kv_heads) * dim, generator=gen),
        "key_cache": torch.randn(pool, generator=gen),
        "value_cache": torch.randn(pool, generator=gen),
        "cumulative_sequence_length": torch.arange(batch + 1, dtype=torch.int32),
        "past_seqlens": torch.full((batch,), context - 1, dtype=torch.int32),
        "block_table": torch.arange(batch * cols, dtype=torch.int32).reshape(batch, cols),
        "cos_cache": cos,
        "sin_cache": sin,
    }
    model = make_ort_attention_model_for(feeds, num_heads=q_heads, kv_num_heads=kv_heads, do_rotary=1,
                                         scale=dim**-0.5)  # fmt: skip
    rotary = {name: feeds.pop(name) for name in ("cos_cache", "sin_cache")}
    model = with_initializers(model, rotary)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = runtime_plugin.make_session(model, sess_options=options)
    out = {"output": torch.empty(batch, q_heads * dim), "key_cache_out": feeds["key_cache"],
           "value_cache_out": feeds["value_cache"]}  # fmt: skip
    binding = runtime_plugin.bind(session, feeds, out=out)
    binding.pakv_keep = (feeds, out)
    return lambda: session.run_with_iobinding(binding)


def genai_gqa_model(q_heads: int, kv_heads: int, dim: int) -> bytes:
    """GroupQueryAttention as GenAI's builder emits it: packed QKV (key, value left out), rotary."""
    names = ["query", "", "", "past_key", "past_value", "seqlens_k", "total_sequence_length", "cos_cache", "sin_cache"]
    types = {"seqlens_k": TensorProto.INT32, "total_sequence_length": TensorProto.INT32}
    inputs = [helper.make_tensor_value_info(n, types.get(n, TensorProto.FLOAT), None) for n in names if n]
    outputs = ["output", "present_key", "present_value"]
    node = helper.make_node("GroupQueryAttention", names, outputs, domain="com.microsoft", num_heads=q_heads,
                            kv_num_heads=kv_heads, scale=dim**-0.5, do_rotary=1, local_window_size=-1)  # fmt: skip
    graph = helper.make_graph([node], "gqa", inputs, [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model.SerializeToString()


def genai_gqa_layer(batch: int, context: int, heads: tuple[int, int, int], block_size: int, seed: int):
    """One layer's GroupQueryAttention decode call (1 thread) over GenAI's shared past / present buffer
    ``[B, Hk, context + block_size, D]`` (a little room past the context, as og.Generator's max_length)."""
    q_heads, kv_heads, dim = heads
    gen = torch.Generator().manual_seed(seed)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    cos, sin = rotary_caches(dim)
    model = with_initializers(onnx.load_from_string(genai_gqa_model(*heads)), {"cos_cache": cos, "sin_cache": sin})
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    past = (batch, kv_heads, context + block_size, dim)
    tensors = {
        "query": torch.randn(batch, 1, (q_heads + 2 * kv_heads) * dim, generator=gen),
        "past_key": torch.randn(past, generator=gen),
        "past_value": torch.randn(past, generator=gen),
        "seqlens_k": torch.full((batch,), context - 1, dtype=torch.int32),
        "total_sequence_length": torch.tensor(context, dtype=torch.int32),
    }
    out = torch.empty(batch, 1, q_heads * dim)
    binding = session.io_binding()
    for name, t in tensors.items():
        binding.bind_input(name, "cpu", 0, runtime_plugin.onnx_type_of(t.dtype), list(t.shape), t.data_ptr())
    binding.bind_output("output", "cpu", 0, TensorProto.FLOAT, list(out.shape), out.data_ptr())
    for name in ("key", "value"):
        t = tensors[f"past_{name}"]
        binding.bind_output(f"present_{name}", "cpu", 0, TensorProto.FLOAT, list(t.shape), t.data_ptr())
    binding.pakv_keep = (tensors, out)
    return lambda: session.run_with_iobinding(binding)


def model_row(batch, context, heads, block_size, calls, layers, clock):
    """Per-layer us: each variant's ``layers`` layers called in turn (one timed call), and ``hot``: its
    first layer alone."""
    fns = {}
    for name, make in (("fused", fused_layer), ("gqa", genai_gqa_layer)):
        calls_of = [make(batch, context, heads, block_size, seed) for seed in range(layers)]
        fns[f"{name} hot"] = calls_of[0]
        fns[name] = lambda calls_of=calls_of: [call() for call in calls_of]
    times = blocked_medians_us(fns, calls, block=4, clock=clock)
    return {name: t / (1 if name.endswith("hot") else layers) for name, t in times.items()}


# --------------------------------------------------------------------------- #
# Rows
# --------------------------------------------------------------------------- #
def decode_row(batch, context, dtype, block_size, calls, threads_list, clock):
    feeds = paged_inputs(batch, context - 1, 1, dtype, block_size)
    kv_bytes = 2 * batch * context * KV_HEADS * DIM * feeds["key_cache"].element_size()
    fns = {"floor": copy_runner(kv_bytes)}
    for threads in threads_list:
        fns[f"paged{threads}"] = paged_runner(feeds, threads)
        fns[f"gqa{threads}"] = gqa_runner(batch, context - 1, 1, dtype, threads)
    block = max(3, min(30, int(2e5 / max(1, kv_bytes // 1000))))
    times = blocked_medians_us(fns, calls, block=block, clock=clock)
    return times, times["floor"], f"{kv_bytes / 2**20:.1f} MiB"


def prefill_row(tokens, dtype, block_size, calls, threads_list, clock):
    feeds = paged_inputs(1, 0, tokens, dtype, block_size)
    flops = 2 * HEADS * DIM * tokens * (tokens + 1)  # QK^T and PV, each 2 x D per visible (query, key) pair
    dense_flops = 2 * 2 * GEMM_TOKENS * GEMM_TOKENS * DIM  # one head's two dense GEMMs of a tile
    fns = {"gemm": gemm_runner(GEMM_TOKENS)}
    for threads in threads_list:
        fns[f"paged{threads}"] = paged_runner(feeds, threads)
        fns[f"gqa{threads}"] = gqa_runner(1, 0, tokens, dtype, threads)
    times = blocked_medians_us(fns, calls, warmup=1, block=3, clock=clock)
    rate = dense_flops / times["gemm"]  # flops per us
    return times, flops / rate, f"{rate / 1e3:.0f} GFLOP/s GEMM"


def format_rows(label, dtype_name, times, floor_us, note, decode: bool, threads_list):
    rows = []
    for threads in threads_list:
        paged, gqa = times[f"paged{threads}"], times[f"gqa{threads}"]
        # decode: time over floor (goal <= 1.3); prefill: floor over time = share of the GEMM rate (goal >= 0.5).
        versus_floor = paged / floor_us if decode else floor_us / paged
        rows.append(
            f"| {label} | {dtype_name} | {threads} | {paged / 1e3:.3f} | {floor_us / 1e3:.3f} ({note}) | "
            f"{versus_floor:.2f} | {gqa / 1e3:.3f} | {paged / gqa:.2f} |"
        )
    return rows


def print_model_rows(args, clock) -> None:
    print(f"| model row (1 thread, {args.layers} layers) | fused us | GQA us | fused / GQA | fused hot us | GQA hot us "
          "| hot fused / GQA |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for spec in args.model.split(","):
        size = "tiny" if spec.endswith("t") else "mid"
        batch, context = (int(x) for x in spec.rstrip("t").split("x"))
        heads = MODEL_HEADS[size]
        t = model_row(batch, context, heads, args.block_size, args.calls, args.layers, clock)
        print(f"| {size} {heads[0]}/{heads[1]}x{heads[2]} B{batch} ctx {context} | {t['fused']:.1f} | {t['gqa']:.1f} | "
              f"{t['fused'] / t['gqa']:.2f} | {t['fused hot']:.1f} | {t['gqa hot']:.1f} | "
              f"{t['fused hot'] / t['gqa hot']:.2f} |", flush=True)  # fmt: skip
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=40, help="timed calls per variant (decode rows)")
    parser.add_argument("--prefill-calls", type=int, default=6, help="timed calls per variant (prefill rows)")
    parser.add_argument("--only", choices=["decode", "prefill", "model"], default=None)
    parser.add_argument("--model", default="1x64t,1x64,1x512,8x512,8x2048",
                        help="model rows, BxCONTEXT (suffix t: the tiny Llama's heads)")
    parser.add_argument("--layers", type=int, default=8, help="layers of the model rows")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--decode", default="1x512,1x2048,1x8192,8x512,8x2048,8x8192", help="BxCONTEXT,...")
    parser.add_argument("--prefill", default="512,2048,4096", help="TOKENS,...")
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall")
    args = parser.parse_args()
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    threads_list = (1,) if args.clock == "thread" else (1, 2)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the floors are single-thread measures
    load = os.getloadavg()
    print(f"# attention core: 16/4 heads x 64, block size {args.block_size}; {args.clock} clock; load average "
          f"{load[0]:.2f} ({os.cpu_count()} CPUs), {time.strftime('%Y-%m-%d %H:%M')}\n")  # fmt: skip
    if args.only in (None, "model"):
        print_model_rows(args, clock)
        if args.only == "model":
            return
    print("| case | cache | threads | paged ms | floor ms | paged vs floor | GQA ms | paged / GQA |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        if args.only != "prefill":
            for spec in args.decode.split(","):
                batch, context = (int(x) for x in spec.split("x"))
                times, floor, note = decode_row(batch, context, dtype, args.block_size, args.calls, threads_list, clock)
                label = f"decode B{batch} ctx {context}"
                for line in format_rows(label, name, times, floor, note, True, threads_list):
                    print(line, flush=True)
        if args.only != "decode":
            for tokens in (int(x) for x in args.prefill.split(",")):
                times, floor, note = prefill_row(tokens, dtype, args.block_size, args.prefill_calls, threads_list, clock)
                for line in format_rows(f"prefill {tokens}", name, times, floor, note, False, threads_list):
                    print(line, flush=True)
    load = os.getloadavg()
    print(f"\nload average at the end {load[0]:.2f}; decode: paged / floor (goal <= 1.3); prefill: floor / paged = "
          "share of the GEMM rate (goal >= 0.5); paged / GQA goal <= 1.0")  # fmt: skip


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
