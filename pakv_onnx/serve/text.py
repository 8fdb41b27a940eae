"""Text in and out of the server, through the folder's own Hugging Face tokenizer.

ORT GenAI's ``og.Tokenizer`` cannot parse every ``tokenizer.json`` (the sample models' word-level one
fails with "Cannot know how to parse line"), so the server reads it with the ``tokenizers`` library
(what transformers' fast tokenizers are built on; no torch) and renders chat templates with jinja2 in a
sandbox, as transformers' ``apply_chat_template`` does. og.Engine sees token ids only; its own stop
strings would need og.Tokenizer, so stop strings are matched here (:class:`StopMatcher`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from pakv_onnx.serve import folder as folder_files

REPLACEMENT = "\ufffd"  # what a byte-level decoder yields for an incomplete UTF-8 sequence


class ChatTemplateError(ValueError):
    """The folder has no chat template, or rendering it failed (the message says which)."""


class TextCodec:
    """The folder's tokenizer (``tokenizer.json``) and chat template."""

    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(folder / folder_files.TOKENIZER_FILE))
        self.template_source = folder_files.chat_template(folder)
        self.bos_token = folder_files.special_token_text(folder, "bos_token")
        self.eos_token = folder_files.special_token_text(folder, "eos_token")
        self._template = None

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of ``text`` (``special``: with the tokenizer's post-processor, e.g. a BOS)."""
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (special tokens left out)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def chat_prompt(self, messages: list[dict]) -> str:
        """The chat template rendered over ``messages`` with the generation prompt appended.

        Raises:
            ChatTemplateError: the folder has no template, or the template raised / failed to render.
        """
        if self.template_source is None:
            raise ChatTemplateError(
                "this model's folder has no chat template (no chat_template.jinja, no chat_template in "
                "tokenizer_config.json); use /v1/completions with a prompt"
            )
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(f"the chat template refused the messages: {message}")

        try:
            if self._template is None:
                env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
                env.globals["raise_exception"] = raise_exception
                self._template = env.from_string(self.template_source)
            return self._template.render(
                messages=messages, add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token
            )
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"the chat template failed: {err}") from None


class Detokenizer:
    """Incremental decoding: each new token's text as it arrives, such that the pieces join to
    ``decode(all ids)`` for tokenizers whose decode of a window is stable (a word-piece or byte-level
    decoder). A piece that ends in an incomplete UTF-8 sequence is held until it completes. Decodes a
    short window (the previous token and the new ones), not the whole text, per token."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.ids: list[int] = []
        self.prefix = 0  # the window's first id
        self.read = 0  # ids [prefix, read) were emitted already

    def add(self, token: int) -> str:
        """The text ``token`` adds (``""`` while it is held)."""
        self.ids.append(token)
        before = self.codec.decode(self.ids[self.prefix : self.read])
        after = self.codec.decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""


@dataclasses.dataclass
class StopMatcher:
    """The OpenAI ``stop`` strings over streamed text: text is released once no stop string can start
    in it; at a match, the text before it is released and generation ends (the stop string itself is
    never returned)."""

    stops: tuple[str, ...]
    pending: str = ""
    stopped: bool = False

    def feed(self, piece: str) -> str:
        """Text that is safe to send after ``piece`` arrived; sets :attr:`stopped` at a match."""
        if not self.stops:
            return piece
        self.pending += piece
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending, self.stopped = self.pending[: min(hits)], "", True
            return out
        hold = max((self._overlap(s) for s in self.stops), default=0)
        out, self.pending = self.pending[: len(self.pending) - hold], self.pending[len(self.pending) - hold :]
        return out

    def flush(self) -> str:
        """What is held when generation ends without a match."""
        out, self.pending = self.pending, ""
        return out

    def _overlap(self, stop: str) -> int:
        """The longest tail of :attr:`pending` that is a proper prefix of ``stop``."""
        for size in range(min(len(stop) - 1, len(self.pending)), 0, -1):
            if self.pending.endswith(stop[:size]):
                return size
        return 0
