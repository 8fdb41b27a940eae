"""The GPU check's second part: ``com.microsoft::PagedAttention`` on ORT's own CUDA kernel against the
plugin's CPU kernel, on the same inputs, over every attribute and cache type both accept.

Per case: the caches after the call byte for byte equal (the plugin writes the CUDA kernel's
arithmetic since issue 36: docs/ort-paged-attention.md "Cache bytes"; any difference is counted and
located), the outputs within one rounding step of T (``|a - b| <= atol + rtol x max(|a|, |b|)``:
float16 1e-3 + 2^-10, bfloat16 1e-2 + 2^-7), and a case ORT refuses listed with its message.

ORT's session is the CUDA EP alone (no plugin registered: ORT's kernel), inputs bound on the GPU
except the index inputs and attention_metadata (host, where ORT reads them), the cache outputs bound
to the caches' own buffers (ORT requires it). For --dry-run "ORT's side" is the plugin on the CPU too:
the comparison code runs, and says nothing about ORT's kernel.
"""

from __future__ import annotations

import numpy as np
import torch

from pakv_onnx.spec import MAX_IR_VERSION

TOLERANCE = {"float16": (1e-3, 2**-10), "bfloat16": (1e-2, 2**-7)}
HOST_INPUTS = ("cumulative_sequence_length", "past_seqlens", "block_table", "slot_mapping", "attention_metadata")
# ORT's CUDA backends: block size a power of two >= 16, head size a multiple of 8 (FACTS §14).
BASE = {"head_size": 64, "block_size": 16, "num_blocks": 24, "sequences": ((3, 1), (0, 9), (20, 0), (17, 5))}
DECODE = ((5, 1), (40, 1), (0, 1), (31, 1))

# (label, random_ort_call options beyond BASE); each runs in float16 and bfloat16.
CASES = (
    ("prefill+decode", {}),
    ("decode", {"sequences": DECODE}),
    ("packed qkv", {"packed": True}),
    ("mha", {"num_heads": 2, "kv_num_heads": 2}),
    ("rotary halves", {"rotary": "half"}),
    ("rotary interleaved", {"rotary": "interleaved"}),
    ("rotary partial", {"rotary": "half", "rotary_dim": 32}),
    ("rotary offset", {"rotary": "half", "rotary_dim": 32, "rotary_offset": 32}),
    ("q/k norm", {"norm": True}),
    ("norm + rotary", {"norm": True, "rotary": "half"}),
    ("norm + rotary interleaved, packed", {"norm": True, "rotary": "interleaved", "packed": True}),
    ("window 4", {"window": 4}),
    ("softcap 20", {"softcap": 20.0}),
    ("scale 0.3", {"scale": 0.3}),
    ("non-causal", {"causal": 0}),
    ("head sink, decode", {"sink": True, "sequences": DECODE}),
    ("slot_mapping", {"slots": "given"}),
    ("slot_mapping with -1", {"slots": "skip"}),
    ("attention_metadata", {"metadata": True}),
    ("block 256, head 64", {"block_size": 256, "num_blocks": 4}),
    ("block 128, head 128", {"block_size": 128, "num_blocks": 6, "head_size": 128}),
    ("head 256", {"head_size": 256}),
    ("int8 per-tensor, norm + rotary", {"cache_dtype": "int8", "quant": "PER_TENSOR", "norm": True, "rotary": "half"}),
    ("int8 per-channel, rotary", {"cache_dtype": "int8", "quant": "PER_CHANNEL", "rotary": "half"}),
    ("fp8 per-tensor, rotary", {"cache_dtype": "float8e4m3fn", "quant": "PER_TENSOR", "rotary": "half"}),
    ("fp8 per-channel, norm", {"cache_dtype": "float8e4m3fn", "quant": "PER_CHANNEL", "norm": True}),
    ("latent (MLA 512 + 64 rope)", {"latent": True, "num_heads": 4, "kv_num_heads": 1, "head_size": 576,
                                    "v_head_size": 512, "rotary": "half", "rotary_dim": 64, "rotary_offset": 512,
                                    "scale": 0.07}),
)  # fmt: skip


def cases(quick: bool):
    for i, (label, options) in enumerate(CASES):
        for dtype in ("float16", "bfloat16"):
            if quick and (i + (dtype == "bfloat16")) % 2:
                continue  # --quick: each case in one of the two types, alternating
            yield f"{label} [{dtype}]", dtype, {**BASE, **options}


def orts_session(target, model):
    """ORT's own kernel: a session without the plugin, on the CUDA EP alone (--dry-run: the plugin on the CPU)."""
    import onnxruntime as ort

    from pakv_onnx import runtime_plugin

    assert model.ir_version <= MAX_IR_VERSION, model.ir_version  # ORT 1.31 reads at most 13 (gpu_copies.ort_readable)
    if target.dry_run:
        return runtime_plugin.make_session(model)
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    return ort.InferenceSession(model.SerializeToString(), options, providers=target.providers)


