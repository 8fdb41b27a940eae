"""Benchmark of the stock-ONNX fallback function against the plugin's native kernel.

The same one-node model (with the fallback function attached) runs twice: in a stock ONNX
Runtime session (no plugin: ORT inlines the function) and in a session with the plugin
registered (its native kernel takes precedence over the function). Both sessions are driven
through an IOBinding built once, outputs bound to reused buffers, timed in turn round by round
(so machine noise hits them alike); the table gives medians and the fallback / plugin ratio
measured in the same run. The plugin is another component: this file only times it.

Shapes: the seed sweep's cases (``pakv_onnx/data/seed_sweep.json``: token shapes, Q, T, block
table width) with ``num_blocks`` cut to ``--num-blocks`` (default 64,256,512) so the caches stay
small on a shared machine. Both layouts of the same geometry: Norm as in the seed, PA_NZ the
same bytes per token.

    python benchmarks/bench_fallback.py [--cases level0,level8,heads64_k128_v128] [--repeats 300]
"""

from __future__ import annotations

import argparse
import dataclasses

import onnxruntime as ort
import torch
from _timing import interleaved_medians_us

import pakv_onnx.export as pe
from pakv_onnx import runtime_plugin
from pakv_onnx.cases import GatherCase, seed_case
from pakv_onnx.spec import INPUT_NAMES, CacheMode, bitwise_equal, nz_last_dim


def seed_shaped(case_id: str, num_blocks: int) -> GatherCase:
    """The seed case ``case_id`` with ``num_blocks`` blocks (its ids wrap around the smaller pool)."""
    spec = seed_case(case_id)
    spec = dataclasses.replace(
        spec,
        key_cache_shape=(num_blocks, *spec.key_cache_shape[1:]),
        value_cache_shape=(num_blocks, *spec.value_cache_shape[1:]),
    )
    return spec.build()


def as_pa_nz(case: GatherCase) -> GatherCase:
    """The same token bytes laid out as PA_NZ: [nb, bs, H, D] -> [nb, H*D // E, bs, E]."""

    def convert(cache: torch.Tensor) -> torch.Tensor:
        nb, bs = cache.shape[:2]
        e = nz_last_dim(cache.element_size())
        return cache.reshape(nb, bs, -1, e).transpose(1, 2).contiguous()

    return dataclasses.replace(
        case, key_cache=convert(case.key_cache), value_cache=convert(case.value_cache), cache_mode=CacheMode.PA_NZ
    )


def bench_case(label: str, case: GatherCase, repeats: int) -> dict:
    model = pe.make_gather_model_for(*case.inputs(), **case.attributes())
    feeds = dict(zip(INPUT_NAMES, case.inputs()))
    golden = case.golden()
    outs = {"key": torch.empty_like(golden[0]), "value": torch.empty_like(golden[1])}
    options = ort.SessionOptions()
    options.log_severity_level = 3
    sessions = {
        "fallback": ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]),
        "plugin": runtime_plugin.make_session(model, backend="native"),
    }
    runs = {}
    for name, session in sessions.items():
        result = runtime_plugin.run(session, feeds, out=outs)
        assert bitwise_equal(result["key"], golden[0]) and bitwise_equal(result["value"], golden[1]), name
        binding = runtime_plugin.bind(session, feeds, out=outs)
        runs[name] = lambda s=session, b=binding: s.run_with_iobinding(b)
    medians = interleaved_medians_us(runs, repeats, warmup=20)
    return {"case": label, "T": int(case.seq_lens[-1]), **medians, "ratio": medians["fallback"] / medians["plugin"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="level0,level8,heads64_k128_v128")
    parser.add_argument("--num-blocks", default="64,256,512")
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    print("| case | layout | num_blocks | T | fallback us | plugin (native) us | fallback / plugin |")
    print("|---|---|---|---|---|---|---|")
    for case_id in [c for c in args.cases.split(",") if c]:
        for num_blocks in [int(n) for n in args.num_blocks.split(",") if n]:
            norm = seed_shaped(case_id, num_blocks)
            for case in (norm, as_pa_nz(norm)):
                row = bench_case(case_id, case, args.repeats)
                print(
                    f"| {row['case']} | {case.cache_mode.value} | {num_blocks} | {row['T']} | {row['fallback']:.1f} "
                    f"| {row['plugin']:.1f} | {row['ratio']:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
