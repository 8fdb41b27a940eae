"""``pakv-onnx genai-cpu``: ORT GenAI's own paged model (its builder, ``-e cuda`` with
``use_paged_attention=true``, fp16) served by og.Engine on the CPU with the plugin, nothing changed
but genai_config.json; its tokens equal transformers' (fp32 and fp16), its logits within
:data:`FP16_LOGIT_ATOL` of transformers' fp32 ones.

Quick: the edits on a hand-made paged folder, and the refusals. Slow: the builder's folder (about
10 s to build) under og.Engine and a plain onnxruntime session.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto
from onnx import helper as h

from og_engine import engine_tokens, onnxruntime_genai

from pakv_onnx import cli, native_lib
from pakv_onnx.export import ort_attention_node
from pakv_onnx.models.hf import Workload, generate_reference, genai_cpu, save_sample_folder
from pakv_onnx.models.hf.genai import load_hf_model

# The fp16 graph's last-token logits against transformers' fp32 ones (the sample Llama's logits are
# below 1 in magnitude, where fp16's step is 2^-11 to 2^-10: this is 2 to 4 steps; measured 7.6e-4).
FP16_LOGIT_ATOL = 2e-3
# What the builder writes for a paged model (0.18.0), less what the test does not need.
BUILDER_CONFIG = {
    "model": {
        "context_length": 1024,
        "decoder": {
            "session_options": {"log_id": "onnxruntime-genai",
                                "provider_options": [{"cuda": {"enable_cuda_graph": "0"}}]},
            "filename": "model.onnx", "head_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1,
            "num_key_value_heads": 1,
            "inputs": {"input_ids": "input_ids", "block_table": "block_table",
                       "cumulative_sequence_lengths": "cumulative_sequence_lengths",
                       "past_sequence_lengths": "past_sequence_lengths", "past_key_names": "past_key_values.%d.key",
                       "past_value_names": "past_key_values.%d.value"},
        },
        "type": "llama",
    },
    "engine": {"dynamic_batching": {"block_size": 256, "max_batch_size": 100, "gpu_utilization_factor": 0.6}},
}  # fmt: skip


def paged_folder(root: Path, op_type: str = "PagedAttention") -> Path:
    """A folder shaped like the builder's paged output: its config and a one-node fp16 graph."""
    names = {"query": "qkv", "key_cache": "past_key_values.0.key", "value_cache": "past_key_values.0.value",
             "cumulative_sequence_length": "cumulative_sequence_lengths", "past_seqlens": "past_sequence_lengths",
             "block_table": "block_table"}  # fmt: skip
    node = ort_attention_node(names, ("logits",), num_heads=2, kv_num_heads=1)
    node.op_type = op_type
    pool = [TensorProto.FLOAT16, ["num_blocks", "block_size", 1, 8]]
    graph = h.make_graph(
        [node], "g",
        [h.make_tensor_value_info("qkv", TensorProto.FLOAT16, ["n", 32]),
         h.make_tensor_value_info("past_key_values.0.key", *pool),
         h.make_tensor_value_info("past_key_values.0.value", *pool),
         *(h.make_tensor_value_info(n, TensorProto.INT32, None) for n in list(names.values())[3:])],
        [h.make_tensor_value_info("logits", TensorProto.FLOAT16, None)],
    )  # fmt: skip
    root.mkdir(parents=True, exist_ok=True)
    onnx.save_model(h.make_model(graph, opset_imports=[h.make_opsetid("", 20), h.make_opsetid("com.microsoft", 1)]),
                    str(root / "model.onnx"))  # fmt: skip
    (root / "genai_config.json").write_text(json.dumps(BUILDER_CONFIG))
    return root


