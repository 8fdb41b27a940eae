"""``pakv-onnx export --precision fp16|bf16 --execution-provider cpu|cuda``: one model.onnx for both
providers (the bytes are equal; genai_config.json differs in its session options only), refusals by name
before anything is written (pakv_onnx.providers: the precisions, ORT's CUDA kernel's limits), and og.Engine
on the CPU with the plugin serving fp16 and bf16 folders.

fp16 and bf16 against the float32 transformers model, teacher-forced (each precision fed the reference's
tokens, logits compared position by position): og.Engine's tokens equal the reference's up to the first
position where the teacher-forced argmax flips, and every flip is at a near tie of the reference (its top-2
gap printed). The GPU half (the cuda folder under og.Engine on ORT's CUDA kernel) is tests/device/'s.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from og_engine import engine_tokens

from pakv_onnx import cli, providers
from pakv_onnx.models.hf import Workload, build_model, genai, generate, generate_reference, make_config, save_sample_folder
from pakv_onnx.models.hf.cache import PagedKVCache
from pakv_onnx.models.hf.check import NEAR_TIE, PRECISION_LOGIT_ATOL, make_runner_session
from pakv_onnx.models.hf.configs import CacheGeometry
from pakv_onnx.spec import ONNX_TYPE_OF

SEED = 0
ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = Workload(
    prompts=[[5, 6, 7, 8, 9, 10, 11], [1, 2, 3], [200, 17, 45, 3, 3, 9, 12, 90, 91, 92, 4], [77, 78, 79, 80, 81]],
    budgets=[12, 12, 12, 12],
)


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--execution-provider", "cuda"], "--execution-provider cuda cannot run --precision fp32: ORT's CUDA "),
        (["--precision", "fp16", "--execution-provider", "cuda", "--block-size", "24"],
         "cannot run --block-size 24: ORT's CUDA com.microsoft::PagedAttention needs a power of two >= 16"),
        (["--precision", "bf16", "--execution-provider", "cuda", "--block-size", "8"], "--block-size 8"),
        (["--precision", "fp16", "--execution-provider", "cuda", "--attention", "pakv"],
         "--precision fp16 is exported for --attention ort only, not --attention pakv"),
        (["--precision", "bf16", "--attention", "pakv"], "--precision bf16 is exported for --attention ort only"),
    ],
)  # fmt: skip
def test_export_refuses_impossible_options_before_loading_anything(tmp_path, options, message):
    """Refused from the options alone (HF_DIR holds a config and a weights file that are never read): nothing
    written, torch not imported."""
    (tmp_path / "hf").mkdir()
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "hf" / name).write_text("{}")
    code = (
        "import sys; from pakv_onnx import cli; "
        f"rc = cli.main(['export', {str(tmp_path / 'hf')!r}, {str(tmp_path / 'out')!r}, *{options!r}]); "
        "print('torch' in sys.modules); sys.exit(rc)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert message in run.stderr
    assert run.stdout.strip() == "False"  # refused before torch was imported
    assert not (tmp_path / "out").exists()


def test_every_cuda_limit_refuses_its_bad_value_by_name():
    good = providers.ExportTarget("fp16", "ort", 16, "int8", head_size=64, num_heads=8, rotary_dim=64)
    assert providers.export_refusal(good, "cuda") is None
    assert providers.export_refusal(good, "cpu") is None
    bad = {
        "--precision fp32": dict(precision="fp32"),
        "--attention pakv": dict(attention="pakv", precision="fp16"),
        "--block-size 48": dict(block_size=48),
        "head size 36": dict(head_size=36, rotary_dim=0),
        "head size 40": dict(head_size=40, rotary_dim=40),  # a multiple of 8, not of 16 (rotary on)
        "rotary dim 24": dict(rotary_dim=24),
        "rotary offset 4": dict(rotary_offset=4),
        "num_heads 2048": dict(num_heads=2048),
    }
    for shown, change in bad.items():
        message = providers.cuda_refusal(dataclasses.replace(good, **change))
        assert message is not None and f"cannot run {shown}:" in message, (shown, message)
        if "precision" not in change and "attention" not in change:
            assert providers.export_refusal(dataclasses.replace(good, **change), "cpu") is None  # the CPU runs it
    assert {limit.subject for limit in providers.CUDA_LIMITS} >= {s.rsplit(" ", 1)[0] for s in bad}


def test_the_docs_hold_the_cuda_limits_table():
    assert providers.cuda_limits_table() in (ROOT / "docs" / "decoders.md").read_text()


def test_forms_and_kv_kinds_match_the_step():
    from pakv_onnx.models.hf import ort_layer, step

    assert (providers.ORT_FORM, providers.PAKV_FORM) == step.ATTENTION_CHOICES
    assert providers.KV_CACHE_KINDS == tuple(ort_layer.KV_CACHE_DTYPES)


def test_cuda_genai_config_names_orts_provider_and_no_library():
    cuda = genai.genai_config(make_config("llama"), block_size=16, num_blocks=8, max_batch_size=2,
                              execution_provider="cuda", intra_op_threads=1)  # fmt: skip
    cpu = genai.genai_config(make_config("llama"), block_size=16, num_blocks=8, max_batch_size=2, intra_op_threads=1)
    options = cuda["model"]["decoder"].pop("session_options")
    assert options == {"log_id": "onnxruntime-genai", "provider_options": [genai.CUDA_PROVIDER_OPTIONS],
                       "intra_op_num_threads": 1}
    assert cpu["model"]["decoder"].pop("session_options")["custom_ops_library"] == "libpakv_ort.so"
    assert cuda == cpu  # nothing else differs


def test_a_head_size_orts_cuda_kernel_refuses_is_refused_from_the_config(tmp_path, capsys):
    hf = save_sample_folder(tmp_path / "hf", "llama", SEED, head_dim=36)  # 36: not a multiple of 8
    out = tmp_path / "out"
    assert cli.main(["export", str(hf), str(out), "--precision", "fp16", "--execution-provider", "cuda"]) == 2
    assert "--execution-provider cuda cannot run head size 36: ORT's CUDA" in capsys.readouterr().err
    assert not out.exists()


# ------------------------------------------------------------------------------------------------ exports
def export(hf: Path, out: Path, *options: str) -> Path:
    assert cli.main(["export", str(hf), str(out), "--block-size", "16", "--num-blocks", "64", "--threads", "1",
                     *options]) == 0  # fmt: skip
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(arch, precision) -> the folder exported for the CPU."""
    root = tmp_path_factory.mktemp("precision")
    found = {}
    for arch in ("llama", "qwen3", "deepseek"):
        hf = save_sample_folder(root / f"hf-{arch}", arch, SEED)
        for precision in ("fp16", "bf16"):
            found[arch, precision] = export(hf, root / f"{arch}-{precision}", "--precision", precision)
    return found


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "precision"), [("llama", "fp16"), ("deepseek", "bf16")])
def test_one_model_onnx_for_both_providers(tmp_path, folders, arch, precision):
    hf = folders[arch, precision].parent / f"hf-{arch}"
    cuda = export(hf, tmp_path / "cuda", "--precision", precision, "--execution-provider", "cuda")
    cpu = folders[arch, precision]
    assert (cuda / "model.onnx").read_bytes() == (cpu / "model.onnx").read_bytes()
    assert not (cuda / "libpakv_ort.so").exists() and (cpu / "libpakv_ort.so").exists()
    configs = [json.loads((f / "genai_config.json").read_text()) for f in (cpu, cuda)]
    options = [c["model"]["decoder"].pop("session_options") for c in configs]
    assert configs[0] == configs[1]
    assert options[1]["provider_options"] == [{"cuda": {"enable_cuda_graph": "0"}}] and "custom_ops_library" not in options[1]
    model = onnx.load(str(cuda / "model.onnx"))
    t = onnx.TensorProto.FLOAT16 if precision == "fp16" else onnx.TensorProto.BFLOAT16
    pools = [i for i in model.graph.input if i.name.startswith("past_key_values.")]
    assert pools and all(i.type.tensor_type.elem_type == t for i in pools)
    logits = next(o for o in model.graph.output if o.name == "logits")
    assert logits.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    attention = [n for n in model.graph.node if n.op_type == "PagedAttention"]
    assert len(attention) == 2 and all(n.domain == "com.microsoft" for n in attention)
    weights = {i.data_type for i in model.graph.initializer if i.name.endswith("proj.weight")}
    assert weights == {onnx.TensorProto.FLOAT16 if precision == "fp16" else onnx.TensorProto.FLOAT}


