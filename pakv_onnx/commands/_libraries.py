"""What the commands set in the libraries they use (never done on import of pakv_onnx: a library
user's own settings stay theirs)."""

from __future__ import annotations

import importlib
from types import ModuleType

from pakv_onnx.commands import _interrupt


def quiet_transformers() -> None:
    """Turn off transformers' (and the Hugging Face Hub's) progress bars in this process: a command
    prints its own progress lines, and a bar of a 0.1 s weight load is only noise. Call it after
    importing transformers."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def load_hf(name: str) -> ModuleType:
    """``pakv_onnx.models.hf.<name>``, imported when a command runs (it imports torch and transformers),
    then a Ctrl-C check and transformers' progress bars off (:func:`quiet_transformers`).

    Raises:
        ImportError: transformers (or what it needs) is missing; the message names the extra to install.
    """
    try:
        module = importlib.import_module(f"pakv_onnx.models.hf.{name}")
        _interrupt.check()
        quiet_transformers()
    except ImportError as err:
        raise ImportError(f"it needs transformers (pip install 'pakv-onnx[hf]'): {err}") from err
    return module
