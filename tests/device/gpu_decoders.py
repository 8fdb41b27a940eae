"""The GPU check's third part: exported decoders through og.Engine on the CUDA EP (ORT's own
PagedAttention kernel) against og.Engine on the CPU EP with the plugin, the same model.onnx.

Per arch x precision (x quantized pools where the export offers them): ``pakv-onnx export HF OUT
--precision P --execution-provider cuda`` and ``... cpu`` from one sample Hugging Face folder, then 4
ragged requests x 24 greedy tokens through og.Engine on each; tokens identical, or, where a request's
tokens differ, the flip teacher-forced: the CPU's tokens up to it prefilled into empty pools through
each folder's model.onnx (ORT's CUDA kernel; the CPU with the plugin), the logits there compared --
the CPU's top-2 gap against the largest logit difference (a near tie when the gap is the smaller).
Exports use block size 16 (ORT's kernel: a power of two >= 16).

It needs the export options ``--precision`` and ``--execution-provider`` (issue 36, items 1 and 2) and
onnxruntime-genai(-cuda); without either this part is skipped, saying which. --dry-run runs one CPU
folder against itself (the default float32 export while the options are missing): the export, engine
and teacher-forcing code, not a GPU.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import torch

ARCHS = ("llama", "qwen3", "mistral", "deepseek")
PRECISIONS = ("fp16", "bf16")
KV_CACHES = ("int8", "fp8")  # combined with fp16 (ORT's kernel: quantized pools with T float16 / bfloat16)
PROMPTS = ([5, 6, 7, 8, 9, 10, 11], [1, 2, 3], [200, 17, 45, 3, 3, 9, 12, 90, 91, 92, 4], [77, 78, 79, 80, 81])
NEW_TOKENS = 24


def export_options() -> set[str]:
    """The options `pakv-onnx export` has (read from its --help)."""
    from pakv_onnx import cli

    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
        cli.main(["export", "--help"])
    return {word.strip(",[]") for word in text.getvalue().split() if word.startswith("--")}


def missing_requirements(exporting: bool = True) -> tuple[str | None, bool]:
    """(why this part cannot run, or None; whether the export has the precision options). Without
    ``exporting`` (the folders were exported elsewhere) only onnxruntime_genai is needed."""
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return "onnxruntime_genai is not installed (onnxruntime-genai-cuda on a GPU): exported decoders skipped", False
    if not exporting:
        return None, True
    options = export_options()
    lacking = [o for o in ("--precision", "--execution-provider") if o not in options]
    if lacking:
        return f"`pakv-onnx export` has no {' / '.join(lacking)} yet (issue 36 items 1-2): exported decoders skipped", False
    return None, True


def export(hf: Path, out: Path, precision: str, provider: str, kv: str | None, options: bool = True) -> None:
    from pakv_onnx import cli

    argv = ["export", str(hf), str(out), "--block-size", "16", "--num-blocks", "64", "--max-batch-size", "8"]
    if options:
        argv += ["--precision", precision, "--execution-provider", provider]
    if kv:
        argv += ["--kv-cache", kv]
    code = cli.main(argv)
    if code != 0:
        raise RuntimeError(f"pakv-onnx {' '.join(argv)} exited {code}")


def generate(folder: Path) -> list[list[int]]:
    """og.Engine over the folder: the prompts at once, greedy, each request's first NEW_TOKENS + 1
    tokens (benchmarks/_genai.run_engine, which keeps every request going that long)."""
    import _genai
    import numpy as np
    import onnxruntime_genai as og

    prompts = [np.array(prompt, dtype=np.int32) for prompt in PROMPTS]
    _, _, tokens = _genai.run_engine(og.Model(og.Config(str(folder))), prompts, NEW_TOKENS)
    return tokens


POOL_DTYPES = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16, "tensor(bfloat16)": torch.bfloat16,
               "tensor(int8)": torch.int8, "tensor(float8e4m3fn)": torch.float8_e4m3fn}  # fmt: skip


def last_logits(folder: Path, tokens: list[int], device: str) -> np.ndarray:
    """The logits after ``tokens``, one sequence prefilled into empty pools through the folder's
    model.onnx: on "cuda" ORT's own kernels (CUDA EP alone), on "cpu" the CPU EP with the plugin.
    Float32 [vocab]."""
    import onnxruntime as ort

    from pakv_onnx import runtime_plugin

    path = str(folder / "model.onnx")
    if device == "cpu":
        session = runtime_plugin.make_session(path)
    else:
        session = ort.InferenceSession(path, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    feeds, out = {}, {}
    for spec in session.get_inputs():
        if spec.name.startswith("past_key_values."):
            _, block_size, heads, dim = spec.shape  # static in the graph
            blocks = -(-len(tokens) // block_size)
            feeds[spec.name] = torch.zeros(blocks, block_size, heads, dim, dtype=POOL_DTYPES[spec.type], device=device)
            out[spec.name.replace("past_key_values.", "present.")] = feeds[spec.name]
    feeds.update(input_ids=torch.tensor(tokens, dtype=torch.int64),
                 cumulative_sequence_lengths=torch.tensor([0, len(tokens)], dtype=torch.int32),
                 past_sequence_lengths=torch.tensor([0], dtype=torch.int32),
                 block_table=torch.arange(blocks, dtype=torch.int32)[None])  # fmt: skip
    got = runtime_plugin.run(session, feeds, ["logits", *out], out)
    return got["logits"][-1].float().cpu().numpy()


def teacher_forced(cpu: Path, cuda: Path, prompt: list[int], tokens: list[int], at: int, devices=("cpu", "cuda")) -> dict:
    """The flip at ``at``: both models' logits after the prompt and the CPU's tokens before it."""
    context = prompt + tokens[:at]
    a, b = last_logits(cpu, context, devices[0]), last_logits(cuda, context, devices[1])
    top = np.sort(a)[-2:]
    return {"at": at, "cpu_top2_gap": float(top[1] - top[0]), "max_logit_difference": float(np.abs(a - b).max()),
            "argmax": [int(a.argmax()), int(b.argmax())], "cpu_argmax_is_its_token": int(a.argmax()) == tokens[at],
            "near_tie": bool(top[1] - top[0] <= np.abs(a - b).max())}  # fmt: skip


def first_difference(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    """Per request, the first position where the tokens differ (None: identical)."""
    return [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), None if len(p) == len(q) else min(len(p), len(q)))
            for p, q in zip(a, b)]  # fmt: skip


def variants(quick: bool, dry_run: bool):
    if dry_run:  # the code path once, on the CPU
        yield ARCHS[0], PRECISIONS[0], None
        return
    for arch in ARCHS:
        for precision in PRECISIONS:
            yield arch, precision, None
        if not quick:
            for kv in KV_CACHES:
                yield arch, "fp16", kv


def folder_name(arch: str, precision: str, kv: str | None, provider: str) -> str:
    return f"{arch}-{precision}-{kv or 't'}-{provider}"


def export_folders(quick: bool, out: Path) -> list[str]:
    """Every variant's CPU and CUDA folders exported into ``out`` (`gpu_check.py --export-decoders`):
    on a machine with the `hf` extra, for a GPU machine whose transformers is older than the
    package's (FACTS §14's image has 5.17; the extra asks >= 5.24). Returns the folder names."""
    names = []
    for arch, precision, kv in variants(quick, dry_run=False):
        for provider in ("cpu", "cuda"):
            names.append(folder_name(arch, precision, kv, provider))
            export(sample_folder(out, arch), out / names[-1], precision, provider, kv)
    return names


def sample_folder(work: Path, arch: str) -> Path:
    """The sample Hugging Face folder of ``arch`` under ``work``, saved on first use."""
    hf = work / f"hf-{arch}"
    if not hf.exists():
        from pakv_onnx.models.hf import save_sample_folder

        save_sample_folder(hf, arch, 0)
    return hf


def run_decoders(target, quick: bool, work: Path, exported: Path | None = None) -> dict:
    """Each variant: og.Engine on the CUDA folder (CUDA EP) against the CPU folder (plugin). The
    folders come from ``exported`` (made by ``export_folders``) when given, else are exported here."""
    reason, has_options = missing_requirements(exporting=exported is None)
    if reason and not (target.dry_run and has_options is False and "no --precision" in reason):
        return {"skipped": reason, "rows": []}

    rows = []
    for arch, precision, kv in variants(quick, target.dry_run):
        label = f"{arch} {precision}" + (f" {kv} pools" if kv else "") + ("" if has_options else " (float32: no --precision yet)")
        try:
            cpu, cuda = (folder_for(target, work, exported, arch, precision, kv, provider, has_options)
                         for provider in ("cpu", "cuda"))  # fmt: skip
            want = generate(cpu)
            if target.dry_run:  # no CUDA EP here: the CPU folder against itself
                cuda, got, devices = cpu, generate(cpu), ("cpu", "cpu")
            else:
                devices = ("cpu", "cuda")
                assert "cuda" in json.dumps(json.loads((cuda / "genai_config.json").read_text())).lower(), "not a CUDA folder"
                got = generate(cuda)
            flips = first_difference(want, got)
            # Each flip teacher-forced; in a dry run the first token of the first request, to run the code.
            forced = [(k, at) for k, at in enumerate(flips) if at is not None] or ([(0, 0)] if target.dry_run else [])
            ties = [teacher_forced(cpu, cuda, list(PROMPTS[k]), want[k], at, devices) | {"request": k} for k, at in forced]
        except Exception as exc:
            rows.append({"case": label, "error": str(exc).strip().splitlines()[-1][:400]})
            continue
        rows.append({"case": label, "identical": all(f is None for f in flips), "first_difference": flips,
                     "teacher_forced": ties})  # fmt: skip
    return {"skipped": None, "rows": rows}


def folder_for(target, work: Path, exported: Path | None, arch: str, precision: str, kv: str | None,
               provider: str, has_options: bool) -> Path | None:
    """The variant's folder for ``provider``: found in ``exported``, else exported into ``work`` (a
    dry run makes no CUDA folder: None)."""
    name = folder_name(arch, precision, kv, provider)
    if exported is not None:
        if not (exported / name / "model.onnx").is_file():
            raise FileNotFoundError(f"--decoder-folders {exported}: no {name}/model.onnx (made by --export-decoders)")
        return exported / name
    if provider == "cuda" and target.dry_run:
        return None
    export(sample_folder(work, arch), work / name, precision, provider, kv, has_options or provider == "cuda")
    return work / name


def report(results: dict) -> list[str]:
    if results["skipped"]:
        return [f"decoders: {results['skipped']}"]
    lines = ["| decoder | og.Engine CUDA vs CPU + plugin | first differing token per request | teacher-forced at the flips |",
             "|---|---|---|---|"]  # fmt: skip
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"| {r['case']} | ERROR | {r['error']} | |")
            continue
        forced = "; ".join(f"request {t['request']} token {t['at']}: top-2 gap {t['cpu_top2_gap']:.4f}, max logit "
                           f"difference {t['max_logit_difference']:.4f}{' (near tie)' if t['near_tie'] else ''}"
                           for t in r["teacher_forced"])  # fmt: skip
        lines.append(f"| {r['case']} | {'identical' if r['identical'] else 'differ'} | {r['first_difference']} | {forced} |")
    return lines