@pytest.mark.slow
def test_kv_cache_int8_with_fp16_runs_on_both_providers(tmp_path, folders):
    hf = folders["llama", "fp16"].parent / "hf-llama"
    cuda = export(hf, tmp_path / "cuda", "--precision", "fp16", "--kv-cache", "int8", "--execution-provider", "cuda")
    cpu = export(hf, tmp_path / "cpu", "--precision", "fp16", "--kv-cache", "int8")
    assert (cuda / "model.onnx").read_bytes() == (cpu / "model.onnx").read_bytes()
    model = onnx.load(str(cpu / "model.onnx"))
    assert next(i for i in model.graph.input if i.name == "past_key_values.0.key").type.tensor_type.elem_type == (
        onnx.TensorProto.INT8
    )
    assert engine_tokens(cpu, WORKLOAD) == reference("llama").tokens  # og.Engine on the CPU with the plugin


_REFERENCES: dict[str, generate.Generation] = {}


def reference(arch: str) -> generate.Generation:
    """float32 transformers' greedy generation of :data:`WORKLOAD` (tokens and logits)."""
    if arch not in _REFERENCES:
        _REFERENCES[arch] = generate_reference(build_model(arch, SEED), WORKLOAD)
    return _REFERENCES[arch]


def forced(folder: Path, tokens: list[list[int]]) -> generate.Generation:
    """The folder's model.onnx (ORT + the plugin, pools as its inputs declare them) fed the prompts and then
    ``tokens``."""
    path = folder / "model.onnx"
    graph = onnx.load(str(path), load_external_data=False).graph
    pool = next(i for i in graph.input if i.name == "past_key_values.0.key").type.tensor_type
    dims = [d.dim_value for d in pool.shape.dim]
    dtype = {v: k for k, v in ONNX_TYPE_OF.items()}[pool.elem_type]
    layers = sum(1 for i in graph.input if i.name.endswith(".key"))
    cache = PagedKVCache(num_layers=layers, geometry=CacheGeometry(tuple(dims[2:]), tuple(dims[2:])),
                         num_blocks=64, block_size=dims[1], dtype=dtype, seed=SEED)  # fmt: skip
    step = generate.session_step(make_runner_session("plugin:native", path, intra_op_threads=1))
    return generate.teacher_forced(step, cache, WORKLOAD.prompts, tokens)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek"])
