"""A host with no Python logic of the project: greedy decoding through an exported paged step in a
plain onnxruntime session (onnxruntime + numpy only: no torch, no pakv_onnx), the way a C++, C# or
Triton host drives it.

    python plain_ort_host.py MODEL.onnx LIBRARY.so JOB.json   ->  {"tokens": [[...], ...]} on stdout

JOB.json: ``{"prompts": [[ids], ...], "budgets": [n, ...], "num_blocks": N}``. The host keeps a
free list of blocks, lays out each step in ORT GenAI's paged convention (packed ``input_ids``,
``cumulative_sequence_lengths``, ``past_sequence_lengths``, a -1 padded ``block_table``) and binds
every pool as an input *and* its ``present`` output to the same OrtValue, so the graph's write op
writes the step's rows into the pools; the host never writes them.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import onnxruntime as ort

# ORT's name of a pool's element type -> (numpy dtype of its bytes, ONNX TensorProto element type).
POOL_TYPES = {"tensor(float)": (np.float32, 1), "tensor(int8)": (np.int8, 3), "tensor(float8e4m3fn)": (np.uint8, 17)}


def main(model_path: str, library: str, job_path: str) -> dict:
    with open(job_path) as f:
        job = json.load(f)
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model_path, options, providers=["CPUExecutionProvider"])
    num_blocks = job["num_blocks"]
    pools, block_size = {}, None
    for spec in session.get_inputs():
        if spec.name.startswith("past_key_values."):
            _, block_size, heads, dim = spec.shape  # block size and widths are static in the graph
            # Pools in the graph's element type (float8 through its bytes: numpy has no float8).
            numpy_type, onnx_type = POOL_TYPES[spec.type]
            pool = np.zeros((num_blocks, block_size, heads, dim), dtype=numpy_type)
            pools[spec.name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(pool, onnx_type)
    free = list(range(num_blocks))
    prompts, budgets = job["prompts"], job["budgets"]
    pending = [list(p) for p in prompts]
    cached = [0] * len(prompts)
    blocks: list[list[int]] = [[] for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    while live:
        for i in live:  # reserve the blocks this step's tokens need
            need = -(-(cached[i] + len(pending[i])) // block_size) - len(blocks[i])
            blocks[i] += [free.pop() for _ in range(need)]
        width = max(len(blocks[i]) for i in live)
        table = np.full((len(live), width), -1, dtype=np.int32)
        for row, i in enumerate(live):
            table[row, : len(blocks[i])] = blocks[i]
        ids = np.array([t for i in live for t in pending[i]], dtype=np.int64)
        cumulative = np.cumsum([0] + [len(pending[i]) for i in live]).astype(np.int32)
        past = np.array([cached[i] for i in live], dtype=np.int32)
        binding = session.io_binding()
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("cumulative_sequence_lengths", cumulative)
        binding.bind_cpu_input("past_sequence_lengths", past)
        binding.bind_cpu_input("block_table", table)
        binding.bind_output("logits")  # ORT allocates it; first bound, so get_outputs()[0]
        for name, pool in pools.items():
            binding.bind_ortvalue_input(name, pool)
            binding.bind_ortvalue_output(name.replace("past_key_values.", "present."), pool)  # the same buffer
        session.run_with_iobinding(binding)
        logits = binding.get_outputs()[0].numpy()
        for row, i in enumerate(live):
            cached[i] += len(pending[i])
            chosen = int(np.argmax(logits[row]))
            tokens[i].append(chosen)
            pending[i] = [chosen]
        for i in [i for i in live if len(tokens[i]) == budgets[i]]:
            free += blocks[i]
            live.remove(i)
    leaked = sorted(m for m in ("torch", "pakv_onnx") if m in sys.modules)
    return {"tokens": tokens, "imported": leaked}


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4])))
