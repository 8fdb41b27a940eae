"""Graph-level fusions for the non-attention part of an exported decoder step.

The exporter writes a transformers decoder op by op: every RMS norm is seven nodes (``Pow``,
``ReduceMean``, ``Add``, ``Sqrt``, ``Reciprocal``, ``Mul``, ``Mul``) and every rotary embedding of
q or k another seven (``Mul``, two ``Slice``, ``Neg``, ``Concat``, ``Mul``, ``Add``). On a CPU at
decode sizes each node costs a few microseconds whatever its work, so :func:`fuse_step` rewrites
them into ONNX Runtime's contrib ops (in the CPU execution provider of every ORT build, the ops
ORT GenAI's own CPU models use):

- ``skip_rms_norm``: residual ``Add`` + RMS norm -> ``com.microsoft.SkipSimplifiedLayerNormalization``
  (its fourth output is the sum, the next residual);
- ``rms_norm_div``: an RMS norm without a residual ``Add`` (the first one) keeps its standard ops but
  divides by the RMS instead of multiplying by its ``Reciprocal``: the form ORT's own
  SimplifiedLayerNormFusion turns into one ``SimplifiedLayerNormalization`` at session load (that
  op's default-domain registration fails ``onnx.checker``, so the file cannot hold it);
- ``rotary``: ``x * cos + rotate_half(x) * sin`` -> ``com.microsoft.RotaryEmbedding``, its cos/sin
  "cache" being one row per token of this step (``cos(freqs)``, computed once per step from the
  same ``freqs`` the decomposed graph used) and its position ids ``0 .. N-1``: every read of
  the cache is in range whatever the positions, and the angles are the exporter's own;
- ``token_major_rotary``: the same rotation of a projection viewed ``[1, S, H, D]`` and viewed
  back (:mod:`~pakv_onnx.models.hf.gqa`'s q and k) -> one ``RotaryEmbedding`` on the ``[1, S, H*D]``
  projection as it lies (position ids ``[0]``: token s reads row s) and the final view;
- ``packed_matmul``: ``MatMul``s of one input by constant 2-D weights (q/k/v, gate/up) -> one
  ``MatMul`` by the weights side by side and a ``Split`` (standard ops; GenAI packs q/k/v alike).

Nothing else is touched: the ``pakv`` nodes, the attention (a ``Loop`` or whatever op replaces
it: rules match only the patterns above, on the main graph), the model-local functions (the
``pakv`` ops' fallback bodies). A pattern that does not match exactly (another exponent, an
interleaved rotary, a rotary over more than one sequence's rows) stays as it was. The fused model
still passes ``onnx.checker``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import onnx

MS_DOMAIN = "com.microsoft"
FUSIONS = ("skip_rms_norm", "rms_norm_div", "rotary", "token_major_rotary", "packed_matmul")


@dataclasses.dataclass(frozen=True)
class FusionReport:
    """What :func:`fuse_step` did: ``applied`` maps each fusion of :data:`FUSIONS` to how many
    times it fired; ``before`` / ``after`` count the main graph's nodes by op type."""

    applied: dict[str, int]
    before: Counter
    after: Counter

    @property
    def nodes_before(self) -> int:
        return sum(self.before.values())

    @property
    def nodes_after(self) -> int:
        return sum(self.after.values())


def op_counts(model: onnx.ModelProto) -> Counter:
    """Main-graph nodes of ``model`` by op type (``domain::op`` outside the default domain)."""
    return Counter(f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in model.graph.node)


def _const(value) -> np.ndarray | None:
    """The constant behind an IR value (initializer or folded Constant), or None."""
    if value is None or value.const_value is None:
        return None
    return value.const_value.numpy()


def _is_const(value, expected: list | float) -> bool:
    array = _const(value)
    return array is not None and array.size == np.asarray(expected).size and np.allclose(array.ravel(), expected)


