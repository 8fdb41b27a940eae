"""The IR version every ONNX model the package writes states (a leaf: the builders, the exporters and
the decoders' export all import it)."""

from __future__ import annotations

import onnx

from pakv_onnx.spec import MAX_IR_VERSION


def cap_ir_version(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (in place, and returned) stating IR version at most :data:`pakv_onnx.spec.MAX_IR_VERSION`,
    whatever onnx made it: every ``make_model`` / export / save of the package goes through here, so the
    oldest supported ONNX Runtime reads what it writes."""
    if not model.ir_version or model.ir_version > MAX_IR_VERSION:
        model.ir_version = MAX_IR_VERSION
    return model
