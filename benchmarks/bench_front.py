"""Benchmark of the Python front against the ORT plugin call (issue 14): medians and ratios, one run.

Every variant gathers the same case into outputs it reuses, timed in blocks of consecutive calls,
blocks alternating between variants (``_timing.blocked_medians_us``: a serving loop calls one
path back to back; single calls in turn would make each pay the caches the others evicted); the
floor is the ORT plugin's C kernel driven through an IOBinding built once (`runtime_plugin.bind`,
as benchmarks/bench_ort.py does):

  plugin       session.run_with_iobinding, native C kernel                     (the floor, 1x)
  front-native pakv_onnx.gather_pa_kv_cache(..., key_out=, value_out=, backend="native")
  torch.ops    torch.ops.pakv.gather_pa_kv_cache(...) (default backend, allocates its outputs)
  cb-golden    the plugin's Python callback into the golden backend (prebound IOBinding)
  cb-torch     the plugin's Python callback into the torch backend (prebound IOBinding)
  noop-op      a no-op torch.library.custom_op returning two empty tensors (the dispatcher's cost)
  plugin-alloc (large T) session.run with ORT allocating the outputs each call (its arena reuses them)
  index_select (large T) torch's own allocating gather of the same whole blocks (fresh outputs per call)

Shapes: the seed case ``level8`` (T = 55, bf16; caches capped to ``--max-blocks`` blocks, 1,024 by
default: a serving-sized pool, 144 MB of caches; the gather reads the same blocks), and a large-T case (``--large-blocks`` blocks of
128 tokens, 8 x 128 bf16) for "large T unchanged". Prints Markdown tables.

    python benchmarks/bench_front.py [--repeats 600] [--max-blocks 1024] [--large-blocks 512]
"""

from __future__ import annotations

import argparse

import torch
from _cases import capped_seed_case, large_case
from _timing import blocked_medians_us, prebound

import pakv_onnx
from pakv_onnx import runtime_plugin
from pakv_onnx.cases import GatherCase
from pakv_onnx.export import make_gather_model_for, torch_op  # noqa: F401  (torch_op registers torch.ops.pakv.*)
from pakv_onnx.spec import INPUT_NAMES, bitwise_equal

# Issue 19's goals (issue 14's, measured in blocks), at the level8 shape. At large T only the front's "unchanged" goal applies:
# torch.ops returns fresh outputs, and first-touching hundreds of MB of them costs more than the
# copy itself; "plugin-alloc" (ORT allocating its outputs each call) shows that floor.
GOALS = {"front-native": 2.0, "torch.ops": 5.0}
LARGE_T_GOALS = {"front-native": 2.0}


@torch.library.custom_op("pakv_bench::noop", mutates_args=())
def _noop(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return key_cache.new_empty(0), value_cache.new_empty(0)


def variants(case: GatherCase, callbacks: bool) -> dict:
    """name -> zero-argument call, each checked bit-exact against the golden once."""
    golden = case.golden()
    outs = {"key": torch.empty_like(golden[0]), "value": torch.empty_like(golden[1])}
    inputs, attrs = case.inputs(), case.attributes()
    key_out, value_out = torch.empty_like(golden[0]), torch.empty_like(golden[1])
    op = torch.ops.pakv.gather_pa_kv_cache
    mode = attrs["cache_mode"].value
    flag = bool(attrs["is_seq_lens_cumsum"])
    # One model (no fallback function: only the plugin runs the node) for every plugin session.
    model = make_gather_model_for(*inputs, **attrs, shapes=None, fallback=False)
    feeds = {name: t for name, t in zip(INPUT_NAMES, inputs) if t is not None}
    native = runtime_plugin.make_session(model, backend="native")

    def front_native():
        return pakv_onnx.gather_pa_kv_cache(*inputs, **attrs, key_out=key_out, value_out=value_out, backend="native")

    def torch_ops():
        return op(*inputs, cache_mode=mode, is_seq_lens_cumsum=flag)

    for fn in (front_native, torch_ops):
        key, value = fn()
        assert bitwise_equal(key, golden[0]) and bitwise_equal(value, golden[1]), fn.__name__
    plugin = prebound(native, feeds, outs, golden, "native")
    fns = {"plugin": plugin, "front-native": front_native, "torch.ops": torch_ops}
    if not callbacks:  # large T: the allocating floor torch.ops is up against
        fns["plugin-alloc"] = lambda: runtime_plugin.run(native, feeds)
        # The large case reads whole blocks in table order: torch's own allocating gather of them.
        block_ids = case.block_tables.flatten().to(torch.int64)
        keys, values = case.key_cache, case.value_cache
        fns["index_select"] = lambda: (keys.index_select(0, block_ids), values.index_select(0, block_ids))
    if callbacks:
        for backend in ("golden", "torch"):
            session = runtime_plugin.make_session(model, backend=backend)
            fns[f"cb-{backend}"] = prebound(session, feeds, outs, golden, backend)
        fns["noop-op"] = lambda: _noop(inputs[0], inputs[1])
    return fns


def print_table(title: str, medians: dict, goals: dict) -> None:
    floor = medians["plugin"]
    print(f"\n{title}\n")
    print("| call | us | vs plugin | goal |")
    print("|---|---|---|---|")
    for name, us in medians.items():
        goal = f"<= {goals[name]:.0f}x" if name in goals else "-"
        print(f"| {name} | {us:.1f} | {us / floor:.2f}x | {goal} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=600, help="calls of each variant (in blocks of 30)")
    parser.add_argument("--max-blocks", type=int, default=1024, help="cap level8's num_blocks (0: as seeded)")
    parser.add_argument("--large-blocks", type=int, default=512, help="blocks of 128 tokens for large T (0: skip)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    small = capped_seed_case("level8", args.max_blocks)
    print_table(
        f"level8 (T = 55, bf16, {small.key_cache.shape[0]} blocks), median of block medians, {args.repeats} calls each",
        blocked_medians_us(variants(small, callbacks=True), args.repeats, warmup=20),
        GOALS,
    )
    if args.large_blocks:
        big = large_case(args.large_blocks)
        repeats = max(5, args.repeats // 20)
        print_table(
            f"large T = {args.large_blocks * 128} (8 x 128 bf16), median of block medians, {repeats} calls each",
            blocked_medians_us(variants(big, callbacks=False), repeats, warmup=2, block=5),
            LARGE_T_GOALS,
        )


if __name__ == "__main__":
    main()