def _static_dim(value, axis: int) -> int | None:
    if value is None or value.shape is None or value.shape.rank() <= axis:
        return None
    dim = value.shape[axis]
    return dim if isinstance(dim, int) else None


def _rms_norm_fails(x, gamma, axes, eps, mean, narrow=None) -> str | None:
    """Why ``gamma * (x / sqrt(ReduceMean(x^2, axes) + eps))`` (``mean`` the ReduceMean's output) is
    not an RMS norm over x's last axis (x fp32, 2-D or 3-D; gamma constant ``[width]``, eps a constant
    scalar), or None when it is. ``narrow``: the widened form's closing Cast (x float16 / bfloat16 widened
    to float32, normalized, cast back to x's type before gamma, as transformers' RMSNorm does in half
    precision)."""
    attributes = mean.producer().attributes  # ONNX defaults: keepdims 1, noop_with_empty_axes 0
    if attributes.get_int("keepdims", 1) != 1 or attributes.get_int("noop_with_empty_axes", 0) != 0:
        return "the mean does not keep its axis"
    rank = x.shape.rank() if x.shape is not None else None
    if rank not in (2, 3):
        return "x is not 2-D or 3-D"
    if not (_is_const(axes, [-1]) or _is_const(axes, [rank - 1])):
        return "the mean is not over the last axis"
    g, e = _const(gamma), _const(eps)
    if g is None or g.shape != (_static_dim(x, rank - 1),) or e is None or e.size != 1:
        return "gamma is not a constant [width] or epsilon not a constant scalar"
    if narrow is None:
        return None if x.dtype == onnx.TensorProto.FLOAT else "not fp32"
    if x.dtype not in _HALF_TYPES or narrow.producer().attributes.get_int("to", 0) != x.dtype:
        return "not a float16 / bfloat16 x widened to float32 and cast back to its type"
    return None if gamma.dtype == x.dtype else "gamma is not of x's type"


_HALF_TYPES = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def _skip_rms_norm_rule(widened: bool = False):
    """``Add(a, b)`` then an RMS norm of the sum scaled by a 1-D ``gamma`` -> one
    ``SkipSimplifiedLayerNormalization(a, b, gamma)`` giving the normalized sum and the sum (``widened``:
    the half-precision form, the sum cast to float32 for the norm and back before gamma; ORT's op
    computes in float32 itself)."""
    from onnxscript.rewriter import pattern

    class SkipRmsNorm(pattern.RewriteRuleClassBase):
        def pattern(self, op, a, b, gamma, axes, eps):
            total = op.Add(a, b)
            x = op.Cast(total, to=onnx.TensorProto.FLOAT) if widened else total
            mean_square = op.ReduceMean(op.Pow(x, 2.0), axes, _allow_other_attributes=True, _outputs=["mean"])
            normalized = op.Mul(x, op.Reciprocal(op.Sqrt(op.Add(mean_square, eps))))
            if widened:
                normalized = op.Cast(normalized, _allow_other_attributes=True, _outputs=["narrow"])
            return op.Mul(gamma, normalized), total

        def check(self, context, a, b, gamma, axes, eps, mean, narrow=None, **_):
            result = pattern.MatchResult()
            if context.graph_or_function is not context.model.graph:
                return result.fail("not in the main graph (subgraphs hold the attention: not ours)")
            rank = a.shape.rank() if a.shape is not None else None
            if rank not in (2, 3) or b.shape is None or b.shape.rank() != rank:
                return result.fail("the residual and its update must be 2-D or 3-D of one rank")
            if not all(str(x) == str(y) for x, y in zip(a.shape, b.shape)):
                return result.fail("the residual and its update differ in shape")
            why = _rms_norm_fails(a, gamma, axes, eps, mean, narrow)
            return result.fail(why) if why else result

        def rewrite(self, op, a, b, gamma, eps, **_):
            normalized, _mean, _inv_std, total = op.SkipSimplifiedLayerNormalization(
                a, b, gamma, epsilon=float(_const(eps).ravel()[0]), _domain=MS_DOMAIN, _outputs=4
            )
            return normalized, total

    return SkipRmsNorm.rule()


