"""What the commands set in the libraries they use (never done on import of pakv_onnx: a library
user's own settings stay theirs)."""

from __future__ import annotations


def quiet_transformers() -> None:
    """Turn off transformers' (and the Hugging Face Hub's) progress bars in this process: a command
    prints its own progress lines, and a bar of a 0.1 s weight load is only noise. Call it after
    importing transformers."""
    from transformers.utils import logging

    logging.disable_progress_bar()
