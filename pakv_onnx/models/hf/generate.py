"""Greedy generation over a paged cache, and transformers' own greedy generation to compare with.

:func:`generate_paged` is a small continuous-batching loop: every live sequence feeds its pending
tokens (the whole prompt first, then one token per step) into one step, which writes its new K/V
rows into the pools itself, each sequence takes the argmax of its logits, and a sequence that has
its token budget leaves the batch and returns its blocks. The step is any callable from named
feeds to named outputs: an ONNX Runtime session (:func:`session_step`: plugin or stock, the
``present.<l>.*`` outputs bound to the input pools) or the eager module.

The per-step pieces a serving engine calls itself: :func:`step_inputs` (lay out a step and make
its feeds), :func:`session_step` (run it in ORT, pools written in place), :func:`run_step` (both,
then :meth:`PagedKVCache.commit`).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Mapping

import torch

from pakv_onnx import runtime_plugin
from pakv_onnx.models.hf.cache import PagedKVCache, StepLayout
from pakv_onnx.models.hf.configs import CacheGeometry, cache_geometry
from pakv_onnx.models.hf.step import present_bindings, step_feeds

StepFn = Callable[[dict[str, torch.Tensor]], Mapping[str, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class Workload:
    """Prompts and per-sequence token budgets (different budgets: sequences finish at different steps)."""

    prompts: list[list[int]]
    budgets: list[int]

    @property
    def generated_tokens(self) -> int:
        return sum(self.budgets)


@dataclasses.dataclass
class Generation:
    """Greedy tokens and the logits each was chosen from, per sequence."""

    tokens: list[list[int]]
    logits: list[torch.Tensor]  # per sequence fp32 [budget, vocab]
    seconds: float = 0.0
    steps: int = 0


def make_workload(
    *, batch: int, new_tokens: int, vocab_size: int, seed: int, min_prompt: int = 3, max_prompt: int = 40
) -> Workload:
    """``batch`` random prompts of different lengths; budgets ``new_tokens`` down to about half of it."""
    if batch < 1 or new_tokens < 1:
        raise ValueError(f"batch and new_tokens must be >= 1, got {batch} and {new_tokens}")
    rng = random.Random(seed)
    lengths = (
        rng.sample(range(min_prompt, max_prompt + 1), batch)
        if batch <= max_prompt - min_prompt + 1
        else [rng.randint(min_prompt, max_prompt) for _ in range(batch)]
    )
    prompts = [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]
    drop = max(1, new_tokens // 4)
    budgets = [max(1, new_tokens - (i % 3) * drop) for i in range(batch)]
    return Workload(prompts, budgets)


def blocks_needed(workload: Workload, block_size: int) -> int:
    """Blocks for every sequence at its full length (enough without reuse)."""
    return sum(-(-(len(p) + b) // block_size) for p, b in zip(workload.prompts, workload.budgets))


def new_cache(
    model_config,
    workload: Workload,
    block_size: int,
    seed: int,
    spare_blocks: int = 3,
    *,
    geometry: CacheGeometry | None = None,
    dtype: torch.dtype = torch.float32,
) -> PagedKVCache:
    """Fresh pools sized for ``workload`` plus a few spare blocks: ``geometry`` (default: the pakv
    form's, :func:`cache_geometry`; a step's own: :meth:`PagedDecoderStep.geometry`) and ``dtype``
    (fp32; a quantized step's: :attr:`PagedDecoderStep.pool_dtype`)."""
    return PagedKVCache(
        num_layers=model_config.num_hidden_layers,
        geometry=geometry or cache_geometry(model_config),
        num_blocks=blocks_needed(workload, block_size) + spare_blocks,
        block_size=block_size,
        dtype=dtype,
        seed=seed,
    )


def step_inputs(
    cache: PagedKVCache, seq_ids: list[int], tokens: list[list[int]]
) -> tuple[list[int], StepLayout, dict[str, torch.Tensor]]:
    """Lay out one step in which sequence ``seq_ids[k]`` feeds ``tokens[k]`` (at the positions after
    its cached tokens): ``(new token counts, layout, the graph's named feeds)``. Reserves the
    blocks the new tokens need."""
    counts = [len(t) for t in tokens]
    layout = cache.prepare_step(seq_ids, counts)
    input_ids = torch.tensor([t for chunk in tokens for t in chunk], dtype=torch.int64)
    return counts, layout, step_feeds(cache, layout, input_ids)


def session_step(session) -> StepFn:
    """A step function over an ORT session (plugin or stock): torch feeds bound zero-copy, each
    ``present.<l>.*`` output bound to its input pool's buffer (as ORT GenAI binds them), so the
    plugin's write op writes only the step's rows into the caller's pools."""
    return lambda feeds: runtime_plugin.run(session, feeds, out=present_bindings(feeds))


def run_step(
    step: StepFn, cache: PagedKVCache, seq_ids: list[int], tokens: list[list[int]]
) -> Mapping[str, torch.Tensor]:
    """One step laid out by :func:`step_inputs`, run through ``step`` (which writes the pools),
    committed to the cache (:meth:`PagedKVCache.commit`); returns the step's outputs."""
    counts, _, feeds = step_inputs(cache, seq_ids, tokens)
    outputs = step(feeds)
    cache.commit(seq_ids, counts, outputs)
    return outputs


def generate_paged(step: StepFn, cache: PagedKVCache, workload: Workload) -> Generation:
    """Greedy generation of ``workload`` through ``step`` over ``cache`` (see the module docstring).

    Raises:
        RuntimeError: a block was not returned to the pool after every sequence finished.
    """
    count = len(workload.prompts)
    tokens: list[list[int]] = [[] for _ in range(count)]
    logits: list[list[torch.Tensor]] = [[] for _ in range(count)]
    pending = {i: list(p) for i, p in enumerate(workload.prompts)}
    live = list(range(count))
    for i in live:
        cache.add_sequence(i)
    steps = 0
    start = time.perf_counter()
    while live:
        step_logits = run_step(step, cache, live, [pending[i] for i in live])["logits"]
        chosen = step_logits.argmax(dim=-1).tolist()
        for row, i in enumerate(live):
            tokens[i].append(int(chosen[row]))
            logits[i].append(step_logits[row].clone())
            pending[i] = [int(chosen[row])]
        for i in [i for i in live if len(tokens[i]) == workload.budgets[i]]:
            cache.release(i)
            live.remove(i)
        steps += 1
    seconds = time.perf_counter() - start
    if cache.allocator.num_free != cache.allocator.num_blocks:
        raise RuntimeError(f"{cache.allocator.num_blocks - cache.allocator.num_free} blocks were not returned")
    return Generation(tokens, [torch.stack(x) for x in logits], seconds, steps)


def generate_reference(model: torch.nn.Module, workload: Workload) -> Generation:
    """transformers' ``generate(do_sample=False)`` per prompt with its default dense cache.

    Each prompt runs alone (no padding), so positions match the paged run exactly; EOS is
    disabled so every sequence runs its full budget and the logits are the raw ones.
    """
    tokens, logits = [], []
    with torch.no_grad():  # warm-up: first calls pay lazy initialisation, not generation
        model.generate(input_ids=torch.tensor([workload.prompts[0]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    start = time.perf_counter()
    for prompt, budget in zip(workload.prompts, workload.budgets):
        ids = torch.tensor([prompt], dtype=torch.int64)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=budget,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        tokens.append(out.sequences[0, len(prompt) :].tolist())
        logits.append(torch.stack([step[0] for step in out.logits]).to(torch.float32))
    return Generation(tokens, logits, time.perf_counter() - start, 0)


def compare(result: Generation, reference: Generation) -> tuple[bool, float]:
    """``(tokens identical, max abs logit difference)`` of a paged run vs the reference."""
    same = result.tokens == reference.tokens
    err = 0.0
    for mine, ref in zip(result.logits, reference.logits):
        if mine.shape != ref.shape:
            return False, float("inf")
        err = max(err, float((mine - ref).abs().max()))
    return same, err


def teacher_forced(step: StepFn, cache: PagedKVCache, prompts: list[list[int]], tokens: list[list[int]]) -> Generation:
    """The logits ``step`` gives when sequence ``i`` is fed its prompt and then ``tokens[i]`` (another run's
    tokens, not its own argmax): ``logits[i][k]`` predicts ``tokens[i][k]``, so two precisions compare
    step by step even where their greedy tokens part. ``Generation.tokens`` holds the step's own argmax at
    each position (where it differs from ``tokens``, greedy decoding would have flipped there)."""
    count = len(prompts)
    chosen: list[list[int]] = [[] for _ in range(count)]
    logits: list[list[torch.Tensor]] = [[] for _ in range(count)]
    pending = {i: list(p) for i, p in enumerate(prompts)}
    live = [i for i in range(count) if tokens[i]]
    for i in live:
        cache.add_sequence(i)
    start = time.perf_counter()
    while live:
        step_logits = run_step(step, cache, live, [pending[i] for i in live])["logits"]
        for row, i in enumerate(live):
            chosen[i].append(int(step_logits[row].argmax()))
            logits[i].append(step_logits[row].to(torch.float32).clone())
            pending[i] = [tokens[i][len(chosen[i]) - 1]]
        for i in [i for i in live if len(chosen[i]) == len(tokens[i])]:
            cache.release(i)
            live.remove(i)
    return Generation(chosen, [torch.stack(x) for x in logits], time.perf_counter() - start, 0)


@dataclasses.dataclass(frozen=True)
class Flip:
    """A position where a run's argmax differs from the reference's token: the reference's top-2 gap there
    (a near tie when it is within the two runs' logit difference)."""

    sequence: int
    position: int
    top2_gap: float
    logit_diff: float  # max |run - reference| over the vocabulary at that position


def flips(forced: Generation, reference: Generation) -> tuple[float, list[Flip]]:
    """``(max |forced - reference| logit, the flips)`` of a :func:`teacher_forced` run fed the reference's
    tokens, against that reference (its logits and tokens)."""
    worst, found = 0.0, []
    for i, (mine, ref) in enumerate(zip(forced.logits, reference.logits)):
        diff = (mine - ref).abs().amax(dim=-1)
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
        for k, (token, want) in enumerate(zip(forced.tokens[i], reference.tokens[i])):
            if token != want:
                top2 = ref[k].topk(2).values
                found.append(Flip(i, k, float(top2[0] - top2[1]), float(diff[k])))
    return worst, found