def test_og_engine_serves_the_folder_on_the_cpu(folders, arch, precision):
    """og.Engine (CPU + plugin) against float32 transformers: the teacher-forced logits within the
    precision's tolerance, og.Engine's tokens equal up to the first teacher-forced flip of each request, and
    every flip at a near tie (printed with its top-2 gap)."""
    want = reference(arch)
    got = engine_tokens(folders[arch, precision], WORKLOAD)
    worst, flipped = generate.flips(forced(folders[arch, precision], want.tokens), want)
    first_flip = {}
    for flip in flipped:
        first_flip.setdefault(flip.sequence, flip.position)
    print(f"{arch} {precision}: max |logit - fp32| {worst:.4f}; og.Engine tokens "
          f"{'identical' if got == want.tokens else 'differ'}; flips (sequence, position, top-2 gap): "
          f"{[(f.sequence, f.position, round(f.top2_gap, 4)) for f in flipped]}")  # fmt: skip
    assert worst <= PRECISION_LOGIT_ATOL[precision]
    assert all(f.top2_gap <= NEAR_TIE for f in flipped)
    for i, (mine, ref) in enumerate(zip(got, want.tokens)):
        agree = first_flip.get(i, len(ref))  # at a flip og.Engine's run may go either way, then it differs
        assert mine[:agree] == ref[:agree], (i, mine, ref)


# ------------------------------------------------------------------------------------------------ generate
def test_generate_passes_a_half_precision_run_only_with_flips_at_near_ties():
    from pakv_onnx.models.hf.check import RunnerResult
    from pakv_onnx.models.hf.generate import Flip

    near, far = Flip(0, 3, NEAR_TIE / 2, 0.001), Flip(1, 2, NEAR_TIE * 4, 0.003)
    same = dict(tokens_match=True, max_logit_err=0.001, ms_per_token=1.0)
    assert RunnerResult("r", **same, precision="fp16").passed
    assert not RunnerResult("r", **same, precision="fp32").passed  # 0.001 is past fp32's bound
    parted = dict(tokens_match=False, max_logit_err=0.001, ms_per_token=1.0, precision="bf16")
    assert RunnerResult("r", **parted, flips=(near,), agree_to_flips=True).passed
    assert not RunnerResult("r", **parted, flips=(near, far), agree_to_flips=True).passed  # a real difference
    assert not RunnerResult("r", **parted, flips=(near,), agree_to_flips=False).passed  # parted before the flip
    assert not RunnerResult("r", **{**parted, "max_logit_err": PRECISION_LOGIT_ATOL["bf16"] * 2}, flips=()).passed


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "precision"), [("deepseek", "fp16"), ("qwen3", "bf16")])
def test_generate_checks_the_step_in_half_precision(arch, precision, capsys):
    code = cli.main(["generate", "--arch", arch, "--precision", precision, "--batch", "3", "--new-tokens", "8", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0, out
    assert out["runners"]["plugin:native"]["max_logit_err"] <= PRECISION_LOGIT_ATOL[precision]
