"""``pakv-onnx export``: a Hugging Face folder becomes an ORT GenAI model folder that og.Engine serves
on a CPU with continuous batching, and that a plain onnxruntime host (no torch, no pakv_onnx) decodes
with; every request's tokens equal transformers' greedy generate.

Tests that use the ``genai_dir`` fixture are slow (one export per arch, ~10-40 s each on the shared
machine): every arch in the default ``ort`` form (each layer one com.microsoft::PagedAttention;
DeepSeek-V3 over one LATENT pool), and Llama and DeepSeek-V3 in the ``pakv`` form (DeepSeek-V3's
latent in two halves across the pools of one shape). og.Engine serves each with prefix caching on
and off. The og.Engine tests need onnxruntime-genai (the ``genai`` extra, which CI installs: under
CI a missing package fails instead of skipping).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from og_engine import onnxruntime_genai
from onnx_graphs import assert_one_ort_attention_per_layer, pakv_nodes

from pakv_onnx import cli
from pakv_onnx.models.hf import Workload, build_model, genai, generate_reference, make_config, save_sample_folder
from pakv_onnx.models.hf.fusion import op_counts

SEED = 0
BLOCK_SIZE = 4
NUM_BLOCKS = 64
HERE = Path(__file__).resolve().parent
# Main-graph op counts of the exported 2-layer Llama step (fused).
# The fused Llama step's main graph, every node (80; 115 before the token-major attention). Per layer
# (19): SkipSimplifiedLayerNormalization (the first layer's norm is 6 standard nodes ORT fuses at
# load), MatMul + Split (q/k/v), RotaryEmbedding + Reshape (q, k), Reshape (v), ScatterPaKvCache,
# PagedAttention, Reshape + MatMul (o), SkipSimplifiedLayerNormalization, MatMul + Split (gate/up),
# Sigmoid, Mul, Mul, MatMul (down). The rest: positions and slots, the rotary angles, the embedding,
# the LM head (Gather of the last rows, Gemm).
FUSED_COUNTS = {
    "Reshape": 9, "MatMul": 8, "Mul": 7, "Unsqueeze": 5, "Cast": 5,
    "com.microsoft::SkipSimplifiedLayerNormalization": 4, "com.microsoft::RotaryEmbedding": 4, "Split": 4,
    "Gather": 3, "Add": 3, "pakv::ScatterPaKvCache": 2, "pakv::PagedAttention": 2, "Sub": 2, "Slice": 2,
    "Sigmoid": 2, "Div": 2, "Squeeze": 1, "Sqrt": 1, "Sin": 1, "Shape": 1, "ReduceSum": 1, "ReduceMean": 1,
    "Range": 1, "Pow": 1, "Mod": 1, "GreaterOrEqual": 1, "Gemm": 1, "GatherND": 1, "GatherElements": 1,
    "Floor": 1, "Cos": 1, "Concat": 1,
}  # fmt: skip


# The ort-form Llama step's main graph, every node (33; GenAI's builder writes 33 for its dense CPU model):
# per layer SkipSimplifiedLayerNormalization (the first layer's norm is 6 standard nodes ORT fuses at
# load), Gemm (packed q/k/v), PagedAttention, Gemm (o), SkipSimplifiedLayerNormalization, Gemm (gate),
# Gemm (up), Sigmoid, Mul, Mul, Gemm (down); then the embedding, the last rows (Slice, Sub, Gather), the
# LM head. No position or slot is computed.
ORT_COUNTS = {
    "Gemm": 11, "Mul": 5, "com.microsoft::SkipSimplifiedLayerNormalization": 4, "Gather": 2,
    "com.microsoft::PagedAttention": 2, "Sigmoid": 2, "Pow": 1, "ReduceMean": 1, "Add": 1, "Sqrt": 1, "Div": 1,
    "Slice": 1, "Sub": 1,
}  # fmt: skip


# The exported folders: "<arch>" in the ort form (the default), "<arch>-pakv" in the pakv form.
FOLDERS = ["llama", "qwen2", "mistral", "qwen3", "deepseek", "llama-pakv", "deepseek-pakv"]


def arch_of(folder: Path) -> str:
    return folder.name.split("-")[0]


@pytest.fixture(scope="module", params=FOLDERS)
def genai_dir(request, tmp_path_factory) -> Path:
    """The exported folder of the param (its name is the folder's: the arch, "-pakv" for that form)."""
    root = tmp_path_factory.mktemp("genai")
    arch, _, form = request.param.partition("-")
    hf = save_sample_folder(root / "hf", arch, SEED)  # seeded weights + a WordLevel tokenizer
    out = root / request.param
    code = cli.main(
        [
            "export", str(hf), str(out), "--block-size", str(BLOCK_SIZE), "--num-blocks", str(NUM_BLOCKS),
            "--max-batch-size", "8", "--threads", "1", "--external-data", *(["--attention", form] if form else []),
        ]
    )  # fmt: skip
    assert code == 0
    return out


def reference(workload: Workload, arch: str) -> list[list[int]]:
    return generate_reference(build_model(arch, SEED), workload).tokens


def test_config_follows_genai_paged_convention() -> None:
    """genai_config without an export: the names og.Engine binds, the paged state group, the plugin."""
    config = genai.genai_config(make_config("llama"), block_size=8, num_blocks=100, max_batch_size=4)
    decoder = config["model"]["decoder"]
    assert config["engine"] == {"dynamic_batching": {"block_size": 8, "num_blocks": 100, "max_batch_size": 4}}
    assert decoder["state_groups"] == [{"kind": "paged_kv", "layer_ids": [0, 1]}]
    assert decoder["session_options"]["custom_ops_library"] == "libpakv_ort.so"
    assert (decoder["num_key_value_heads"], decoder["head_size"]) == (2, 32)  # the pools og.Engine allocates
    assert decoder["inputs"] == {
        "input_ids": "input_ids",
        "block_table": "block_table",
        "cumulative_sequence_lengths": "cumulative_sequence_lengths",
        "past_sequence_lengths": "past_sequence_lengths",
        "past_key_names": "past_key_values.%d.key",
        "past_value_names": "past_key_values.%d.value",
    }
    assert decoder["outputs"]["present_key_names"] == "present.%d.key"


def test_deepseek_config_lays_the_latent_out() -> None:
    """ort form: og.Engine allocates both pools [num_blocks, block_size, 1, 576], the latent whole in the
    key pool (LATENT; the value pool goes unread). pakv form: [.., 1, 288]: c_kv's first 288 columns in
    the key pool, the other 224 and k_pe's 64 in the value pool."""
    config = genai.genai_config(make_config("deepseek"), block_size=8, num_blocks=100, max_batch_size=4)
    decoder = config["model"]["decoder"]
    assert (decoder["num_key_value_heads"], decoder["head_size"]) == (1, 512 + 64)
    config = genai.genai_config(
        make_config("deepseek"), block_size=8, num_blocks=100, max_batch_size=4, attention="pakv"
    )
    decoder = config["model"]["decoder"]
    assert (decoder["num_key_value_heads"], decoder["head_size"]) == (1, (512 + 64) // 2)


def test_config_writes_prefix_caching_only_when_asked() -> None:
    config = genai.genai_config(make_config("llama"), block_size=8, num_blocks=100, max_batch_size=4)
    assert "prefix_caching" not in config["engine"]["dynamic_batching"]  # og.Engine's default
    for value in (True, False):
        config = genai.genai_config(
            make_config("llama"), block_size=8, num_blocks=100, max_batch_size=4, prefix_caching=value
        )
        assert config["engine"]["dynamic_batching"]["prefix_caching"] is value


def test_export_refuses_a_model_og_engine_cannot_serve(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from transformers import AutoModelForCausalLM

    odd = make_config("deepseek")
    odd.kv_lora_rank = 511  # a 575-wide latent has no two equal halves (the pakv form's two pools)
    with pytest.raises(genai.UnsupportedModelError, match="deepseek_v3: the latent is kv_lora_rank 511 .* odd"):
        genai.genai_config(odd, block_size=8, num_blocks=8, max_batch_size=2, attention="pakv")
    assert genai.genai_config(odd, block_size=8, num_blocks=8, max_batch_size=2)["model"]["decoder"]["head_size"] == 575
    assert cli.main(["export", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    assert "nothing: no such folder" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    AutoModelForCausalLM.from_config(odd).save_pretrained(tmp_path / "odd")
    code = cli.main(["export", str(tmp_path / "odd"), str(tmp_path / "out"), "--attention", "pakv"])
    assert code == 2  # refused before any export
    assert "og.Engine allocates both pools of a layer as one shape" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # the module's exports
def test_export_writes_a_genai_folder(genai_dir: Path) -> None:
    names = {p.name for p in genai_dir.iterdir()}
    assert {"model.onnx", "model.onnx.data", "genai_config.json", "libpakv_ort.so", "tokenizer.json"} <= names
    assert "tokenizer_config.json" in names  # the source folder's tokenizer files, copied
    assert (genai_dir / "model.onnx").stat().st_size < (genai_dir / "model.onnx.data").stat().st_size  # --external-data
    config = json.loads((genai_dir / "genai_config.json").read_text())
    assert config["model"]["decoder"]["session_options"]["intra_op_num_threads"] == 1
    model = onnx.load(str(genai_dir / "model.onnx"))
    arch, pakv = arch_of(genai_dir), genai_dir.name.endswith("-pakv")
    if pakv:
        reader = {"llama": "PagedAttention", "deepseek": "GatherPaKvCache"}[arch]  # GQA attends in one op
        assert [n.op_type for n in pakv_nodes(model.graph)] == ["ScatterPaKvCache", reader] * 2
        if arch == "llama":
            assert dict(op_counts(model)) == FUSED_COUNTS  # fused (the default): every node counted
    else:
        assert_one_ort_attention_per_layer(model, 2, latent=arch == "deepseek")
        if arch == "llama":
            assert dict(op_counts(model)) == ORT_COUNTS
    rows = {"deepseek": [1, 288] if pakv else [1, 576]}.get(arch, [2, 32])  # [kv heads, head size] of both pools
    for name in ("past_key_values.0.key", "past_key_values.0.value"):
        pool = next(i for i in model.graph.input if i.name == name).type.tensor_type
        assert [d.dim_value for d in pool.shape.dim][1:] == [BLOCK_SIZE, *rows]


def og_engine(genai_dir: Path, prefix_caching: bool):
    """og.Engine over the folder with ``engine.dynamic_batching.prefix_caching`` set (og.Config.overlay)."""
    og = onnxruntime_genai()
    config = og.Config(str(genai_dir))
    config.overlay(json.dumps({"engine": {"dynamic_batching": {"prefix_caching": prefix_caching}}}))
    return og, og.Engine(og.Model(config))


@pytest.mark.slow  # the module's exports
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_og_engine_serves_ragged_requests_with_one_joining_mid_run(genai_dir: Path, prefix_caching: bool) -> None:
    """Three ragged requests start; a fourth is added while they run and joins the running batch; then
    the longest prompt again, and one sharing its first 8 tokens (two full blocks: with prefix caching
    og.Engine adopts their cached blocks and runs only the rest). Every request's greedy tokens equal
    transformers' generate."""
    og, engine = og_engine(genai_dir, prefix_caching)
    import numpy as np

    long = [200, 17, 45, 3, 3, 9, 12, 90, 91, 92, 4]
    workload = Workload(
        prompts=[[5, 6, 7, 8, 9, 10, 11], [1, 2, 3], long, [77, 78, 79, 80, 81], long, long[:8] + [60, 61, 62]],
        budgets=[9, 12, 6, 8, 5, 7],
    )
    want = reference(workload, arch_of(genai_dir))
    requests, order = [], []  # keep a reference to every request: og closes unreferenced ones

    def submit(k: int) -> None:
        request = engine.create_request()
        options = og.TurnOptions(request)
        options.set_do_sample(False)
        options.set_max_generated_tokens(workload.budgets[k])
        options.set_min_generated_tokens(workload.budgets[k])  # no early stop at eos
        request.begin_turn(np.array(workload.prompts[k], dtype=np.int32), options)
        requests.append(request)

    for k in range(3):
        submit(k)
    got: list[list[int]] = [[] for _ in workload.prompts]
    events = engine.create_event_buffer(64)
    while engine.has_pending_requests():
        for event in engine.run(events):
            k = next(i for i, r in enumerate(requests) if r == event.request or r is event.request)
            got[k].append(int(event.token))
            order.append(k)
        if len(requests) == 3 and min(len(t) for t in got[:3]) >= 2:
            submit(3)  # the others are mid-generation
        if len(requests) == 4 and len(got[2]) == workload.budgets[2]:
            submit(4)  # the long prompt again, once its first run has finished
            submit(5)
    assert got == want
    first_of_late = order.index(3)
    assert any(k != 3 for k in order[first_of_late + 1 :]), "the late request ran alone, not in the batch"
    assert len(order[:first_of_late]) < sum(workload.budgets[:3])  # it started before the others finished


@pytest.mark.slow  # the module's exports
def test_plain_onnxruntime_host_decodes_like_transformers(genai_dir: Path, tmp_path: Path) -> None:
    """onnxruntime + numpy only (no torch, no pakv_onnx imported), pools bound as input and present."""
    workload = Workload(
        prompts=[[9, 8, 7, 6, 5, 4], [3, 1], [100, 101, 102, 103, 104, 105, 106, 107, 108]], budgets=[6, 9, 4]
    )
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"prompts": workload.prompts, "budgets": workload.budgets, "num_blocks": NUM_BLOCKS}))
    result = subprocess.run(
        [sys.executable, str(HERE / "plain_ort_host.py"), str(genai_dir / "model.onnx"),
         str(genai_dir / "libpakv_ort.so"), str(job)],
        check=False, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["imported"] == []
    assert report["tokens"] == reference(workload, arch_of(genai_dir))
