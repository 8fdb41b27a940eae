"""The shape every sample model shares: write the step's K/V into the paged caches, gather
past + new back through the updated caches, then attend.

``forward`` calls the exportable custom ops: ``torch.ops.pakv.scatter_pa_kv_cache_functional``
(one ``pakv::ScatterPaKvCache`` node; eager, the in-place ``scatter_pa_kv_cache`` on the caller's
caches) and ``torch.ops.pakv.gather_pa_kv_cache`` on its outputs (one ``pakv::GatherPaKvCache``
node). The updated caches feed only the gather, so on ONNX Runtime >= 1.18 ``make_session`` opts into
the plugin's alias route, which makes them the caller's cache buffers: written in place, never copied.
``reference_forward`` runs the same attention on the golden's gather of the batch. Both return
``(output, key, value)`` so the gathered tensors can be compared bit-exact and the attention output
within a stated fp32 tolerance.
"""

from __future__ import annotations

import abc
import os

import torch

from pakv_onnx.export import export  # also registers torch.ops.pakv.gather_pa_kv_cache
from pakv_onnx.models.batch import PagedBatch
from pakv_onnx.ops import gather_pa_kv_cache

# Input and output names of the exported graphs.
MODEL_INPUT_NAMES = (
    "hidden_states",
    "new_key",
    "new_value",
    "key_cache",
    "value_cache",
    "slot_mapping",
    "block_tables",
    "seq_lens",
    "seq_offset",
)
MODEL_OUTPUT_NAMES = ("output", "key", "value")


class PagedAttentionModel(torch.nn.Module, abc.ABC):
    """Attention over a paged KV cache for a packed batch of ragged sequences (cumsum seq_lens).

    Inputs of ``forward``: ``hidden_states`` fp32 ``[T, hidden]`` (one row per gathered token),
    the step's ``new_key`` / ``new_value`` rows with their ``slot_mapping`` (ScatterPaKvCache's
    inputs with the caches), then the gather's ``block_tables``, ``seq_lens`` (past + new) and
    ``seq_offset``. Outputs: ``output`` fp32 ``[T, hidden]`` and the gathered ``key`` / ``value``
    (cache dtype, ``[T, H, D]``).
    """

    hidden_size: int

    @abc.abstractmethod
    def attend(
        self, hidden_states: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seq_lens: torch.Tensor
    ) -> torch.Tensor:
        """fp32 ``[T, hidden]`` attention output from the gathered key/value rows."""

    @abc.abstractmethod
    def random_batch(self, num_tokens: int, num_seqs: int, seed: int) -> PagedBatch:
        """A random paged batch with this model's cache shapes."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        new_key: torch.Tensor,
        new_value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_offset: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if torch.compiler.is_exporting() or torch.compiler.is_compiling():
            key_cache, value_cache = torch.ops.pakv.scatter_pa_kv_cache_functional(
                new_key, new_value, key_cache, value_cache, slot_mapping
            )
        else:  # eager: in place on the caller's caches, as ORT's alias route writes them
            torch.ops.pakv.scatter_pa_kv_cache(new_key, new_value, key_cache, value_cache, slot_mapping)
        key, value = torch.ops.pakv.gather_pa_kv_cache(
            key_cache, value_cache, block_tables, seq_lens, seq_offset, "Norm", True
        )
        # The gather's T is data-dependent; the queries carry the same T.
        torch._check(key.shape[0] == hidden_states.shape[0])
        torch._check(key.shape[0] >= 1)
        return self.attend(hidden_states, key, value, seq_lens), key, value

    def reference_forward(
        self, hidden_states: torch.Tensor, batch: PagedBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The same model on the golden gather: the ground truth for exported graphs."""
        key, value = gather_pa_kv_cache(*batch.gather_inputs(), backend="golden")
        with torch.no_grad():
            return self.attend(hidden_states, key, value, batch.seq_lens), key, value

    def random_hidden_states(self, num_tokens: int, seed: int) -> torch.Tensor:
        """fp32 ``[T, hidden]`` queries' hidden states."""
        generator = torch.Generator().manual_seed(seed + 7919)
        return torch.randn(num_tokens, self.hidden_size, generator=generator)

    def export_onnx(self, inputs: tuple[torch.Tensor, ...], path: str | os.PathLike) -> None:
        """Export to ``path`` with the project's exporter (fallback body included, every dim dynamic).

        The graph's inputs and outputs carry :data:`MODEL_INPUT_NAMES` / :data:`MODEL_OUTPUT_NAMES`.
        """
        export(self.eval(), inputs, path, input_names=MODEL_INPUT_NAMES, output_names=MODEL_OUTPUT_NAMES)

    def example_inputs(self, num_tokens: int, num_seqs: int, seed: int) -> tuple[torch.Tensor, ...]:
        """``forward``'s inputs for a random batch: ``(hidden_states, *batch.step_inputs())``."""
        batch = self.random_batch(num_tokens, num_seqs, seed)
        return (self.random_hidden_states(num_tokens, seed), *batch.step_inputs())
