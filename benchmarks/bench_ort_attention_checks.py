"""What com.microsoft::PagedAttention's checks cost per call (issue 35): this tree's C library against a
baseline build of it (another commit's ``libpakv_ort.so``), both in one process, timed in alternating
blocks of consecutive calls (benchmarks/_timing.py).

Shape: a decode step, B sequences of one new token each at a context of C positions (``--shape BxC``,
default 1x64), 16 query / 4 KV heads x 64, float32, block size 16, slots derived from an int64 block
table. Rows:

- ``validate``: the C validator alone (``pakv_plan_fused`` on one FusedCall the Python front built),
  the part the checks live in;
- ``ORT run``: a one-node session (the library registered on its own SessionOptions) through an IOBinding
  built once, the pools bound as the cache outputs (in place, as ORT GenAI binds them): validator,
  prologue and attention, ORT's own per-run cost included.

Columns: per-call medians of each library and their difference (this tree minus the baseline).

    python benchmarks/bench_ort_attention_checks.py --baseline /path/to/other/libpakv_ort.so [--shape 1x64]
                                                    [--calls 3000] [--clock wall|thread]
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np
import onnxruntime as ort
import torch
from _timing import blocked_medians_us
from onnx import TensorProto, helper

from pakv_onnx import native_lib
from pakv_onnx.spec import ORT_ATTENTION
from pakv_onnx.validator import plan_ort_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 4, 64, 16


def decode_inputs(batch: int, context: int) -> dict[str, torch.Tensor | None]:
    """``batch`` sequences at ``context`` positions (the last one new), blocks shuffled over the pool."""
    g = torch.Generator().manual_seed(0)
    cols = -(-context // BLOCK)
    blocks = batch * cols + 4
    inputs = dict.fromkeys(ORT_ATTENTION.input_names)
    inputs.update(
        query=torch.randn(batch, HEADS * HEAD_DIM, generator=g),
        key=torch.randn(batch, KV_HEADS * HEAD_DIM, generator=g),
        value=torch.randn(batch, KV_HEADS * HEAD_DIM, generator=g),
        key_cache=torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g),
        value_cache=torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g),
        cumulative_sequence_length=torch.arange(batch + 1, dtype=torch.int64),
        past_seqlens=torch.full((batch,), context - 1, dtype=torch.int64),
        block_table=torch.randperm(blocks, generator=g)[: batch * cols].view(batch, cols).to(torch.int64),
    )
    return inputs


def session_for(library: str, inputs: dict[str, torch.Tensor | None]):
    """A one-node session of the op with ``library`` registered, and a run through a binding built once."""
    names = [n if inputs[n] is not None else "" for n in ORT_ATTENTION.input_names]
    while not names[-1]:
        names.pop()
    outputs = ["output", "key_cache_out", "value_cache_out"]
    node = helper.make_node("PagedAttention", names, outputs, domain="com.microsoft", num_heads=HEADS, kv_num_heads=KV_HEADS)
    elem = {torch.float32: TensorProto.FLOAT, torch.int64: TensorProto.INT64}
    graph = helper.make_graph(
        [node], "decode", [helper.make_tensor_value_info(n, elem[inputs[n].dtype], None) for n in names if n],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)], ir_version=8)
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    np_type = {torch.float32: np.float32, torch.int64: np.int64}
    for name in names:
        if name:
            t = inputs[name]
            binding.bind_input(name, "cpu", 0, np_type[t.dtype], list(t.shape), t.data_ptr())
    out = torch.empty(inputs["query"].shape[0], HEADS * HEAD_DIM)
    binding.bind_output("output", "cpu", 0, np.float32, list(out.shape), out.data_ptr())
    for name in ("key_cache", "value_cache"):
        t = inputs[name]
        binding.bind_output(name + "_out", "cpu", 0, np.float32, list(t.shape), t.data_ptr())
    session.run_with_iobinding(binding)

    def run() -> None:  # holds ``out``: ORT keeps only its address
        session.run_with_iobinding(binding)
        assert out.data_ptr()

    return run


def validator_for(library: str, call_address: int):
    """``pakv_plan_fused`` of ``library`` on the FusedCall at ``call_address`` (0: valid)."""
    lib = ctypes.CDLL(library)
    lib.pakv_plan_fused.argtypes = [ctypes.c_void_p]
    lib.pakv_plan_fused.restype = ctypes.c_int

    def validate() -> None:
        assert lib.pakv_plan_fused(call_address) == 0

    return validate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="another build's libpakv_ort.so")
    parser.add_argument("--shape", default="1x64", help="BxCONTEXT")
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall")
    args = parser.parse_args()
    batch, context = (int(x) for x in args.shape.split("x"))
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    libraries = {"this tree": str(native_lib.library_path()), "baseline": args.baseline}
    inputs = decode_inputs(batch, context)
    plan = plan_ort_attention(tuple(inputs.values()), {"num_heads": HEADS, "kv_num_heads": KV_HEADS})
    call = ctypes.addressof(plan.native[0])
    rows = {
        "validate": {name: validator_for(path, call) for name, path in libraries.items()},
        "ORT run": {name: session_for(path, inputs) for name, path in libraries.items()},
    }
    print(f"com.microsoft::PagedAttention B{batch} C{context}, {args.clock} clock, medians of ~{args.calls} calls (us)")
    print(f"{'row':<10} {'this tree':>10} {'baseline':>10} {'difference':>11}")
    for label, fns in rows.items():
        times = blocked_medians_us(fns, args.calls, clock=clock)
        mine, base = times["this tree"], times["baseline"]
        print(f"{label:<10} {mine:>10.2f} {base:>10.2f} {mine - base:>+11.2f}")


if __name__ == "__main__":
    main()
