"""The GPU check's third part: exported decoders through og.Engine on the CUDA EP (ORT's own
PagedAttention kernel) against og.Engine on the CPU EP with the plugin, the same model.onnx.

Per arch x precision (x quantized pools where the export offers them): ``pakv-onnx export HF OUT
--precision P --execution-provider cuda`` and ``... cpu`` from one sample Hugging Face folder, then 4
ragged requests x 24 greedy tokens through og.Engine on each; tokens identical, or the first position
where a request's tokens differ (the issue's teacher-forced top-2 gap at that position is not computed
here: a flip is reported for a person to judge). Exports use block size 16 (ORT's kernel: a power of
two >= 16).

It needs the export options ``--precision`` and ``--execution-provider`` (issue 36, items 1 and 2) and
onnxruntime-genai(-cuda); without either this part is skipped, saying which. --dry-run runs the CPU
folders only (the CUDA EP is absent), each against itself: the export and engine code, not a GPU.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

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


def missing_requirements() -> str | None:
    options = export_options()
    lacking = [o for o in ("--precision", "--execution-provider") if o not in options]
    if lacking:
        return f"`pakv-onnx export` has no {' / '.join(lacking)} yet (issue 36 items 1-2): exported decoders skipped"
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return "onnxruntime_genai is not installed (onnxruntime-genai-cuda on a GPU): exported decoders skipped"
    return None


def export(hf: Path, out: Path, precision: str, provider: str, kv: str | None) -> None:
    from pakv_onnx import cli

    argv = ["export", str(hf), str(out), "--precision", precision, "--execution-provider", provider,
            "--block-size", "16", "--num-blocks", "64", "--max-batch-size", "8"]  # fmt: skip
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


def run_decoders(target, quick: bool, work: Path) -> dict:
    reason = missing_requirements()
    if reason:
        return {"skipped": reason, "rows": []}
    from pakv_onnx.models.hf import save_sample_folder

    rows = []
    for arch, precision, kv in variants(quick, target.dry_run):
        label = f"{arch} {precision}" + (f" {kv} pools" if kv else "")
        hf = work / f"hf-{arch}"
        if not hf.exists():
            save_sample_folder(hf, arch, 0)
        try:
            cpu = work / f"{arch}-{precision}-{kv or 't'}-cpu"
            export(hf, cpu, precision, "cpu", kv)
            want = generate(cpu)
            if target.dry_run:
                got = generate(cpu)  # no CUDA EP here: the engine loop against itself
            else:
                cuda = work / f"{arch}-{precision}-{kv or 't'}-cuda"
                export(hf, cuda, precision, "cuda", kv)
                assert "cuda" in json.dumps(json.loads((cuda / "genai_config.json").read_text())).lower(), "not a CUDA folder"
                got = generate(cuda)
        except Exception as exc:
            rows.append({"case": label, "error": str(exc).strip().splitlines()[-1][:400]})
            continue
        flips = first_difference(want, got)
        rows.append({"case": label, "identical": all(f is None for f in flips), "first_difference": flips})
    return {"skipped": None, "rows": rows}


def report(results: dict) -> list[str]:
    if results["skipped"]:
        return [f"decoders: {results['skipped']}"]
    lines = ["| decoder | og.Engine CUDA vs CPU + plugin | first differing token per request |", "|---|---|---|"]
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"| {r['case']} | ERROR | {r['error']} |")
        else:
            lines.append(f"| {r['case']} | {'identical' if r['identical'] else 'differ'} | {r['first_difference']} |")
    return lines
