"""What ``pakv-onnx serve`` reads from a model folder, read with ``json`` alone (no og, torch or fastapi):
the paged engine's settings in ``genai_config.json``, the Hugging Face tokenizer files and the chat
template. :func:`folder_problem` is what the command line checks before anything heavy is imported.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

GENAI_CONFIG = "genai_config.json"  # models.hf.genai.GENAI_CONFIG (a test ties them)
TOKENIZER_FILE = "tokenizer.json"  # the `tokenizers` library's file; og.Tokenizer cannot parse every one
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers 5 writes the template (else tokenizer_config.json)


class FolderError(ValueError):
    """The folder cannot be served (the message names the file and what is wrong)."""


@dataclasses.dataclass(frozen=True)
class FolderInfo:
    """The settings of a paged og.Engine folder the server needs (``num_blocks`` and ``max_batch_size``
    after the command line's overrides)."""

    path: Path
    name: str  # the model id /v1/models reports (the folder's name)
    block_size: int
    num_blocks: int
    max_batch_size: int
    vocab_size: int
    context_length: int
    eos_token_ids: tuple[int, ...]

    @property
    def pool_tokens(self) -> int:
        """Tokens the pool holds in all (every layer has a pool of this many rows)."""
        return self.block_size * self.num_blocks


def folder_problem(folder: Path) -> str | None:
    """Why ``folder`` cannot be served (``None``: it can): not a folder, no model, not a paged og.Engine
    folder, no ``tokenizer.json``."""
    if not folder.is_dir():
        return f"{folder}: no such folder (want a folder `pakv-onnx export` wrote)"
    try:
        read_folder(folder)
    except FolderError as err:
        return str(err)
    if not (folder / TOKENIZER_FILE).is_file():
        return (
            f"{folder}: no {TOKENIZER_FILE} (the server reads text with the folder's Hugging Face tokenizer; "
            "`pakv-onnx export` copies it from the source folder when that has one)"
        )
    return None


def read_folder(folder: Path, *, num_blocks: int | None = None, max_batch_size: int | None = None) -> FolderInfo:
    """``folder``'s :class:`FolderInfo`; ``num_blocks`` / ``max_batch_size`` replace the config's.

    Raises:
        FolderError: no readable ``genai_config.json``, or one without ``engine.dynamic_batching``
            (og.Engine then batches statically, at most 4 requests on a CPU: not what this server drives).
    """
    path = folder / GENAI_CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise FolderError(f"{folder}: no {GENAI_CONFIG} (want a folder `pakv-onnx export` wrote)") from None
    except (OSError, ValueError) as err:
        raise FolderError(f"{path}: cannot read it: {err}") from None
    try:
        model, batching = config["model"], config["engine"]["dynamic_batching"]
        eos = model.get("eos_token_id", [])
        return FolderInfo(
            path=folder,
            name=folder.resolve().name,
            block_size=int(batching["block_size"]),
            num_blocks=int(num_blocks or batching["num_blocks"]),
            max_batch_size=int(max_batch_size or batching["max_batch_size"]),
            vocab_size=int(model["vocab_size"]),
            context_length=int(model["context_length"]),
            eos_token_ids=tuple(int(t) for t in (eos if isinstance(eos, list) else [eos])),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise FolderError(
            f"{path}: not a paged og.Engine config (missing or bad {err}; want model.vocab_size, "
            "model.context_length and engine.dynamic_batching.block_size / num_blocks / max_batch_size)"
        ) from None


def tokenizer_config(folder: Path) -> dict:
    """``tokenizer_config.json`` as a dict (``{}`` when the folder has none)."""
    path = folder / TOKENIZER_CONFIG
    return json.loads(path.read_text()) if path.is_file() else {}


def chat_template(folder: Path) -> str | None:
    """The folder's chat template: ``chat_template.jinja``, else ``tokenizer_config.json``'s
    ``chat_template`` (a string, or a list of ``{name, template}`` whose ``default`` is taken);
    ``None`` when it has none."""
    path = folder / CHAT_TEMPLATE_FILE
    if path.is_file():
        return path.read_text()
    template = tokenizer_config(folder).get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) and template else None


def special_token_text(folder: Path, name: str) -> str:
    """The text of ``tokenizer_config.json``'s ``bos_token`` / ``eos_token`` (a string or an
    ``{"content": ...}`` entry; ``""`` when absent), which chat templates refer to."""
    value = tokenizer_config(folder).get(name)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""