def test_genai_cpu_edits_only_the_config_and_says_what(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = paged_folder(tmp_path / "paged")
    model_bytes = (folder / "model.onnx").read_bytes()
    assert cli.main(["genai-cpu", str(folder), "--num-blocks", "40", "--max-batch-size", "4"]) == 0
    out = capsys.readouterr().out
    config = json.loads((folder / "genai_config.json").read_text())
    options = config["model"]["decoder"]["session_options"]
    assert options["provider_options"] == [] and options["custom_ops_library"] == native_lib.LIBRARY_NAME
    assert config["engine"]["dynamic_batching"] == {"block_size": 256, "num_blocks": 40, "max_batch_size": 4}
    assert (folder / native_lib.LIBRARY_NAME).read_bytes() == Path(native_lib.library_path()).read_bytes()
    assert (folder / "model.onnx").read_bytes() == model_bytes
    assert 'provider_options: [{"cuda": {"enable_cuda_graph": "0"}}] -> []' in out
    assert "gpu_utilization_factor: 0.6 -> (removed: num_blocks pins the pool)" in out
    # 1 layer x key and value x 40 blocks x 256 tokens x 1 head x 8 fp16 channels = 320 KiB
    assert "pools: 1 layers x key and value x 40 blocks x 256 tokens x 1 heads x 8 float16 = 0.3 MiB" in out
    assert cli.main(["genai-cpu", str(folder)]) == 0  # again: nothing left to change
    assert "(already set: nothing changed)" in capsys.readouterr().out
    fresh = paged_folder(tmp_path / "default")
    done = genai_cpu.serve_on_cpu(fresh)
    assert done.num_blocks == 4  # one request at context_length 1024 in blocks of 256


@pytest.mark.parametrize(
    "break_it, message",
    [
        (lambda f: (f / "genai_config.json").unlink(), "no genai_config.json"),
        (lambda f: (f / "genai_config.json").write_text("{"), "genai_config.json is not JSON"),
        (lambda f: _edit(f, lambda c: c["model"]["decoder"]["inputs"].pop("block_table")),
         "model.decoder.inputs has no block_table .*use_paged_attention"),
        (lambda f: _edit(f, lambda c: c.pop("engine")), "genai_config.json has no engine.dynamic_batching"),
        (lambda f: paged_folder(f, op_type="GroupQueryAttention"), "model.onnx has no com.microsoft::PagedAttention"),
        (lambda f: (f / "model.onnx").unlink(), "no model file model.onnx"),
    ],
    ids=["no-config", "not-json", "not-paged", "no-engine", "no-paged-attention", "no-model"],
)  # fmt: skip
def test_genai_cpu_refuses_a_folder_that_is_not_a_genai_paged_model(tmp_path, capsys, break_it, message) -> None:
    import re

    folder = paged_folder(tmp_path / "m")
    break_it(folder)
    before = (folder / "genai_config.json").read_bytes() if (folder / "genai_config.json").exists() else None
    assert cli.main(["genai-cpu", str(folder)]) == 2
    assert re.search(f"is not an ORT GenAI paged model: {message}", capsys.readouterr().err)
    after = (folder / "genai_config.json").read_bytes() if (folder / "genai_config.json").exists() else None
    assert after == before and not (folder / native_lib.LIBRARY_NAME).exists()


def two_layer_folder(root: Path, *, logits_from: int, width: int = 16, vocab: int | None = None) -> Path:
    """A builder-shaped folder of two PagedAttention layers whose ``logits`` read layer ``logits_from``'s
    output (the builder's vocab-256 trap wires them to the first layer)."""
    folder = paged_folder(root)
    names = {"key_cache": "past_key_values.%d.key", "value_cache": "past_key_values.%d.value",
             "cumulative_sequence_length": "cumulative_sequence_lengths", "past_seqlens": "past_sequence_lengths",
             "block_table": "block_table"}  # fmt: skip
    nodes = []
    for layer in range(2):
        inputs = {k: v % layer if "%" in v else v for k, v in names.items()}
        node = ort_attention_node({"query": "qkv" if layer == 0 else "h0", **inputs}, (f"h{layer}",),
                                  num_heads=2, kv_num_heads=1)  # fmt: skip
        node.name = f"/model/layers.{layer}/attn/PagedAttention"
        nodes.append(node)
    nodes.append(h.make_node("Identity", [f"h{logits_from}"], ["logits"], name="/lm_head/MatMul"))
    pool = [TensorProto.FLOAT16, ["num_blocks", "block_size", 1, 8]]
    graph = h.make_graph(
        nodes, "g",
        [h.make_tensor_value_info("qkv", TensorProto.FLOAT16, ["n", 32]),
         *(h.make_tensor_value_info(f"past_key_values.{i}.{kv}", *pool) for i in range(2) for kv in ("key", "value")),
         *(h.make_tensor_value_info(n, TensorProto.INT32, None) for n in list(names.values())[2:])],
        [h.make_tensor_value_info("logits", TensorProto.FLOAT16, ["n", width])],
    )  # fmt: skip
    onnx.save_model(h.make_model(graph, opset_imports=[h.make_opsetid("", 20), h.make_opsetid("com.microsoft", 1)]),
                    str(folder / "model.onnx"))  # fmt: skip
    _edit(folder, lambda c: c["model"].update({"vocab_size": vocab or width}))
    _edit(folder, lambda c: c["model"]["decoder"].update({"num_hidden_layers": 2}))
    return folder


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda root: two_layer_folder(root, logits_from=0),
         "its logits are computed from 1 of its 2 layers \\(its LM head /lm_head/MatMul reads h0\\)\\. ORT GenAI's "
         "builder does this when another layer is as wide as the vocabulary"),
        (lambda root: two_layer_folder(root, logits_from=1, width=16, vocab=32),
         "its logits are 16 wide, model.vocab_size is 32"),
    ],
    ids=["logits-from-layer-0", "logits-not-vocab-wide"],
)  # fmt: skip
def test_genai_cpu_refuses_a_graph_that_is_not_the_model_its_config_describes(tmp_path, capsys, make, message) -> None:
    import re

    folder = make(tmp_path / "m")
    before = (folder / "genai_config.json").read_bytes()
    assert cli.main(["genai-cpu", str(folder)]) == 2
    err = capsys.readouterr().err
    assert re.search(f"is not the model its genai_config.json describes: {message}", err), err
    assert (folder / "genai_config.json").read_bytes() == before and not (folder / native_lib.LIBRARY_NAME).exists()
    assert cli.main(["genai-cpu", str(two_layer_folder(tmp_path / "good", logits_from=1))]) == 0


