"""The ``pypto`` backend: the PyPTO Norm/ND GatherPaKvCache kernel on an Ascend NPU.

This module never imports pypto or torch_npu at import time: the package works without
them, and the backend then reports itself unavailable with the reason. The kernel itself
lives in :mod:`._pypto_kernel`; this module owns everything the host decides:

* what the kernel supports (:func:`unsupported_reason`, one clear reason per option);
* the host-side index tensors (:func:`kernel_inputs`: lengths-mode ``seq_lens`` becomes a
  cumsum, ``seq_offset`` becomes a block-table column, everything int32);
* the vector tile sizes (:func:`choose_tiles`, the rule below) and the seed's old rule
  (:func:`seed_tiles`) for comparison.

Tile rule. A vector tile of ``rows x cols`` elements must fit the AICore vector buffer
(:data:`VECTOR_BUFFER_BYTES` = 196,608 bytes) times its buffering: pypto 0.2.0 compiles a
Norm copy tile iff ``rows * cols * itemsize * TILE_BUFFERING <= VECTOR_BUFFER_BYTES``
(measured: 64 heads x 128 bf16 compiles with 12 rows, fails with 13). The rule takes
the whole token row (``cols = heads * head_dim``) and the largest number of rows that
divides ``block_size`` and fits; dividing the block avoids a partial tile per block
(12 rows on 128-row blocks cost more than 8 in the cost model). Only when a single row
does not fit are the columns split (largest 32-byte multiple dividing the row that fits).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import torch

from pakv_onnx.kernels import Backend, BackendUnavailableError
from pakv_onnx.paths import cache_dir, pypto_output_env
from pakv_onnx.spec import CacheMode, GatherPlan

VECTOR_BUFFER_BYTES = 196_608
TILE_BUFFERING = 1
ALIGN_BYTES = 32  # a vector tile row must be a multiple of one 32-byte block
INT32_MAX = 2**31 - 1

# cache dtype -> name of the pypto DataType (the kernel takes its dtype from the tensors).
SUPPORTED_DTYPES: dict[torch.dtype, str] = {
    torch.bfloat16: "DT_BF16",
    torch.float16: "DT_FP16",
    torch.int8: "DT_INT8",
}

# The seed kernel's fixed rule, kept to compare against.
SEED_DEFAULT_ROWS = (16, 32)
SEED_LARGE_TOKEN_ROWS = (8, 8)
SEED_LARGE_TOKEN_ELEMENTS = 4096


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Vector tile shapes of one kernel specialisation: (rows, cols) for key and for value."""

    key_rows: int
    key_cols: int
    value_rows: int
    value_cols: int

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.key_rows, self.key_cols, self.value_rows, self.value_cols)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tile_bytes(rows: int, cols: int, itemsize: int) -> int:
    """Vector-buffer bytes a ``rows x cols`` tile takes with its buffering."""
    return rows * cols * itemsize * TILE_BUFFERING


def tile_fits(rows: int, cols: int, itemsize: int) -> bool:
    return tile_bytes(rows, cols, itemsize) <= VECTOR_BUFFER_BYTES


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def row_tile(width: int, block_size: int, itemsize: int) -> tuple[int, int] | None:
    """(rows, cols) of the tile for rows of ``width`` elements; ``None`` if no aligned tile fits."""
    if tile_fits(1, width, itemsize):
        rows = max(d for d in _divisors(block_size) if tile_fits(d, width, itemsize))
        return rows, width
    cols = [c for c in _divisors(width) if (c * itemsize) % ALIGN_BYTES == 0 and tile_fits(1, c, itemsize)]
    return (1, max(cols)) if cols else None


def token_widths(plan: GatherPlan) -> tuple[int, int]:
    """Elements per token row of key and value (heads * head_dim)."""
    return (
        plan.key_token_shape[0] * plan.key_token_shape[1],
        plan.value_token_shape[0] * plan.value_token_shape[1],
    )


def choose_tiles_for(key_width: int, value_width: int, block_size: int, itemsize: int) -> Tiles:
    """The kernel's tiles for one shape (see the module docstring); ``ValueError`` if none fits."""
    key = row_tile(key_width, block_size, itemsize)
    value = row_tile(value_width, block_size, itemsize)
    if key is None or value is None:
        raise ValueError("no 32-byte aligned vector tile fits the 196,608-byte vector buffer")
    return Tiles(key[0], key[1], value[0], value[1])


def choose_tiles(plan: GatherPlan) -> Tiles:
    itemsize = torch.empty((), dtype=plan.dtype).element_size()
    return choose_tiles_for(*token_widths(plan), plan.block_size, itemsize)


def seed_tiles_for(key_width: int, value_width: int) -> Tiles:
    """The seed kernel's rule: [16, 32] rows, or [8, 8] when heads*dim >= 4096 (may not fit)."""
    if key_width >= SEED_LARGE_TOKEN_ELEMENTS or value_width >= SEED_LARGE_TOKEN_ELEMENTS:
        rows = SEED_LARGE_TOKEN_ROWS
    else:
        rows = SEED_DEFAULT_ROWS
    return Tiles(rows[0], key_width, rows[1], value_width)


