"""``pakv-onnx serve``: an OpenAI-compatible HTTP server over ORT GenAI's og.Engine, for the folders
``pakv-onnx export`` writes.

- :mod:`~pakv_onnx.serve.folder`: what the server reads from the folder (genai_config.json, the
  Hugging Face tokenizer, the chat template), checked without importing og, torch or fastapi.
- :mod:`~pakv_onnx.serve.text`: text in and out (the ``tokenizers`` library, a jinja chat template,
  incremental detokenization, stop strings).
- :mod:`~pakv_onnx.serve.engine`: one og.Engine, one thread that steps it while requests are pending,
  admission by pool blocks, cancellation.
- :mod:`~pakv_onnx.serve.protocol`: the OpenAI request bodies, checked into engine jobs.
- :mod:`~pakv_onnx.serve.metrics`: the Prometheus counters, gauges and histograms.
- :mod:`~pakv_onnx.serve.app`: the FastAPI app; :mod:`~pakv_onnx.serve.server`: uvicorn and signals;
  :mod:`~pakv_onnx.serve.ray_app`: the same app as a Ray Serve deployment with N replicas.

Nothing here imports torch; fastapi, uvicorn, jinja2 and ray are imported by the modules that need
them (the ``serve`` and ``serve-ray`` extras), onnxruntime_genai when an engine starts.
"""
