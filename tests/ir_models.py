"""Every kind of ONNX model the package writes, built small: what tests/test_ir_version.py checks under
the installed onnx, and again under the newest onnx on PyPI by running this file as a script there
(``python tests/ir_models.py [--decoders DIR]`` prints ``{"onnx": version, "models": {name: ir_version}}``).

Sites: the hand-built one-node models (:mod:`pakv_onnx.export.builder`, ``ort_attention``), the dynamo and
TorchScript exporters (:func:`pakv_onnx.export.export`, ``export_legacy``), and with ``--decoders`` a
decoder step (:func:`~pakv_onnx.models.hf.step.export_step`) and an ORT GenAI folder's model.onnx
(:func:`~pakv_onnx.models.hf.genai.export_genai`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import onnx
import torch


class _Gather(torch.nn.Module):
    def forward(self, key_cache, value_cache, block_tables, seq_lens):
        return torch.ops.pakv.gather_pa_kv_cache(key_cache, value_cache, block_tables, seq_lens, None, "Norm", True)


def one_node_models() -> dict[str, onnx.ModelProto]:
    """The builders' one-node models and both exporters' output for one small gather case."""
    import pakv_onnx.export as pe

    key_cache = value_cache = torch.zeros(4, 4, 2, 8, dtype=torch.float16)
    block_tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([0, 3, 7], dtype=torch.int32)  # cumulative: 3 and 4 tokens
    rows = torch.zeros(2, *key_cache.shape[2:], dtype=key_cache.dtype)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    query = torch.zeros(2, 4, 8)
    pools = torch.zeros(2, 16, 2, 8)
    ort_inputs = {
        "query": torch.zeros(2, 64), "key_cache": pools, "value_cache": pools,
        "cumulative_sequence_length": torch.tensor([0, 2], dtype=torch.int32),
        "past_seqlens": torch.tensor([0], dtype=torch.int32), "block_table": torch.tensor([[0]], dtype=torch.int32),
    }  # fmt: skip
    args = (key_cache, value_cache, block_tables, seq_lens)
    shapes = pe.op_dynamic_shapes(is_seq_lens_cumsum=True, with_seq_offset=False)[:4]
    return {
        "make_gather_model": pe.make_gather_model(torch.bfloat16),
        "make_gather_model_for": pe.make_gather_model_for(*args),
        "make_scatter_model_for": pe.make_scatter_model_for(rows, rows, key_cache, value_cache, slots),
        "make_attention_model_for": pe.make_attention_model_for(
            query, pools, pools, torch.tensor([[0]], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32),
        ),
        "make_ort_attention_model_for": pe.make_ort_attention_model_for(ort_inputs, num_heads=4, kv_num_heads=2),
        "export": pe.export(_Gather().eval(), args, dynamic_shapes=shapes),
        "export_legacy": pe.export_legacy(_Gather().eval(), args),
    }


def decoder_models(tmp: Path) -> dict[str, onnx.ModelProto]:
    """A tiny Llama's paged step (fused, as exported) and the model.onnx of its ORT GenAI folder (fp16)."""
    from pakv_onnx.models.hf.configs import build_model, save_sample_folder
    from pakv_onnx.models.hf.genai import MODEL_FILE, export_genai
    from pakv_onnx.models.hf.step import PagedDecoderStep, export_step, trace_feeds

    step = PagedDecoderStep(build_model("llama", 0))
    models = {"export_step": export_step(step, trace_feeds(step, 16), None)}
    folder = export_genai(save_sample_folder(tmp / "hf", "llama"), tmp / "genai", **_genai_options())
    models["export_genai"] = onnx.load(str(folder.out_dir / MODEL_FILE), load_external_data=False)
    return models


def _genai_options() -> dict:
    """export_genai's options for the folder checked here (the newest precision options when present)."""
    import inspect

    from pakv_onnx.models.hf.genai import export_genai

    return {"precision": "fp16"} if "precision" in inspect.signature(export_genai).parameters else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--decoders", type=Path, default=None, help="also export the decoders, in this folder")
    args = parser.parse_args(argv)
    models = one_node_models()
    if args.decoders is not None:
        models.update(decoder_models(args.decoders))
    json.dump({"onnx": onnx.__version__, "models": {k: m.ir_version for k, m in models.items()}}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
