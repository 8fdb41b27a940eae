"""Subcommands of the ``pakv-onnx`` CLI, one module each (see :mod:`pakv_onnx.cli`)."""
