"""``torch.ops.pakv.gather_pa_kv_cache``: the operator as a PyTorch custom op.

The eager implementation is the package front (:func:`pakv_onnx.ops.gather_pa_kv_cache`,
backend ``"auto"``), so validation is the contract's. The fake implementation gives the
outputs a data-dependent token dimension T (an unbacked symbolic size), which is what lets
``torch.export``, ``torch.compile`` and the dynamo ONNX exporter trace models calling it.

The op name is ``pakv::gather_pa_kv_cache`` (the namespace is the ONNX domain of the
contract); the ONNX translation lives in :mod:`pakv_onnx.export.translation`.
"""

from __future__ import annotations

import torch

from pakv_onnx import ops
from pakv_onnx.spec import (
    ATTR_CACHE_MODE,
    ATTR_IS_SEQ_LENS_CUMSUM,
    ATTRIBUTE_DEFAULTS,
    DOMAIN,
    INPUT_NAMES,
    OPTIONAL_INPUTS,
    OUTPUT_NAMES,
    CacheMode,
    bind_arguments,
    block_size_axis,
    token_shape,
)

OP_NAME = "gather_pa_kv_cache"
QUALIFIED_NAME = f"{DOMAIN}::{OP_NAME}"


def _attribute_decl(name: str, default: str | bool) -> str:
    if isinstance(default, bool):
        return f"bool {name}={default}"
    return f'str {name}="{default}"'


def torch_schema() -> str:
    """The op's torch schema string, from spec's signature.

    ``(Tensor key_cache, ..., Tensor? seq_offset=None, str cache_mode="Norm",
    bool is_seq_lens_cumsum=True) -> (Tensor, Tensor)``
    """
    tensors = [f"Tensor? {n}=None" if n in OPTIONAL_INPUTS else f"Tensor {n}" for n in INPUT_NAMES]
    attributes = [_attribute_decl(n, d) for n, d in ATTRIBUTE_DEFAULTS.items()]
    outputs = ", ".join("Tensor" for _ in OUTPUT_NAMES)
    return f"({', '.join(tensors + attributes)}) -> ({outputs})"


@torch.library.custom_op(QUALIFIED_NAME, mutates_args=(), schema=torch_schema())
def gather_pa_kv_cache(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """GatherPaKvCache as a torch op; arguments (spec.PARAMETER_NAMES) and results as :func:`pakv_onnx.gather_pa_kv_cache`."""
    if not kwargs and len(args) <= len(INPUT_NAMES):
        # The dispatcher passes the tensors positionally and leaves out attributes at their
        # defaults: the front's own defaults are the same (spec.ATTRIBUTE_DEFAULTS), skip binding.
        return ops.gather_pa_kv_cache(*args)
    bound = bind_arguments(args, kwargs)
    return ops.gather_pa_kv_cache(
        *(bound[name] for name in INPUT_NAMES), **{name: bound[name] for name in ATTRIBUTE_DEFAULTS}
    )


@gather_pa_kv_cache.register_fake
def _gather_pa_kv_cache_fake(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    bound = bind_arguments(args, kwargs)
    key_cache, value_cache, block_tables, seq_lens, seq_offset = (bound[name] for name in INPUT_NAMES)
    mode = CacheMode(bound[ATTR_CACHE_MODE])  # ValueError for an unknown mode, at trace time
    is_seq_lens_cumsum = bool(bound[ATTR_IS_SEQ_LENS_CUMSUM])
    for name, cache in zip(INPUT_NAMES[:2], (key_cache, value_cache)):
        if cache.dim() != 4:  # the output shapes below read dims 1-3; the validator words the rule at run time
            raise ValueError(f"cannot trace {QUALIFIED_NAME}: its output shapes need a 4-D {name}, got {cache.dim()}-D")
    # Shape relations of the contract, so torch.export ties the symbols together.
    num_seqs = block_tables.shape[0]
    torch._check(value_cache.shape[0] == key_cache.shape[0])
    slot_axis = block_size_axis(mode)
    torch._check(value_cache.shape[slot_axis] == key_cache.shape[slot_axis])
    torch._check(seq_lens.shape[0] == (num_seqs + 1 if is_seq_lens_cumsum else num_seqs))
    if seq_offset is not None:
        torch._check(seq_offset.shape[0] == num_seqs)
    # T depends on the values of seq_lens: a fresh unbacked size, shared by key and value.
    # Each output takes its own cache's dtype (key and value dtypes may differ).
    num_tokens = torch.library.get_ctx().new_dynamic_size()
    key = key_cache.new_empty((num_tokens, *token_shape(key_cache.shape, mode)))
    value = value_cache.new_empty((num_tokens, *token_shape(value_cache.shape, mode)))
    return key, value


def op_overload() -> torch._ops.OpOverload:
    """``torch.ops.pakv.gather_pa_kv_cache.default`` (the overload exporters key on)."""
    return getattr(getattr(torch.ops, DOMAIN), OP_NAME).default
