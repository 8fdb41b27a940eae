"""``torch.ops.pakv.gather_pa_kv_cache`` and the scatter ops: the operators as PyTorch custom ops.

The eager implementation is the package front (:func:`pakv_onnx.ops.gather_pa_kv_cache`,
backend ``"auto"``), so validation is the contract's. The fake implementation gives the
outputs a data-dependent token dimension T (an unbacked symbolic size), which is what lets
``torch.export``, ``torch.compile`` and the dynamo ONNX exporter trace models calling it.

The op name is ``pakv::gather_pa_kv_cache`` (the namespace is the ONNX domain of the
contract); the ONNX translation lives in :mod:`pakv_onnx.export.translation`.

The write side has two forms: ``torch.ops.pakv.scatter_pa_kv_cache`` writes the caches in place
(``mutates_args``: what eager code and serving loops call), and
``torch.ops.pakv.scatter_pa_kv_cache_functional`` returns the updated caches (what an exported
graph records: one ``pakv::ScatterPaKvCache`` node whose outputs ORT may alias to its inputs).

``torch.ops.pakv.paged_attention`` is PagedAttention (:func:`pakv_onnx.ops.paged_attention`):
it reads the caches and returns ``[N, Hq, Dv]``; its fake gives that shape from the inputs' own.
"""

from __future__ import annotations

import torch

from pakv_onnx import ops
from pakv_onnx.spec import (
    ATTENTION,
    ATTR_CACHE_MODE,
    ATTR_IS_SEQ_LENS_CUMSUM,
    ATTRIBUTE_DEFAULTS,
    DOMAIN,
    INPUT_NAMES,
    OPTIONAL_INPUTS,
    OUTPUT_NAMES,
    SCATTER,
    CacheMode,
    bind_arguments,
    block_size_axis,
    token_shape,
)

OP_NAME = "gather_pa_kv_cache"
QUALIFIED_NAME = f"{DOMAIN}::{OP_NAME}"


def _attribute_decl(name: str, default: str | bool | float) -> str:
    if isinstance(default, bool):
        return f"bool {name}={default}"
    if isinstance(default, float):
        return f"float {name}={default!r}"
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


# The ops' definitions (kept alive with this module). Each is a plain Python kernel behind the
# dispatcher (CompositeExplicitAutograd) with a fake kernel for tracing: torch.library.custom_op's
# wrappers (autograd, dynamo guards, alias checks) cost about 12 us a call, more than the gather.
_LIBRARY = torch.library.Library(DOMAIN, "FRAGMENT")


def _define(name: str, schema: str, kernel, fake, *, meta_needs_data: bool = False) -> torch._ops.OpOverloadPacket:
    """``torch.ops.pakv.<name>``: defined with ``schema``, ``kernel`` eager, ``fake`` under tracing.

    The dispatcher also runs the fake for an eager call whenever one tensor is on the meta device (its
    Meta kernel), even among CPU tensors: the fake would return uninitialised memory or write nothing
    without a word. Such a call (no fake tensor in it, and a tensor with data, or any call at all when
    ``meta_needs_data``: an op whose output size depends on index values) runs ``kernel`` instead, whose
    validator names the meta tensor; an all-meta call of a shape-only op keeps the fake (meta in, meta out).
    """
    _LIBRARY.define(name + schema)
    _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{DOMAIN}::{name}", meta_routed(kernel, fake, meta_needs_data), lib=_LIBRARY)
    return getattr(getattr(torch.ops, DOMAIN), name)