def _rms_norm_div_rule(widened: bool = False):
    """An RMS norm without a residual ``Add`` (the first layer's, a latent's), ``gamma * (x *
    Reciprocal(rms))`` -> ``gamma * (x / rms)``: standard ops still, in the form ORT's own
    SimplifiedLayerNormFusion turns into one ``SimplifiedLayerNormalization`` when it loads the model
    (that op is registered in the default domain only, where ``onnx.checker`` does not know it, so
    the file cannot hold it). ``widened``: the half-precision form (:func:`_skip_rms_norm_rule`'s), its
    casts kept."""
    from onnxscript.rewriter import pattern

    class RmsNormDiv(pattern.RewriteRuleClassBase):
        def pattern(self, op, x, two, gamma, axes, eps):
            wide = op.Cast(x, to=onnx.TensorProto.FLOAT) if widened else x
            mean_square = op.ReduceMean(op.Pow(wide, two), axes, _allow_other_attributes=True, _outputs=["mean"])
            normalized = op.Mul(wide, op.Reciprocal(op.Sqrt(op.Add(mean_square, eps))))
            if widened:
                normalized = op.Cast(normalized, _allow_other_attributes=True, _outputs=["narrow"])
            return op.Mul(gamma, normalized)

        def check(self, context, x, two, gamma, axes, eps, mean, narrow=None, **_):
            result = pattern.MatchResult()
            if context.graph_or_function is not context.model.graph:
                return result.fail("not in the main graph (subgraphs hold the attention: not ours)")
            if not _is_const(two, [2.0]):
                return result.fail("not a square")
            why = _rms_norm_fails(x, gamma, axes, eps, mean, narrow)
            return result.fail(why) if why else result

        def rewrite(self, op, x, two, gamma, axes, eps, narrow=None, **_):
            # The matched nodes all go: the norm is written anew, its reduction as it was (keepdims checked).
            wide = op.Cast(x, to=onnx.TensorProto.FLOAT) if widened else x
            mean_square = op.ReduceMean(op.Pow(wide, two), axes, keepdims=1)
            normalized = op.Div(wide, op.Sqrt(op.Add(mean_square, eps)))
            return op.Mul(gamma, op.Cast(normalized, to=x.dtype) if widened else normalized)

    return RmsNormDiv.rule()


def _freqs_of(value, trig: str, axis: int):
    """``f`` if ``value`` is ``Unsqueeze(<trig>(Concat(f, f, axis=-1)), [axis])``, else None."""
    unsqueeze = value.producer()
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or not _is_const(unsqueeze.inputs[1], [axis]):
        return None
    cos = unsqueeze.inputs[0].producer()
    if cos is None or cos.op_type != trig or cos.domain not in ("", "ai.onnx"):
        return None
    concat = cos.inputs[0].producer()
    if concat is None or concat.op_type != "Concat" or len(concat.inputs) != 2:
        return None
    if concat.inputs[0] is not concat.inputs[1] or concat.attributes.get_int("axis", 0) != -1:
        return None
    return concat.inputs[0]


def _rotate_half_fails(x, zero, half, half2, end, axes, axes2, step, step2) -> str | None:
    """Why ``Concat(-Slice(x, half2, end), Slice(x, zero, half))`` is not x's last axis rotated by half
    (x rank 4, its last dim static and even), or None when it is."""
    width = _static_dim(x, 3)
    if x.shape is None or x.shape.rank() != 4 or width is None or width % 2:
        return "x is not 4-D with a static, even last dim"
    h = width // 2
    if not (_is_const(zero, [0]) and _is_const(half, [h]) and _is_const(half2, [h])):
        return "x is not split at D/2"
    big = _const(end)
    if big is None or big.size != 1 or int(big.ravel()[0]) < width:
        return "the second half does not run to the end"
    if not all(_is_const(a, [3]) or _is_const(a, [-1]) for a in (axes, axes2)):
        return "the split is not on the last axis"
    if not (_is_const(step, [1]) and _is_const(step2, [1])):
        return "the split has steps"
    return None


