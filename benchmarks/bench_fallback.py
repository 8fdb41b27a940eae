"""Benchmark of the stock-ONNX fallback function against the plugin's native kernel.

The same one-node model (with the fallback function attached) runs twice: in a stock ONNX
Runtime session (no plugin: ORT inlines the function) and in a session with the plugin
registered (its native kernel takes precedence over the function). Both sessions are driven
through an IOBinding built once, outputs bound to reused buffers, timed in turn round by round
(so machine noise hits them alike); the table gives medians and the fallback / plugin ratio
measured in the same run. The plugin is another component: this file only times it.

A third session gives the floor of any stock-ONNX body: the same model whose function only
runs the final gathers with the case's (block, slot) indices baked in as constants (Norm: two
GatherND; PA_NZ: Flatten, GatherND, Flatten per cache), so it costs ORT's per-run overhead plus
the row copies and nothing to find the rows. Every session's output is checked bit-exact first.

Shapes: the seed sweep's cases (``pakv_onnx/data/seed_sweep.json``: token shapes, Q, T, block
table width) with ``num_blocks`` capped at each of ``--num-blocks`` (default 64,256,512) so the
caches stay small on a shared machine (a seed pool already smaller keeps its size; the table gives
the blocks each case has). Both layouts of the same geometry: Norm as in the seed, PA_NZ the
same bytes per token.

    python benchmarks/bench_fallback.py [--cases level0,level8,heads64_k128_v128] [--repeats 300]
"""

from __future__ import annotations

import argparse
import dataclasses

import onnx
import onnxruntime as ort
import torch
from _cases import capped_seed_case
from _timing import blocked_medians_us, prebound
from onnx import helper

import pakv_onnx.export as pe
from pakv_onnx import runtime_plugin, spec, validator
from pakv_onnx.cases import GatherCase


def as_pa_nz(case: GatherCase) -> GatherCase:
    """The same token bytes laid out as PA_NZ: [nb, bs, H, D] -> [nb, H*D // E, bs, E]."""

    def convert(cache: torch.Tensor) -> torch.Tensor:
        nb, bs = cache.shape[:2]
        e = spec.nz_last_dim(cache.element_size())
        return cache.reshape(nb, bs, -1, e).transpose(1, 2).contiguous()

    return dataclasses.replace(
        case, key_cache=convert(case.key_cache), value_cache=convert(case.value_cache), cache_mode=spec.CacheMode.PA_NZ
    )


def floor_function(case: GatherCase, opset_version: int) -> onnx.FunctionProto:
    """A body that only gathers: ``case``'s per-token (block, slot) as constants (see the module doc)."""
    block, slot = validator.plan_gather(*case.inputs(), **case.attributes()).token_slots()
    nodes = []

    def constant(name: str, values: torch.Tensor) -> str:
        tensor = helper.make_tensor(name, onnx.TensorProto.INT64, list(values.shape), values.flatten().tolist())
        nodes.append(helper.make_node("Constant", [], [name], value=tensor))
        return name

    if case.cache_mode is spec.CacheMode.NORM:
        index = constant("index", torch.stack([block, slot], dim=1))  # [T, 2]
        for cache, out in zip(spec.INPUT_NAMES[:2], spec.OUTPUT_NAMES):
            nodes.append(helper.make_node("GatherND", [cache, index], [out]))
    else:
        for cache, out, tensor in zip(spec.INPUT_NAMES[:2], spec.OUTPUT_NAMES, (case.key_cache, case.value_cache)):
            fractals, block_size = tensor.shape[1], tensor.shape[2]
            # Row of E elements of (block, fractal f, slot) in [nb*F*bs, E]: (block*F + f)*bs + slot.
            rows = (block[:, None] * fractals + torch.arange(fractals)[None, :]) * block_size + slot[:, None]
            index = constant(f"{out}_index", rows[..., None])  # [T, F, 1]
            nodes.append(helper.make_node("Flatten", [cache], [f"{out}_rows"], axis=3))
            nodes.append(helper.make_node("GatherND", [f"{out}_rows", index], [f"{out}_read"]))
            nodes.append(helper.make_node("Flatten", [f"{out}_read"], [out], axis=1))
    return helper.make_function(
        spec.DOMAIN, spec.OP_TYPE, list(spec.INPUT_NAMES), list(spec.OUTPUT_NAMES), nodes,
        [helper.make_opsetid("", opset_version)], attributes=["cache_mode", "is_seq_lens_cumsum"],
    )


def floor_model(model: onnx.ModelProto, case: GatherCase) -> onnx.ModelProto:
    floor = onnx.ModelProto()
    floor.CopyFrom(model)
    opset = next(o.version for o in floor.opset_import if o.domain in ("", "ai.onnx"))
    del floor.functions[:]
    floor.functions.append(floor_function(case, opset))
    return floor


def bench_case(label: str, case: GatherCase, repeats: int) -> dict:
    model = pe.make_gather_model_for(*case.inputs(), **case.attributes())
    feeds = dict(zip(spec.INPUT_NAMES, case.inputs()))
    golden = case.golden()
    outs = {"key": torch.empty_like(golden[0]), "value": torch.empty_like(golden[1])}
    # Default session options on every side (the plugin's adds only the custom-op library).
    options = ort.SessionOptions()
    options.log_severity_level = 3
    cpu = ["CPUExecutionProvider"]
    sessions = {
        "fallback": ort.InferenceSession(model.SerializeToString(), options, providers=cpu),
        "plugin": runtime_plugin.make_session(model, backend="native"),
        "floor": ort.InferenceSession(floor_model(model, case).SerializeToString(), options, providers=cpu),
    }
    runs = {name: prebound(session, feeds, outs, golden, name) for name, session in sessions.items()}
    medians = blocked_medians_us(runs, repeats, warmup=20)
    ratios = {"ratio": medians["fallback"] / medians["plugin"], "floor_ratio": medians["floor"] / medians["plugin"]}
    return {"case": label, "T": int(case.seq_lens[-1]), **medians, **ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="level0,level8,heads64_k128_v128")
    parser.add_argument("--num-blocks", default="64,256,512")
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    print(
        "| case | layout | num_blocks | T | fallback us | plugin (native) us | fallback / plugin "
        "| floor us | floor / plugin |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for case_id in [c for c in args.cases.split(",") if c]:
        for num_blocks in [int(n) for n in args.num_blocks.split(",") if n]:
            norm = capped_seed_case(case_id, num_blocks)
            blocks = norm.key_cache.shape[0]  # at most num_blocks: a smaller seed pool keeps its size
            for case in (norm, as_pa_nz(norm)):
                row = bench_case(case_id, case, args.repeats)
                print(
                    f"| {row['case']} | {case.cache_mode.value} | {blocks} | {row['T']} | {row['fallback']:.1f} "
                    f"| {row['plugin']:.1f} | {row['ratio']:.2f} | {row['floor']:.1f} | {row['floor_ratio']:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
