"""The host side of the PyPTO kernel: what it supports, its entries, its tiles, and one run.

Imports neither pypto nor torch_npu at import time (the package works without them).

* :func:`unsupported_reason` names the one option a plan needs that the kernel cannot do.
* :func:`build_entries` turns a plan into the kernel's flat ``(block, slot, dst, valid)``
  int32 entries (lengths-mode ``seq_lens``, any ``seq_offset`` through the plan's
  ``table_col_starts`` and int64 indices are all resolved here, on the host; no cache is copied);
  :func:`build_nz_entries` repeats them once per PA_NZ fractal group.
* :func:`choose_tiles` picks the chunk (token slots per entry) and vector tile per cache: the
  cost-model-tuned choice cached by ``pakv-onnx tune`` when there is one (see :mod:`.tiles`),
  else the closed-form rule of :func:`.tiles.rule_tiles`.
* :func:`run_kernel` runs the kernel (NPU, or SIM with the pass-verify interpreter on a CPU).
"""

from __future__ import annotations

import os

import torch

from pakv_onnx.paths import cache_dir, pypto_output_env
from pakv_onnx.plans import GatherPlan, GatherTensors
from pakv_onnx.pypto import SUPPORTED_DTYPE_NAMES
from pakv_onnx.pypto import tiles as tiles_mod
from pakv_onnx.pypto.tiles import ALIGN_BYTES, Tiles, row_width
from pakv_onnx.spec import NZ_FRACTAL_BYTES, CacheMode, nz_last_dim

INT32_MAX = 2**31 - 1