# --------------------------------------------------------------------------- #
# What the kernel can do
# --------------------------------------------------------------------------- #
def unsupported_reason(plan: GatherPlan, cache: torch.Tensor) -> str | None:
    """``None`` when the PyPTO kernel handles ``plan``; otherwise the option it cannot do."""
    if plan.cache_mode is not CacheMode.NORM:
        return f"cache_mode {plan.cache_mode.value!r} (the PyPTO kernel implements only 'Norm' (ND))"
    if plan.dtype not in SUPPORTED_DTYPES:
        allowed = ", ".join(_dtype_name(d) for d in SUPPORTED_DTYPES)
        return f"cache dtype {_dtype_name(plan.dtype)} (the PyPTO kernel supports {allowed})"
    itemsize = cache.element_size()
    for name, width in zip(("key", "value"), token_widths(plan)):
        if (width * itemsize) % ALIGN_BYTES:
            return (
                f"{name} token row of heads*head_dim = {width} x {itemsize} bytes = {width * itemsize} bytes "
                f"(PyPTO vector tiles need rows that are a multiple of {ALIGN_BYTES} bytes)"
            )
    if plan.num_blocks * plan.block_size > INT32_MAX or plan.num_tokens > INT32_MAX:
        return "more than 2**31 - 1 cache rows or output tokens (the kernel indexes with int32)"
    if plan.block_tables.numel() and int(plan.block_tables.abs().max()) > INT32_MAX:
        return "block_tables values beyond int32 (the kernel reads int32 block ids)"
    try:
        choose_tiles(plan)
    except ValueError as err:
        return str(err)
    return None


def _find_spec(name: str):
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def unavailable_reason() -> str | None:
    """Why the kernel cannot run in this process, or ``None`` (pypto, torch_npu and an NPU present)."""
    if _find_spec("pypto") is None:
        return "pypto is not installed (pip install 'pakv-onnx[pypto]')"
    if _find_spec("torch_npu") is None:
        return "no Ascend NPU (torch_npu is not importable); `pakv-onnx verify-kernel` checks the kernel on a CPU"
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception as err:  # noqa: BLE001  (a broken CANN install raises anything)
        return f"no Ascend NPU (importing torch_npu failed: {err})"
    npu = getattr(torch, "npu", None)
    if npu is None or not npu.is_available():
        return "no Ascend NPU device (torch.npu.is_available() is False)"
    return None


# --------------------------------------------------------------------------- #
# Host side
# --------------------------------------------------------------------------- #
def kernel_inputs(
    plan: GatherPlan,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_out: torch.Tensor,
    value_out: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """The kernel's tensor arguments, all on the caches' device.

    ``seq_starts`` is the cumsum form whatever form ``seq_lens`` had (the plan already holds
    each sequence's first output row), ``table_cols`` the first block-table column.
    """
    device = key_cache.device
    seq_starts = torch.cat((plan.out_starts, torch.tensor([plan.num_tokens], dtype=torch.int64)))
    host = (
        plan.block_tables.to(torch.int32).contiguous(),
        seq_starts.to(torch.int32),
        plan.table_col_starts.to(torch.int32),
    )
    block_tables, seq_starts, table_cols = (t.to(device) for t in host)
    key_width, value_width = token_widths(plan)
    return (
        key_cache,
        value_cache,
        block_tables,
        seq_starts,
        table_cols,
        key_out.view(plan.num_tokens, key_width),
        value_out.view(plan.num_tokens, value_width),
    )


def run_kernel(
    plan: GatherPlan,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_out: torch.Tensor,
    value_out: torch.Tensor,
    *,
    sim: bool,
    verify: bool = False,
    tiles: Tiles | None = None,
    kernel_fn=None,
) -> Tiles:
    """Run the kernel (NPU, or SIM on a CPU) and return the tiles it used.

    ``kernel_fn`` replaces the kernel function (tests inject deliberately wrong kernels).
    """
    # PyPTO writes into the cwd and home on import and on every compile unless told otherwise;
    # a caller's own settings win.
    for name, value in pypto_output_env(cache_dir("pypto", "in-process")).items():
        os.environ.setdefault(name, value)
    from pakv_onnx.kernels import _pypto_kernel

    reason = unsupported_reason(plan, key_cache)
    if reason is not None:
        raise BackendUnavailableError(f"the PyPTO kernel cannot run this call: {reason}")
    tiles = tiles or choose_tiles(plan)
    if plan.num_tokens == 0 or plan.num_seqs == 0:
        return tiles
    kernel = _pypto_kernel.jit_kernel(kernel_fn or _pypto_kernel.gather_nd_kernel, sim=sim, verify=verify)
    kernel(*kernel_inputs(plan, key_cache, value_cache, key_out, value_out), tiles.as_tuple())
    return tiles


def gather_pypto(
    plan: GatherPlan,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_out: torch.Tensor,
    value_out: torch.Tensor,
) -> None:
    """Gather on the Ascend NPU (inputs already on the NPU stay there; CPU inputs are moved)."""
    device = torch.device("npu", torch.npu.current_device())
    on_npu = key_cache.device.type == "npu"
    if on_npu:
        run_kernel(plan, key_cache, value_cache, key_out, value_out, sim=False)
        return
    key_dev, value_dev = key_out.to(device), value_out.to(device)
    run_kernel(plan, key_cache.to(device), value_cache.to(device), key_dev, value_dev, sim=False)
    key_out.copy_(key_dev.cpu())
    value_out.copy_(value_dev.cpu())


BACKEND = Backend(
    name="pypto",
    description="PyPTO Norm/ND kernel on an Ascend NPU (bf16, fp16, int8)",
    gather=gather_pypto,
    unavailable_reason=unavailable_reason,
    unsupported_reason=unsupported_reason,
)