def _edit(folder: Path, change) -> None:
    config = json.loads((folder / "genai_config.json").read_text())
    change(config)
    (folder / "genai_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def builder_folder(tmp_path_factory) -> tuple[Path, Path]:
    """(the HF folder, ORT GenAI's paged fp16 folder of it after ``pakv-onnx genai-cpu``)."""
    onnxruntime_genai()
    root = tmp_path_factory.mktemp("builder")
    hf = save_sample_folder(root / "hf", "llama", 0, vocab_size=512)  # 512: no other Linear's width (builder)
    out = root / "paged"
    run_builder(hf, out, root / "cache")
    assert cli.main(["genai-cpu", str(out), "--num-blocks", "32", "--block-size", "16"]) == 0
    return hf, out


def run_builder(hf: Path, out: Path, cache: Path) -> None:
    """ORT GenAI's builder: ``hf`` -> a paged fp16 model folder ``out`` (for CUDA, as its docs say)."""
    done = subprocess.run(
        [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out), "-p", "fp16",
         "-e", "cuda", "-c", str(cache), "--extra_options", "use_paged_attention=true"],
        capture_output=True, text=True, check=False, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow  # the builder (about 10 s)
def test_genai_cpu_refuses_the_builders_vocab_256_trap(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The sample Llama at vocab 256 (= its intermediate_size): the builder takes the MLP's 256-wide
    layers for the LM head and wires logits to layer 0; genai-cpu refuses it, naming the cause."""
    onnxruntime_genai()
    hf = save_sample_folder(tmp_path / "hf", "llama", 0)  # vocab_size 256, intermediate_size 256
    run_builder(hf, tmp_path / "paged", tmp_path / "cache")
    before = (tmp_path / "paged" / "genai_config.json").read_bytes()
    assert cli.main(["genai-cpu", str(tmp_path / "paged")]) == 2
    err = capsys.readouterr().err
    assert "is not the model its genai_config.json describes: its logits are computed from 1 of its 2 layers" in err
    assert "as wide as the vocabulary (256)" in err
    assert (tmp_path / "paged" / "genai_config.json").read_bytes() == before


WORKLOAD = Workload(
    prompts=[[5, 6, 7, 8, 9, 10, 11], [1, 2, 3], [200, 17, 45, 3, 3, 9, 12, 90, 91, 92, 4, 300, 301, 302, 303, 304]],
    budgets=[8, 6, 8],
)


@pytest.mark.slow  # the builder
def test_og_engine_serves_genai_paged_fp16_model_on_the_cpu(builder_folder) -> None:
    hf, folder = builder_folder
    got = engine_tokens(folder, WORKLOAD)
    assert got == generate_reference(load_hf_model(hf), WORKLOAD).tokens
    assert got == generate_reference(load_hf_model(hf).half(), WORKLOAD).tokens


@pytest.mark.slow  # the builder
def test_genai_paged_fp16_logits_are_transformers_within_fp16(builder_folder) -> None:
    """The folder's model.onnx in a plain session with the plugin: one prefill of three prompts; each
    prompt's last logits within FP16_LOGIT_ATOL of transformers' fp32 ones."""
    import onnxruntime as ort

    hf, folder = builder_folder
    options = ort.SessionOptions()
    options.register_custom_ops_library(native_lib.library_path())
    session = ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])
    feeds = {i.name: np.zeros((8, 16, 2, 32), np.float16) for i in session.get_inputs() if "past_key_values" in i.name}
    cumulative = np.cumsum([0] + [len(p) for p in WORKLOAD.prompts]).astype(np.int32)
    feeds.update(
        input_ids=np.concatenate(WORKLOAD.prompts).astype(np.int64), cumulative_sequence_lengths=cumulative,
        past_sequence_lengths=np.zeros(3, np.int32), block_table=np.array([[0, -1], [1, -1], [2, 3]], np.int32),
        attention_metadata=np.zeros(3, np.int32),
    )  # fmt: skip
    logits = session.run(["logits"], feeds)[0][cumulative[1:] - 1].astype(np.float32)  # one row per token
    reference = generate_reference(load_hf_model(hf), Workload(WORKLOAD.prompts, [1, 1, 1]))
    want = torch.stack([row[0] for row in reference.logits]).numpy()
    assert np.abs(logits - want).max() <= FP16_LOGIT_ATOL


def test_the_command_knows_the_config_file_by_the_module_name() -> None:
    from pakv_onnx.commands import genai_cpu as command  # checks MODEL_DIR before importing onnx

    assert command.GENAI_CONFIG == genai_cpu.GENAI_CONFIG