def _rotary_rule():
    """``x * cos4 + Concat(-x[..., h:], x[..., :h]) * sin4`` with ``cos4 = Unsqueeze(Cos(Concat(f, f)), 1)``
    (and ``sin4`` alike) over ``x [B, H, S, D]`` -> ``RotaryEmbedding(x, ids, cos(f) rows, sin(f) rows)``."""
    from onnxscript.rewriter import pattern

    class Rotary(pattern.RewriteRuleClassBase):
        def __init__(self) -> None:
            super().__init__("Rotary")
            # freqs value -> (position ids, cos rows, sin rows): built at the first match, shared
            # by every layer. (Not cleared in cleanup(): the rewriter calls it after each subgraph.)
            self._rows: dict = {}

        def pattern(self, op, x, cos4, sin4, zero, half, half2, end, axes, axes2, step, step2):
            first = op.Slice(x, zero, half, axes, step)
            second = op.Slice(x, half2, end, axes2, step2)
            rotated = op.Concat(op.Neg(second), first, axis=-1)
            return op.Add(op.Mul(x, cos4), op.Mul(rotated, sin4))

        def check(self, context, x, cos4, sin4, zero, half, half2, end, axes, axes2, step, step2, **_):
            result = pattern.MatchResult()
            if context.graph_or_function is not context.model.graph:
                return result.fail("not in the main graph (subgraphs hold the attention: not ours)")
            heads, width = _static_dim(x, 1), _static_dim(x, 3)
            if heads is None:
                return result.fail("x is not [B, H, S, D] with static H")
            why = _rotate_half_fails(x, zero, half, half2, end, axes, axes2, step, step2)
            if why:
                return result.fail(why)
            h = width // 2
            freqs = _freqs_of(cos4, "Cos", 1)
            if freqs is None or _freqs_of(sin4, "Sin", 1) is not freqs:
                return result.fail("cos/sin are not cos/sin of Concat(freqs, freqs)")
            if freqs.shape is None or freqs.shape.rank() != 3 or _static_dim(freqs, 2) != h:
                return result.fail("freqs is not [B, S, D/2]")
            if str(freqs.shape[0]) != str(x.shape[0]) or str(freqs.shape[1]) != str(x.shape[2]):
                return result.fail("freqs' [B, S] is not x's")
            return result

        def rows(self, op, freqs):
            """``(ids [B, S], cos [B*S, D/2], sin [B*S, D/2])``: token i's angles are cache row i."""
            if freqs not in self._rows:
                h = freqs.shape[2]
                flat = op.Reshape(freqs, op.Constant(value_ints=[-1, h]))
                count = op.Squeeze(op.Shape(flat, start=0, end=1), op.Constant(value_ints=[0]))
                ids = op.Range(op.Constant(value_int=0), count, op.Constant(value_int=1))
                ids = op.Reshape(ids, op.Shape(freqs, start=0, end=2))
                self._rows[freqs] = (ids, op.Cos(flat), op.Sin(flat))
            return self._rows[freqs]

        def rewrite(self, op, x, cos4, **_):
            ids, cos, sin = self.rows(op, _freqs_of(cos4, "Cos", 1))
            return op.RotaryEmbedding(x, ids, cos, sin, interleaved=0, num_heads=x.shape[1], _domain=MS_DOMAIN)

    return Rotary.rule()