def meta_routed(kernel, fake, meta_needs_data: bool = False):
    """The fake kernel to register for an op: ``fake`` under tracing, ``kernel`` for an eager call that
    has a meta tensor among real ones (see :func:`_define`)."""
    from torch._subclasses.fake_tensor import is_fake

    def meta_or_fake(*args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if not any(is_fake(t) for t in tensors) and (meta_needs_data or any(not t.is_meta for t in tensors)):
            return kernel(*args, **kwargs)
        return fake(*args, **kwargs)

    return meta_or_fake


def _gather_kernel(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """GatherPaKvCache as a torch op; arguments (spec.PARAMETER_NAMES) and results as :func:`pakv_onnx.gather_pa_kv_cache`."""
    if not kwargs and len(args) <= len(INPUT_NAMES):
        # The dispatcher passes the tensors positionally and leaves out attributes at their
        # defaults: the front's own defaults are the same (spec.ATTRIBUTE_DEFAULTS), skip binding.
        return ops.gather_pa_kv_cache(*args)
    bound = bind_arguments(args, kwargs)
    return ops.gather_pa_kv_cache(
        *(bound[name] for name in INPUT_NAMES), **{name: bound[name] for name in ATTRIBUTE_DEFAULTS}
    )


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


gather_pa_kv_cache = _define(OP_NAME, torch_schema(), _gather_kernel, _gather_pa_kv_cache_fake, meta_needs_data=True)


def op_overload() -> torch._ops.OpOverload:
    """``torch.ops.pakv.gather_pa_kv_cache.default`` (the overload exporters key on)."""
    return getattr(getattr(torch.ops, DOMAIN), OP_NAME).default


# --------------------------------------------------------------------------- #
# The write side
# --------------------------------------------------------------------------- #
SCATTER_OP_NAME = "scatter_pa_kv_cache"
SCATTER_FUNCTIONAL_OP_NAME = "scatter_pa_kv_cache_functional"
_MUTATED = ("key_cache", "value_cache")


def scatter_torch_schema(functional: bool) -> str:
    """The scatter ops' torch schema from spec.SCATTER: ``(Tensor key, Tensor value, Tensor(a!) key_cache,
    Tensor(b!) value_cache, Tensor slot_mapping, str cache_mode="Norm") -> ()``; the functional form
    mutates nothing and returns the two updated caches."""
    aliases = iter("ab")
    tensors = [
        f"Tensor({next(aliases)}!) {n}" if n in _MUTATED and not functional else f"Tensor {n}" for n in SCATTER.input_names
    ]
    attributes = [_attribute_decl(n, d) for n, d in SCATTER.attribute_defaults.items()]
    returns = "(Tensor, Tensor)" if functional else "()"
    return f"({', '.join(tensors + attributes)}) -> {returns}"


def _scatter_kernel(*args, **kwargs) -> None:
    """ScatterPaKvCache in place; arguments (spec.SCATTER) as :func:`pakv_onnx.scatter_pa_kv_cache`."""
    bound = SCATTER.bind(args, kwargs)
    ops.scatter_pa_kv_cache(*(bound[n] for n in SCATTER.input_names), cache_mode=bound[ATTR_CACHE_MODE])


def _scatter_fake(*args, **kwargs) -> None:
    return None


def _scatter_functional_kernel(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """ScatterPaKvCache returning updated copies of the caches (the form a traced graph records; in
    eager it copies both pools, so eager code calls the in-place op)."""
    bound = SCATTER.bind(args, kwargs)
    key_cache, value_cache = bound["key_cache"].clone(), bound["value_cache"].clone()
    ops.scatter_pa_kv_cache(
        bound["key"], bound["value"], key_cache, value_cache, bound["slot_mapping"], cache_mode=bound[ATTR_CACHE_MODE]
    )
    return key_cache, value_cache


def _scatter_functional_fake(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    bound = SCATTER.bind(args, kwargs)
    return torch.empty_like(bound["key_cache"]), torch.empty_like(bound["value_cache"])


scatter_pa_kv_cache = _define(SCATTER_OP_NAME, scatter_torch_schema(False), _scatter_kernel, _scatter_fake)
scatter_pa_kv_cache_functional = _define(
    SCATTER_FUNCTIONAL_OP_NAME, scatter_torch_schema(True), _scatter_functional_kernel, _scatter_functional_fake
)


def scatter_functional_overload() -> torch._ops.OpOverload:
    """``torch.ops.pakv.scatter_pa_kv_cache_functional.default`` (the overload exporters key on)."""
    return getattr(getattr(torch.ops, DOMAIN), SCATTER_FUNCTIONAL_OP_NAME).default


# --------------------------------------------------------------------------- #
# PagedAttention
# --------------------------------------------------------------------------- #
ATTENTION_OP_NAME = "paged_attention"


def attention_torch_schema() -> str:
    """``(Tensor query, Tensor key_cache, ..., Tensor past_sequence_lengths, float scale=0.0) -> Tensor``, from spec.ATTENTION."""
    tensors = [f"Tensor {n}" for n in ATTENTION.input_names]
    attributes = [_attribute_decl(n, d) for n, d in ATTENTION.attribute_defaults.items()]
    return f"({', '.join(tensors + attributes)}) -> Tensor"


def _attention_kernel(*args, **kwargs) -> torch.Tensor:
    """PagedAttention as a torch op; arguments (spec.ATTENTION) as :func:`pakv_onnx.paged_attention`."""
    bound = ATTENTION.bind(args, kwargs)
    return ops.paged_attention(*(bound[n] for n in ATTENTION.input_names), scale=bound["scale"])


def _attention_fake(*args, **kwargs) -> torch.Tensor:
    bound = ATTENTION.bind(args, kwargs)
    query, key_cache, value_cache = bound["query"], bound["key_cache"], bound["value_cache"]
    if query.dim() != 3 or key_cache.dim() != 4 or value_cache.dim() != 4:  # the validator words it at run time
        raise ValueError(
            f"cannot trace {DOMAIN}::{ATTENTION_OP_NAME}: it needs a 3-D query and 4-D caches, got "
            f"{query.dim()}-D, {key_cache.dim()}-D, {value_cache.dim()}-D"
        )
    torch._check(query.shape[2] == key_cache.shape[3])
    torch._check(bound["cumulative_sequence_lengths"].shape[0] == bound["block_table"].shape[0] + 1)
    return query.new_empty((query.shape[0], query.shape[1], value_cache.shape[3]))


paged_attention = _define(ATTENTION_OP_NAME, attention_torch_schema(), _attention_kernel, _attention_fake)


def attention_overload() -> torch._ops.OpOverload:
    """``torch.ops.pakv.paged_attention.default`` (the overload exporters key on)."""
    return getattr(getattr(torch.ops, DOMAIN), ATTENTION_OP_NAME).default
