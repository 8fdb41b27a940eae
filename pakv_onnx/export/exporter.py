"""``export``: the recommended way to turn a PyTorch model calling the op into an ONNX file."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import onnx
import torch

from pakv_onnx.export.builder import DEFAULT_OPSET
from pakv_onnx.export.ir import cap_ir_version
from pakv_onnx.export.fallback import MIN_OPSET, attach_fallback
from pakv_onnx.export.schema import register_schema
from pakv_onnx.export.translation import register_legacy_symbolic, translation_table
from pakv_onnx.spec import DOMAIN, MS_DOMAIN, MS_OPSET_VERSION, OPSET_VERSION


def _check_opset(opset_version: int, fallback: bool) -> None:
    if fallback and opset_version < MIN_OPSET:
        raise ValueError(
            f"opset_version {opset_version} is too old for the fallback function (needs >= {MIN_OPSET}); "
            "raise it or pass fallback=False"
        )


def _finish(model: onnx.ModelProto, path: str | os.PathLike | None, fallback: bool) -> onnx.ModelProto:
    trim_latent_value_outputs(model.graph)
    cap_ir_version(model)
    if fallback:
        attach_fallback(model)
    elif not any(opset.domain == DOMAIN for opset in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, OPSET_VERSION))
    if path is not None:
        onnx.save_model(model, os.fspath(path))
    return model


def export(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    path: str | os.PathLike | None = None,
    *,
    kwargs: dict[str, Any] | None = None,
    dynamic_shapes: Any = "auto",
    fallback: bool = True,
    opset_version: int = DEFAULT_OPSET,
    optimize: bool = True,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    custom_translation_table: Mapping[Callable, Callable] | None = None,
    verbose: bool = False,
    **torch_onnx_kwargs: Any,
) -> onnx.ModelProto:
    """Export ``model`` with ``torch.onnx.export(..., dynamo=True)`` and return the ModelProto.

    Each call of ``torch.ops.pakv.gather_pa_kv_cache`` becomes one ``pakv::GatherPaKvCache``
    node with ``cache_mode`` and ``is_seq_lens_cumsum``. With ``fallback`` (default) the model
    also carries a model-local function of the op from standard ops, so stock ONNX Runtime
    runs it; a registered plugin kernel takes precedence over it.

    Args:
        model, args, kwargs: as for ``torch.onnx.export``.
        path: where to save the model (``None``: don't save).
        dynamic_shapes: as for ``torch.export`` (see :func:`op_dynamic_shapes`); the default
            ``"auto"`` marks every dim of every tensor argument ``Dim.AUTO`` (dynamic unless the
            model pins it; example sizes of 0 or 1 are pinned by torch.export), ``None`` exports
            static input shapes. The token count T of the op's outputs is always dynamic.
        fallback: attach the stock-ONNX fallback function.
        opset_version: default-domain opset (>= 19 with the fallback).
        optimize: run onnxscript's optimizer. It merges identical calls of the op (same
            inputs and attributes; the op is deterministic, so the result is the same) and
            drops calls whose outputs are unused.
        custom_translation_table: extra translations, merged over the op's.
        **torch_onnx_kwargs: passed on to ``torch.onnx.export``.

    Models above protobuf's 2 GB limit need ``torch.onnx.export`` and
    :func:`pakv_onnx.export.attach_fallback` on an external-data model instead.
    """
    _check_opset(opset_version, fallback)
    register_schema()
    if isinstance(dynamic_shapes, str) and dynamic_shapes == "auto":
        dynamic_shapes = auto_dynamic_shapes(args, kwargs)
    table = dict(translation_table())
    table.update(custom_translation_table or {})
    with contextlib.nullcontext() if verbose else _quiet_exporter():
        program = torch.onnx.export(
            model,
            args,
            kwargs=kwargs,
            dynamo=True,
            dynamic_shapes=dynamic_shapes,
            custom_translation_table=table,
            opset_version=opset_version,
            optimize=optimize,
            input_names=input_names,
            output_names=output_names,
            verbose=verbose,
            **torch_onnx_kwargs,
        )
    return _finish(program.model_proto, path, fallback)


def trim_latent_value_outputs(graph: onnx.GraphProto) -> None:
    """Drop the ``value_cache_out`` of every LATENT ``com.microsoft::PagedAttention`` node (in place).

    The dynamo exporter gives a custom op as many outputs as its schema lists (three) whatever the
    translation asks; LATENT has no value cache, and the torch op's third result is an empty
    placeholder nobody reads. An unread output left on the node would be a name ORT keeps."""
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    for node in graph.node:
        if node.domain != MS_DOMAIN or node.op_type != "PagedAttention" or len(node.output) != 3:
            continue
        layout = next((a.s for a in node.attribute if a.name == "kv_cache_layout"), b"")
        if layout == b"LATENT" and node.output[2] not in read:
            del node.output[2]


@contextlib.contextmanager
def _quiet_exporter():
    """Silence the dynamo exporter's chatter (torchvision-missing notices, pytree deprecations)."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        logger.setLevel(level)


def export_legacy(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    path: str | os.PathLike | None = None,
    *,
    fallback: bool = True,
    opset_version: int = DEFAULT_OPSET,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    dynamic_axes: Mapping[str, Any] | None = None,
    **torch_onnx_kwargs: Any,
) -> onnx.ModelProto:
    """The TorchScript exporter path (``dynamo=False``, deprecated by PyTorch) for older flows.

    Uses ``torch.onnx.register_custom_op_symbolic``; T is a symbolic dim of the outputs.
    ``None`` arguments (an absent ``seq_offset``) must be left out of ``args`` or passed as
    keyword defaults, as the TorchScript tracer requires.
    """
    _check_opset(opset_version, fallback)
    register_schema()
    register_legacy_symbolic(opset_version)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            model,
            args,
            buffer,
            dynamo=False,
            opset_version=opset_version,
            input_names=input_names,
            output_names=output_names,
            dynamic_axes=dynamic_axes,
            custom_opsets={DOMAIN: OPSET_VERSION, MS_DOMAIN: MS_OPSET_VERSION},
            **torch_onnx_kwargs,
        )
    return _finish(onnx.load_model_from_string(buffer.getvalue()), path, fallback)


def auto_dynamic_shapes(args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
    """``Dim.AUTO`` for every dim of every tensor in ``args`` / ``kwargs`` (``None`` elsewhere)."""

    def spec(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return {axis: torch.export.Dim.AUTO for axis in range(value.dim())}
        return None

    shapes = tuple(spec(a) for a in args)
    if kwargs:
        return {**{f"_arg{i}": s for i, s in enumerate(shapes)}, **{k: spec(v) for k, v in kwargs.items()}}
    return shapes


def op_dynamic_shapes(*, is_seq_lens_cumsum: bool = True, with_seq_offset: bool = True) -> tuple:
    """``dynamic_shapes`` for a forward taking the op's inputs positionally, in contract order.

    Dynamic: num_blocks (both caches), the number of sequences (block_tables rows,
    seq_lens, seq_offset) and the block-table width. (The sequence-count Dim is not
    called "Q": that name clashes with sympy inside torch.export.)
    """
    Dim = torch.export.Dim
    num_blocks, num_seqs, cols = Dim("num_blocks"), Dim("num_seqs"), Dim("table_cols")
    shapes = (
        {0: num_blocks},
        {0: num_blocks},
        {0: num_seqs, 1: cols},
        {0: num_seqs + 1 if is_seq_lens_cumsum else num_seqs},
    )
    return (*shapes, {0: num_seqs}) if with_seq_offset else (*shapes, None)