def _token_major_rotary_rule():
    """``Reshape(x4 * cos4 + Concat(-x4[..., h:], x4[..., :h]) * sin4, out_shape)`` over ``x4 =
    Reshape(x [1, S, H*D], [1, S, H, D])`` with ``cos4 = Unsqueeze(Cos(Concat(f, f)), 2)`` (and ``sin4``
    alike; :mod:`~pakv_onnx.models.hf.gqa`'s q and k) -> ``Reshape(RotaryEmbedding(x, [0], cos(f) rows,
    sin(f) rows, num_heads=H), out_shape)``: the op rotates the projection as it lies, row-major the
    same elements. Position ids ``[0]`` make token s read cache row ``0 + s`` (one sequence of S)."""
    from onnxscript.rewriter import pattern

    class TokenMajorRotary(pattern.RewriteRuleClassBase):
        def __init__(self) -> None:
            super().__init__("TokenMajorRotary")
            self._rows: dict = {}  # freqs value -> (cos rows, sin rows), shared by every layer (as Rotary's)

        def pattern(self, op, x, heads_shape, out_shape, cos4, sin4, zero, half, half2, end, axes, axes2, step, step2):
            x4 = op.Reshape(x, heads_shape, _allow_other_attributes=True, _outputs=["x4"])
            first = op.Slice(x4, zero, half, axes, step)
            second = op.Slice(x4, half2, end, axes2, step2)
            rotated = op.Concat(op.Neg(second), first, axis=-1)
            return op.Reshape(op.Add(op.Mul(x4, cos4), op.Mul(rotated, sin4)), out_shape, _allow_other_attributes=True)

        def check(self, context, x, x4, out_shape, cos4, sin4, zero, half, half2, end, axes, axes2, step, step2, **_):
            result = pattern.MatchResult()
            if context.graph_or_function is not context.model.graph:
                return result.fail("not in the main graph (subgraphs hold the attention: not ours)")
            why = _rotate_half_fails(x4, zero, half, half2, end, axes, axes2, step, step2)
            if why:
                return result.fail(why)
            heads, width = _static_dim(x4, 2), _static_dim(x4, 3)
            if x.shape is None or x.shape.rank() != 3 or heads is None or _static_dim(x, 2) != heads * width:
                return result.fail("x is not [B, S, H*D] of x4 [B, S, H, D] with static H")
            if _static_dim(x, 0) != 1 or _static_dim(x4, 0) != 1 or str(x.shape[1]) != str(x4.shape[1]):
                return result.fail("x and x4 are not one sequence [1, S, ...] of one S")
            freqs = _freqs_of(cos4, "Cos", 2)
            if freqs is None or _freqs_of(sin4, "Sin", 2) is not freqs:
                return result.fail("cos/sin are not cos/sin of Concat(freqs, freqs) unsqueezed at the heads")
            if freqs.shape is None or freqs.shape.rank() != 3 or _static_dim(freqs, 2) != width // 2:
                return result.fail("freqs is not [1, S, D/2]")
            if _static_dim(freqs, 0) != 1 or str(freqs.shape[1]) != str(x.shape[1]):
                return result.fail("freqs' [1, S] is not x's")
            target = _const(out_shape)
            if target is None or (target == 0).any():  # a 0 copies an input dim: the input's rank changes
                return result.fail("the output shape is not a constant without zeros")
            return result

        def rewrite(self, op, x, x4, out_shape, cos4, **_):
            freqs = _freqs_of(cos4, "Cos", 2)
            if freqs not in self._rows:
                flat = op.Reshape(freqs, op.Constant(value_ints=[-1, freqs.shape[2]]))
                self._rows[freqs] = (op.Cos(flat), op.Sin(flat))
            cos, sin = self._rows[freqs]
            ids = op.Constant(value_ints=[0])
            rotated = op.RotaryEmbedding(x, ids, cos, sin, interleaved=0, num_heads=x4.shape[2], _domain=MS_DOMAIN)
            return op.Reshape(rotated, out_shape)

    return TokenMajorRotary.rule()