# Cache dtypes the kernel moves natively (the list: pakv_onnx.pypto.SUPPORTED_DTYPE_NAMES).
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(getattr(torch, name) for name in SUPPORTED_DTYPE_NAMES)
# Contract dtypes the kernel refuses, and why.
REFUSED_DTYPES: dict[torch.dtype, str] = {
    torch.float8_e4m3fn: "compiles but fails pypto 0.2.0's pass-verify (FB2002 in FlowVerifier)",
    torch.float8_e5m2: "compiles but fails pypto 0.2.0's pass-verify (FB2002 in FlowVerifier)",
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_reason(name: str, dtype: torch.dtype) -> str | None:
    if dtype in SUPPORTED_DTYPES:
        return None
    why = REFUSED_DTYPES.get(dtype, "no PyPTO data type")
    allowed = ", ".join(dtype_name(d) for d in SUPPORTED_DTYPES)
    return f"{name} dtype {dtype_name(dtype)}: {why} (the PyPTO kernel moves {allowed})"


def unsupported_reason(plan: GatherPlan, cache: torch.Tensor, value_cache: torch.Tensor | None = None) -> str | None:
    """``None`` when the kernel handles ``plan``; otherwise the option it cannot do.

    ``cache`` is the key cache (the registry passes that one); ``value_cache`` when known.
    Each cache's dtype is read from the tensor itself (key and value may differ).
    """
    value_dtype = value_cache.dtype if value_cache is not None else plan.value_dtype
    for name, dtype in (("key_cache", cache.dtype), ("value_cache", value_dtype)):
        reason = _dtype_reason(name, dtype)
        if reason:
            return reason
    for name, tensor in (("key_cache", cache), ("value_cache", value_cache)):
        if tensor is not None and not tensor.is_contiguous():
            return (
                f"{name} is a strided (pool) view with block stride {tensor.stride(0)} elements "
                "(the PyPTO kernel hands each cache in as a reshaped view and needs it contiguous)"
            )
    if plan.cache_mode is CacheMode.NORM:
        for which, dtype in (("key", cache.dtype), ("value", value_dtype)):
            itemsize = dtype.itemsize
            width = row_width(plan, which)
            if (width * itemsize) % ALIGN_BYTES:
                return (
                    f"{which} token row of heads*head_dim = {width} x {itemsize} bytes = {width * itemsize} bytes "
                    f"(PyPTO vector tiles need rows that are a multiple of {ALIGN_BYTES} bytes)"
                )
    if plan.num_blocks * plan.block_size > INT32_MAX or plan.num_tokens > INT32_MAX:
        return "more than 2**31 - 1 cache rows or output tokens (the kernel indexes with int32)"
    if plan.cache_mode is CacheMode.PA_NZ:
        fractals = (
            max(row_width(plan, "key") * cache.dtype.itemsize, row_width(plan, "value") * value_dtype.itemsize)
            // NZ_FRACTAL_BYTES
        )
        if max(plan.num_blocks, plan.num_tokens) * fractals > INT32_MAX:
            return "more than 2**31 - 1 fractal rows in a cache or an output (the kernel indexes with int32)"
    # Whether any tiles fit, not which (that reads the tuned-tiles file; `tune` saves only shapes that have some).
    if not tiles_mod.candidate_tiles(tiles_mod.shape_of(plan, cache.dtype.itemsize, value_dtype.itemsize)):
        return tiles_mod.NO_TILE_FITS
    return None


def choose_tiles(plan: GatherPlan, key_dtype: torch.dtype, value_dtype: torch.dtype) -> Tiles:
    """The tiles the kernel uses for ``plan``: tuned (cached by ``tune``) if known, else the rule."""
    shape = tiles_mod.shape_of(plan, key_dtype.itemsize, value_dtype.itemsize)
    return tiles_mod.tuned(shape) or tiles_mod.rule_tiles(shape)


# --------------------------------------------------------------------------- #
# Entries
# --------------------------------------------------------------------------- #
def build_entries(plan: GatherPlan, chunk: int) -> torch.Tensor:
    """Int32 ``[E, 4]`` rows ``(block, slot, dst, valid)``: one per chunk of ``chunk`` tokens.

    Sequence q's token t reads block ``block_tables[q, table_col_starts[q] + t // bs]`` slot
    ``t % bs`` (the floor rule), so chunk j of q starts at token ``j * chunk``; ``chunk``
    divides ``block_size``, so no chunk crosses a block. For Norm, field 0 is the cache row
    ``block * bs + slot`` instead (one multiply per entry done here, not in every task).
    """
    bs = plan.block_size
    if bs % chunk:
        raise ValueError(f"chunk {chunk} must divide block_size {bs}")
    lengths = plan.seq_lengths.to(torch.int64)
    per_seq = (lengths + chunk - 1) // chunk
    total = int(per_seq.sum())
    if total == 0:
        return torch.zeros((0, 4), dtype=torch.int32)
    seq = torch.repeat_interleave(torch.arange(plan.num_seqs), per_seq)
    first = torch.cumsum(per_seq, 0) - per_seq
    token = (torch.arange(total) - first[seq]) * chunk
    col = plan.table_col_starts.to(torch.int64)[seq] + token // bs
    block = plan.block_tables.to(torch.int64)[seq, col]
    slot = token % bs
    if plan.cache_mode is CacheMode.NORM:
        block, slot = block * bs + slot, torch.zeros_like(slot)
    valid = torch.clamp(lengths[seq] - token, max=chunk)
    dst = plan.out_starts.to(torch.int64)[seq] + token
    entries = torch.stack((block, slot, dst, valid), dim=1)
    if int(entries.max()) > INT32_MAX:
        raise ValueError("an entry exceeds int32 (the kernel reads int32 entries)")
    return entries.to(torch.int32).contiguous()


def build_nz_entries(plan: GatherPlan, tiles: Tiles, key_fractals: int, value_fractals: int) -> torch.Tensor:
    """Int32 ``[E, 6]`` PA_NZ rows ``(block, slot, dst, valid, key_first, value_first)``.

    Each chunk's :func:`build_entries` row, repeated for ``g`` in ``range(G)`` with the first
    fractal of key group ``g % key_groups`` and value group ``g % value_groups``
    (``G`` = the larger group count; one count divides the other, :func:`.tiles.valid_for`).
    """
    key_group, value_group = tiles.key_tile[0], tiles.value_tile[0]
    if key_fractals % key_group or value_fractals % value_group:
        raise ValueError(
            f"fractal groups {key_group}/{value_group} must divide the fractals {key_fractals}/{value_fractals}"
        )
    key_groups, value_groups = key_fractals // key_group, value_fractals // value_group
    if key_groups % value_groups and value_groups % key_groups:
        raise ValueError(f"group counts {key_groups} and {value_groups}: one must divide the other")
    base = build_entries(plan, tiles.chunk).to(torch.int64)
    groups = max(key_groups, value_groups)
    g = torch.arange(groups).repeat(base.shape[0])
    firsts = torch.stack(((g % key_groups) * key_group, (g % value_groups) * value_group), dim=1)
    return torch.cat((base.repeat_interleave(groups, dim=0), firsts), dim=1).to(torch.int32).contiguous()


def nz_kind(tiles: Tiles) -> str:
    """The PA_NZ kernel for ``tiles``: ``nz_rows`` for one slot per task (no transpose), else ``nz``."""
    return "nz_rows" if tiles.chunk == 1 else "nz"


def kernel_inputs(plan: GatherPlan, tensors: GatherTensors, tiles: Tiles) -> tuple[torch.Tensor, ...]:
    """The gather kernel's tensor arguments on the caches' device (outputs as views, no copy)."""
    key_cache, value_cache, key_out, value_out = tensors
    if plan.cache_mode is CacheMode.NORM:
        entries = build_entries(plan, tiles.chunk).to(key_cache.device)
        key_width, value_width = row_width(plan, "key"), row_width(plan, "value")
        return (
            key_cache.view(-1, key_width),
            value_cache.view(-1, value_width),
            entries,
            key_out.view(plan.num_tokens, key_width),
            value_out.view(plan.num_tokens, value_width),
        )
    entries = build_nz_entries(plan, tiles, key_cache.shape[1], value_cache.shape[1]).to(key_cache.device)
    if nz_kind(tiles) == "nz_rows":
        return (
            key_cache.view(-1, key_cache.shape[2] * key_cache.shape[3]),
            value_cache.view(-1, value_cache.shape[2] * value_cache.shape[3]),
            entries,
            key_out.view(-1, key_cache.shape[3]),
            value_out.view(-1, value_cache.shape[3]),
        )
    return (
        key_cache.view(-1, key_cache.shape[2], key_cache.shape[3]),
        value_cache.view(-1, value_cache.shape[2], value_cache.shape[3]),
        entries,
        _nz_out_view(key_out, key_cache),
        _nz_out_view(value_out, value_cache),
    )


def kernel_scalars(plan: GatherPlan, key_cache: torch.Tensor, value_cache: torch.Tensor, tiles: Tiles) -> tuple:
    """The kernel's static tuple: the tiles, and for PA_NZ each cache's fractal count C."""
    if plan.cache_mode is CacheMode.NORM or tiles.kind == "seed":
        return tiles.kernel_tuple()
    return (*tiles.kernel_tuple(), key_cache.shape[1], value_cache.shape[1])


def _nz_out_view(out: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """``[T, H*D]`` seen as ``[T, C, E]`` (the kernel cannot reshape its output)."""
    e_dim = nz_last_dim(cache.element_size())
    return out.view(out.shape[0], -1, e_dim)


def seed_kernel_inputs(plan: GatherPlan, tensors: GatherTensors) -> tuple[torch.Tensor, ...]:
    """Arguments of the seed's nested-loop kernel (Norm only), for pricing the seed's rule."""
    key_cache, value_cache, key_out, value_out = tensors
    device = key_cache.device
    starts = torch.cat((plan.out_starts, torch.tensor([plan.num_tokens]))).to(torch.int32)
    return (
        key_cache,
        value_cache,
        plan.block_tables.to(torch.int32).contiguous().to(device),
        starts.to(device),
        plan.table_col_starts.to(torch.int32).to(device),
        key_out.view(plan.num_tokens, row_width(plan, "key")),
        value_out.view(plan.num_tokens, row_width(plan, "value")),
    )


def set_output_env() -> None:
    """Send PyPTO's files under the cache dir (a caller's own settings win)."""
    for name, value in pypto_output_env(cache_dir("pypto", "in-process")).items():
        os.environ.setdefault(name, value)


def run_kernel(
    plan: GatherPlan,
    tensors: GatherTensors,
    *,
    sim: bool,
    verify: bool = False,
    tiles: Tiles | None = None,
    kernel_fn=None,
) -> Tiles:
    """Run the gather (NPU, or SIM on a CPU) and return the tiles it used.

    ``tiles.kind == "seed"`` runs the seed's kernel with the seed's tile rows (Norm only).
    """
    set_output_env()
    from pakv_onnx.pypto import kernel

    key_cache, value_cache = tensors.key_cache, tensors.value_cache
    reason = unsupported_reason(plan, key_cache, value_cache)
    if reason is not None:  # the registry refuses such calls first; this guards direct callers
        raise ValueError(f"the PyPTO kernel cannot run this call: {reason}")
    tiles = tiles or choose_tiles(plan, key_cache.dtype, value_cache.dtype)
    if plan.num_tokens == 0 or plan.num_seqs == 0:
        return tiles
    if tiles.kind == "seed":
        args = seed_kernel_inputs(plan, tensors)
        kind = "seed"
    else:
        args = kernel_inputs(plan, tensors, tiles)
        kind = "norm" if plan.cache_mode is CacheMode.NORM else nz_kind(tiles)
    fn = kernel.jit_kernel(kind, sim=sim, verify=verify, kernel_fn=kernel_fn)
    fn(*args, kernel_scalars(plan, key_cache, value_cache, tiles))
    return tiles


def run_copy(key_src: torch.Tensor, value_src: torch.Tensor, key_out, value_out, tiles: Tiles) -> None:
    """The floor kernel: ``[T, W]`` sources copied contiguously (SIM cost model only)."""
    set_output_env()
    from pakv_onnx.pypto import kernel

    kernel.jit_kernel("copy", sim=True)(key_src, value_src, key_out, value_out, tiles.kernel_tuple())