def run_orts(target, call) -> dict[str, torch.Tensor]:
    """The call through ORT's kernel: float inputs on the target device, index inputs on the host, the
    cache outputs bound to the caches' buffers. Returns the output and the caches, on the CPU."""
    from gpu_copies import ort_readable
    from ort_attention_cases import model_for

    from pakv_onnx import runtime_plugin

    session = orts_session(target, ort_readable(model_for(call, shaped=True)))
    feeds = {name: None if t is None else (t if name in HOST_INPUTS else t.to(target.device))
             for name, t in call.inputs.items()}  # fmt: skip
    out = {"key_cache_out": feeds["key_cache"]}
    if feeds["value_cache"] is not None:
        out["value_cache_out"] = feeds["value_cache"]
    names = [o.name for o in session.get_outputs()]
    got = runtime_plugin.run(session, {k: v for k, v in feeds.items() if v is not None}, names, out)
    target.sync()
    return {"output": got["output"].cpu(), "key_cache": feeds["key_cache"].cpu(),
            "value_cache": None if feeds["value_cache"] is None else feeds["value_cache"].cpu()}  # fmt: skip


def run_plugins(call) -> dict[str, torch.Tensor]:
    """The call through the plugin's CPU kernel (caches written in place)."""
    from gpu_copies import ort_readable
    from ort_attention_cases import model_for

    from pakv_onnx import runtime_plugin

    session = runtime_plugin.make_session(ort_readable(model_for(call, shaped=True)))
    out = {"key_cache_out": call.inputs["key_cache"]}
    if call.inputs["value_cache"] is not None:
        out["value_cache_out"] = call.inputs["value_cache"]
    names = [o.name for o in session.get_outputs()]
    got = runtime_plugin.run(session, {k: v for k, v in call.inputs.items() if v is not None}, names, out)
    return {"output": got["output"], "key_cache": call.inputs["key_cache"], "value_cache": call.inputs["value_cache"]}


def differing_bytes(a: torch.Tensor | None, b: torch.Tensor | None) -> int:
    if a is None or b is None:
        return 0
    return int((a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).sum())


def compare(label: str, dtype: str, orts: dict, plugins: dict) -> dict:
    atol, rtol = TOLERANCE[dtype]
    a, b = orts["output"].float().numpy(), plugins["output"].float().numpy()
    error = np.abs(a - b)
    within = bool(np.all(error <= atol + rtol * np.maximum(np.abs(a), np.abs(b))))
    key_diff = differing_bytes(orts["key_cache"], plugins["key_cache"])
    value_diff = differing_bytes(orts["value_cache"], plugins["value_cache"])
    return {"case": label, "caches_equal": key_diff == 0 and value_diff == 0, "key_bytes_differ": key_diff,
            "value_bytes_differ": value_diff, "output_within_one_step": within,
            "max_output_error": float(error.max()) if error.size else 0.0}  # fmt: skip


def run_paged_attention(target, quick: bool, dump=None) -> dict:
    """Every case through both kernels. ``dump`` (a path): ORT's outputs of the cases that disagree,
    saved with torch.save as {label: output} (the inputs are the seeded cases: rebuild them here)."""
    from ort_attention_cases import random_ort_call

    results = {"cases": 0, "agree": 0, "refused_by_ort": [], "rows": []}
    disagreeing = {}
    for seed, (label, dtype, options) in enumerate(cases(quick)):
        call = random_ort_call(900 + seed, dtype=dtype, **options)
        try:
            orts = run_orts(target, call.clone())
        except Exception as exc:  # ORT's kernel refuses the case: its message, verbatim
            results["refused_by_ort"].append({"case": label, "message": str(exc).strip().splitlines()[-1][:400]})
            continue
        row = compare(label, dtype, orts, run_plugins(call.clone()))
        results["rows"].append(row)
        results["cases"] += 1
        results["agree"] += int(row["caches_equal"] and row["output_within_one_step"])
        if not (row["caches_equal"] and row["output_within_one_step"]):
            disagreeing[label] = {"seed": 900 + seed, "output": orts["output"], "key_cache": orts["key_cache"],
                                  "value_cache": orts["value_cache"]}  # fmt: skip
    if dump is not None:
        torch.save(disagreeing, dump)
    return results


def report(results: dict) -> list[str]:
    lines = [f"paged attention (ORT's CUDA kernel vs the plugin): {results['agree']}/{results['cases']} agree "
             "(caches byte-equal, output within one rounding step)",
             "| case | caches equal | key / value bytes differing | output within one step | max output error |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in results["rows"]:
        lines.append(f"| {r['case']} | {r['caches_equal']} | {r['key_bytes_differ']} / {r['value_bytes_differ']} | "
                     f"{r['output_within_one_step']} | {r['max_output_error']:.3g} |")  # fmt: skip
    for r in results["refused_by_ort"]:
        lines.append(f"refused by ORT: {r['case']}: {r['message']}")
    return lines