def _pack_matmuls(graph) -> int:
    """Merge the main graph's ``MatMul(a, W_i)`` sharing ``a`` (each ``W_i`` a constant fp32 or fp16
    ``[K, N_i]`` initializer) into ``Split(MatMul(a, [W_1 .. W_n]), [N_1 .. N_n], axis=-1)``; returns
    how many groups were merged. Each output column is the same dot product as before."""
    import onnx_ir as ir

    groups: dict = {}
    for node in graph:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        weight = node.inputs[1]
        array = _const(weight)
        if array is None or array.ndim != 2 or array.dtype not in (np.float32, np.float16) or not weight.is_initializer():
            continue
        if any(out.is_graph_output() for out in node.outputs):
            continue
        groups.setdefault(node.inputs[0], []).append((node, array))
    merged = 0
    for a, members in groups.items():
        if len(members) < 2:
            continue
        nodes, arrays = [m[0] for m in members], [m[1] for m in members]
        packed = ir.Value(name=f"{nodes[0].name}_packed_weight", const_value=ir.tensor(np.concatenate(arrays, axis=1)))
        graph.register_initializer(packed)
        widths = ir.Value(
            name=f"{nodes[0].name}_packed_widths",
            const_value=ir.tensor(np.array([w.shape[1] for w in arrays], np.int64)),
        )
        graph.register_initializer(widths)
        matmul = ir.Node("", "MatMul", [a, packed], name=f"{nodes[0].name}_packed")
        split = ir.Node(
            "",
            "Split",
            [matmul.outputs[0], widths],
            {"axis": ir.AttrInt64("axis", -1)},
            num_outputs=len(nodes),
            name=f"{nodes[0].name}_packed_split",
        )
        first = min(nodes, key=lambda n: list(graph).index(n))
        graph.insert_before(first, [matmul, split])
        for old, new in zip(nodes, split.outputs):
            new.shape, new.type, new.name = old.outputs[0].shape, old.outputs[0].type, f"{old.outputs[0].name}_split"
            ir.convenience.replace_all_uses_with(old.outputs[0], new)
        graph.remove(nodes, safe=True)
        merged += 1
    return merged


def fuse_step(model: onnx.ModelProto) -> tuple[onnx.ModelProto, FusionReport]:
    """Apply :data:`FUSIONS` to ``model``'s main graph (see the module docstring); returns the
    fused model (a new proto; ``model`` is not changed) and a :class:`FusionReport`. Each call
    builds its own rules (the rotary rule keeps per-model state).

    Needs onnxscript (the exporter's own dependency).
    """
    import onnx_ir as ir
    from onnxscript import optimizer
    from onnxscript.rewriter import pattern

    before = op_counts(model)
    graph = ir.serde.deserialize_model(model)
    functions = dict(graph.functions)  # the pakv fallback bodies: not ours to rewrite
    graph.functions.clear()
    applied = {}
    rules = (
        ("skip_rms_norm", _skip_rms_norm_rule()),
        ("skip_rms_norm", _skip_rms_norm_rule(widened=True)),
        ("rms_norm_div", _rms_norm_div_rule()),  # after them: the norms left have no residual Add
        ("rms_norm_div", _rms_norm_div_rule(widened=True)),
        ("rotary", _rotary_rule()),
        ("token_major_rotary", _token_major_rotary_rule()),
    )
    for name, rule in rules:
        applied[name] = applied.get(name, 0) + pattern.RewriteRuleSet([rule], commute=True).apply_to_model(graph)
    applied["packed_matmul"] = _pack_matmuls(graph.graph)
    optimizer.remove_unused_nodes(graph)
    # The rewrites' Constant nodes become initializers (as the exporter writes its constants).
    ir.passes.common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(graph)
    ir.passes.common.TopologicalSortPass()(graph)
    graph.functions.update(functions)
    if any(applied.values()):
        graph.opset_imports.setdefault(MS_DOMAIN, 1)
    fused = ir.serde.serialize_model(graph)
    return fused, FusionReport(applied, before, op_counts(fused))
