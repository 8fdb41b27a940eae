"""The GPU check: the library's CUDA entries, ORT's CUDA PagedAttention against the plugin, and
exported decoders on og.Engine's CUDA EP against the CPU with the plugin -- one script, one device call.

RUN ON AN H200 ON 2026-12-04 (all three parts; docs/plugin-hosts.md has the figures). Changed since,
unrun on a GPU: the copy kernel's own memory pool and larger pieces (gpu_copies measures them), the
``--dump`` option. On the project's machines only ``--dry-run`` runs (the same code on the CPU
execution provider with CPU tensors, tests/test_device_script.py).

Parts (``--parts``, default all):

1. ``copies``: GatherPaKvCache's CUDA entry over every cache dtype x layout x seq_lens form x index
   dtype x seq_offset (+ mixed key / value dtypes; ``--quick``: one case per dtype), ScatterPaKvCache's
   over every dtype x layout, bit-exact against the golden; then the gather's speed against one device
   memcpy of the same bytes and torch's index_select at the seed shapes and at 262,144 tokens (8 heads
   x 128 bf16), once per copy path (``PAKV_ONNX_CUDA_COPY`` = batch: cuMemcpyBatchAsync, kernel: the
   embedded PTX copy kernel, runs: one cuMemcpyDtoDAsync per run), naming the path that ran. Goals:
   >= 80% of the memcpy's bandwidth at 262,144 tokens, <= 2x one memcpy launch at the seed shapes.
2. ``attention``: com.microsoft::PagedAttention on ORT's CUDA kernel vs the plugin's CPU kernel,
   27 cases x float16 / bfloat16 (--quick: each in one of the two) (tests/device/gpu_attention.py): caches byte-equal, outputs within
   one rounding step, refusals listed with ORT's message.
3. ``decoders``: `pakv-onnx export --precision fp16|bf16 --execution-provider cuda|cpu` folders of
   Llama, Qwen3, Mistral, DeepSeek-V3 through og.Engine on CUDA vs CPU + plugin: tokens identical, or
   each flip teacher-forced and at a near tie (top-2 gap below the logit difference); skipped, saying
   why, while the export lacks those options or onnxruntime_genai is missing (tests/device/gpu_decoders.py).

Sessions on the GPU name CUDAExecutionProvider alone with ``session.disable_cpu_ep_fallback=1`` (ORT
1.31 refuses that setting with CPUExecutionProvider in the list); every model this script builds is
capped at IR version 10 (onnx 1.23 writes 14, ORT 1.31 reads 13).

On a machine with network: ``bash tests/device/gpu_check.sh [options]`` (a venv with onnxruntime-gpu,
a CUDA torch, this checkout). On one without (FACTS §14's device image: python 3.12, torch cu130,
onnx, a CPU onnxruntime, no onnxruntime-gpu):

  on a machine with network (the wheels match the device's python and CUDA: cp312, CUDA 13):
      pip download --no-deps --only-binary=:all: --python-version 3.12 \\
          --platform manylinux_2_28_x86_64 onnxruntime-gpu==1.31.1 onnxruntime-genai-cuda==0.18.0 -d wheels
      split -b 50M wheels/onnxruntime_gpu-*.whl wheels/ort-part-   # each part under 64 MiB per transfer
  carry wheels/ort-part-* and the genai wheel over (one call each while the machine stays warm), then:
      cat /tmp/wheels/ort-part-* > /tmp/wheels/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl
      PAKV_GPU_WHEELS=/tmp/wheels bash tests/device/gpu_check.sh --quick --json $OUT/gpu.json

  The device image's transformers (5.17) is older than the `hf` extra's (>= 5.24): export the
  decoders part's folders where the extra is installed and carry them with a wheel part:
      python3 tests/device/gpu_check.py --export-decoders folders     # 32 folders, ~2 min on 2 cores
      ... gpu_check.sh --decoder-folders /tmp/folders ...

  gpu_check.sh then installs the wheels with pip --no-index --no-deps --target into a folder put first
  on PYTHONPATH (the device's torch stays), builds the library in place (gcc only) and runs this script.

Exit status: 0 when every matrix case is bit-exact and every attention case agrees (speed goals are
reported, fatal only with ``--strict``), 1 otherwise, 2 when the machine cannot run it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
# This checkout's pakv_onnx; the benchmarks' cases and timing; the tests' helpers; this folder's parts.
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests"), str(HERE)]

import torch  # noqa: E402  (before onnxruntime.preload_dlls: ORT then reuses torch's CUDA libraries)

from pakv_onnx.spec import MAX_IR_VERSION  # noqa: E402

PARTS = ("copies", "attention", "decoders")


def parse_args(argv=None) -> argparse.Namespace:
    from gpu_copies import LARGE_TOKENS_GOAL

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU EP and CPU tensors: checks the script, not a GPU")
    parser.add_argument("--quick", action="store_true", help="one matrix case per dtype, half the attention cases")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    parser.add_argument("--large-blocks", type=int, default=LARGE_TOKENS_GOAL // 128, help="blocks of 128 tokens")
    parser.add_argument("--repeats", type=int, default=100, help="timed calls per variant (seed shapes)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--strict", action="store_true", help="a missed speed goal fails the run")
    parser.add_argument("--device-id", type=int, default=0)
    parser.add_argument("--dump", type=Path, metavar="FILE",
                        help="attention part: save ORT's outputs of the cases that disagree here (torch.save)")
    parser.add_argument("--export-decoders", type=Path, metavar="DIR",
                        help="only export the decoders part's folders into DIR and exit (any machine with the "
                             "`hf` extra; no GPU): for a GPU machine whose transformers is too old")
    parser.add_argument("--decoder-folders", type=Path, metavar="DIR",
                        help="the decoders part runs the folders --export-decoders made in DIR instead of exporting")
    args = parser.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {unknown}; the parts are {list(PARTS)}")
    return args


class Target:
    """Where the check runs: the GPU (CUDA EP alone, CUDA tensors) or, for --dry-run, the CPU."""

    def __init__(self, dry_run: bool, device_id: int) -> None:
        self.dry_run = dry_run
        if dry_run:
            torch.set_num_threads(1)  # torch's CPU pool would only fight ORT's for the cores
        self.device = torch.device("cpu") if dry_run else torch.device("cuda", device_id)
        # ORT 1.31 refuses disable_cpu_ep_fallback with CPUExecutionProvider listed (FACTS §14).
        self.providers = ["CPUExecutionProvider"] if dry_run else [("CUDAExecutionProvider", {"device_id": device_id})]

    def sync(self) -> None:
        if not self.dry_run:
            torch.cuda.synchronize(self.device)

    def session(self, model):
        """A session with the plugin registered; on the GPU every node must run on the CUDA EP."""
        import onnxruntime as ort

        from pakv_onnx import runtime_plugin

        assert model.ir_version <= MAX_IR_VERSION, f"IR version {model.ir_version}: pass the model through gpu_copies.ort_readable"

        options = ort.SessionOptions()
        if not self.dry_run:
            options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        return runtime_plugin.make_session(model, sess_options=options, providers=self.providers)

    def check_placement(self, session) -> None:
        if not self.dry_run:
            assert session.get_providers()[0] == "CUDAExecutionProvider", session.get_providers()

    def copy_paths(self) -> dict[str, int]:
        from pakv_onnx import native_lib

        return native_lib.cuda_copy_paths()

    def feeds(self, case) -> dict:
        """Caches on the target device, index inputs on the host (where the device entry reads them)."""
        from pakv_onnx.spec import INPUT_NAMES

        inputs = dict(zip(INPUT_NAMES, case.inputs()))
        for name in ("key_cache", "value_cache"):
            inputs[name] = inputs[name].to(self.device)
        return {name: t for name, t in inputs.items() if t is not None}


def setup(target: Target) -> str | None:
    """Why this machine cannot run the check, or None."""
    import onnxruntime as ort

    if target.dry_run:
        return None
    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (install onnxruntime-gpu, not onnxruntime)"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (install a CUDA build of torch)"
    return None


def run(args, target: Target) -> dict:
    """Every asked part, printed as it finishes; returns the results."""
    import gpu_attention
    import gpu_copies
    import gpu_decoders

    results: dict = {}
    if "copies" in args.parts:
        matrix = gpu_copies.run_gather_matrix(target, args.quick)
        print(f"gather matrix: {matrix['exact']}/{matrix['cases']} bit-exact, copy paths {matrix['copy_paths']}"
              + (f"; FAILED: {matrix['failures']}" if matrix["failures"] else ""), flush=True)  # fmt: skip
        scatter = gpu_copies.run_scatter_matrix(target)
        print(f"scatter matrix: {scatter['exact']}/{scatter['cases']} bit-exact"
              + (f"; FAILED: {scatter['failures']}" if scatter["failures"] else ""), flush=True)  # fmt: skip
        rows = gpu_copies.run_bench(target, args.large_blocks, args.repeats)
        print("\n".join(gpu_copies.report(rows)), flush=True)
        checks = gpu_copies.goals(rows, args.large_blocks)
        for check in checks:
            verdict = "reported" if check.get("reported") else f"goal {'met' if check['met'] else 'MISSED'}"
            print(f"{verdict}: {check['goal']} ({check['value']})", flush=True)
        results.update(matrix=matrix, scatter=scatter, bench=rows, goals=checks)
    if "attention" in args.parts:
        results["attention"] = gpu_attention.run_paged_attention(target, args.quick, args.dump)
        print("\n".join(gpu_attention.report(results["attention"])), flush=True)
    if "decoders" in args.parts:
        with tempfile.TemporaryDirectory(prefix="pakv-gpu-decoders-") as work:
            results["decoders"] = gpu_decoders.run_decoders(target, args.quick, Path(work), args.decoder_folders)
        print("\n".join(gpu_decoders.report(results["decoders"])), flush=True)
    return results


def failed(results: dict, strict: bool) -> bool:
    for name in ("matrix", "scatter"):
        if name in results and results[name]["exact"] != results[name]["cases"]:
            return True
    if "attention" in results and results["attention"]["agree"] != results["attention"]["cases"]:
        return True
    for row in results.get("decoders", {}).get("rows", []):  # tokens differ only at near ties
        forced = row.get("teacher_forced", [])
        if "error" in row or (not row["identical"] and not (forced and all(t["near_tie"] for t in forced))):
            return True
    return strict and not all(c["met"] for c in results.get("goals", []))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.export_decoders:
        import gpu_decoders

        args.export_decoders.mkdir(parents=True, exist_ok=True)
        names = gpu_decoders.export_folders(args.quick, args.export_decoders)
        print(f"exported {len(names)} folders into {args.export_decoders}: {', '.join(names)}", flush=True)
        return 0
    target = Target(args.dry_run, args.device_id)
    reason = setup(target)
    if reason:
        print(f"cannot run the GPU check here: {reason}", file=sys.stderr)
        return 2
    import onnxruntime as ort

    where = "DRY RUN on the CPU (figures say nothing about a GPU)" if args.dry_run else torch.cuda.get_device_name(target.device)
    versions = {"onnxruntime": ort.__version__, "torch": torch.__version__,
                "cuda": None if args.dry_run else torch.version.cuda}  # fmt: skip
    print(f"# pakv GPU check: {where}; {versions}", flush=True)
    results = run(args, target)
    if args.json:
        args.json.write_text(json.dumps({"device": where, **versions, **results}, indent=2, default=str))
    return 1 if failed(results, args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
