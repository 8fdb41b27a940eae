"""``pakv-onnx serve FOLDER``: an OpenAI-compatible HTTP server over og.Engine for a folder ``pakv-onnx
export`` wrote (one process), or ``--replicas N`` of it behind Ray Serve's HTTP proxy.

The folder and every option are checked, and the extras' packages looked up, before og, torch,
fastapi or ray are imported.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from pakv_onnx.commands import _args, _interrupt

# The packages each mode imports -> the pip command that installs them.
SERVE_PACKAGES = ("fastapi", "uvicorn", "pydantic", "jinja2", "tokenizers", "onnxruntime_genai")
SERVE_EXTRA = "pip install 'pakv-onnx[serve]'"
RAY_PACKAGES = ("ray",)
RAY_EXTRA = "pip install 'pakv-onnx[serve-ray]'"


def missing_packages(names: tuple[str, ...]) -> list[str]:
    """Which of ``names`` cannot be imported here (looked up, not imported)."""
    return [name for name in names if importlib.util.find_spec(name) is None]


def port(text: str) -> int:
    """A TCP port, 0..65535 (0: any free port, printed once listening)."""
    return _args.int_in(0, 65535)(text)


def grace_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want seconds, got {text!r}") from None
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be in 0..3600 seconds, got {text}")
    return value


def _servable(folder: Path) -> str | None:
    """What is missing from ``folder`` for the server (``None``: nothing); json only, no heavy import."""
    from pakv_onnx.serve.folder import folder_problem

    problem = folder_problem(folder)
    return problem.removeprefix(f"{folder}: ") if problem else None


def run(args: argparse.Namespace) -> int:
    if args.address and not args.replicas:
        return _args.usage_error("serve", "--address names the Ray cluster of --replicas; give --replicas N too")
    missing = missing_packages(SERVE_PACKAGES)
    if missing:
        return _args.usage_error("serve", f"it needs {', '.join(missing)} ({SERVE_EXTRA})")
    if args.replicas and missing_packages(RAY_PACKAGES):
        return _args.usage_error("serve", f"--replicas needs ray ({RAY_EXTRA})")
    from pakv_onnx.serve.server import ServeOptions, make_state, serve

    _interrupt.check()  # a safe point after the server's imports (fastapi, pydantic)
    options = ServeOptions(
        folder=args.folder, host=args.host, port=args.port, api_key=args.api_key, max_batch_size=args.max_batch_size,
        num_blocks=args.num_blocks, max_queue=args.max_queue, threads=args.threads, shutdown_grace=args.shutdown_grace,
    )  # fmt: skip
    if args.replicas:
        from pakv_onnx.serve.ray_app import serve_replicas

        # Ray's start-up runs in its own processes: handed over from the start, so a Ctrl-C during it
        # still shuts the local Ray instance down (then exit 0) instead of leaving it behind.
        with _interrupt.handed_over():
            return serve_replicas(options, args.replicas, args.address, stop_requested=_interrupt.requested)
    state = make_state(options)  # og.Engine loads: a Ctrl-C here is 130 like any command's start-up
    try:
        with _interrupt.handed_over():  # from here SIGINT is the server's: stop, grace, exit 0
            return serve(options, state, stop_requested=_interrupt.requested)
    finally:
        state.engine.stop()


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = _args.add_command(
        commands,
        "serve",
        help="an OpenAI-compatible HTTP server over og.Engine for a folder `pakv-onnx export` wrote",
        description=(
            "Serve FOLDER (written by pakv-onnx export: model.onnx, genai_config.json with engine.dynamic_batching, "
            "tokenizer.json) over the OpenAI HTTP API: POST /v1/completions and /v1/chat/completions (streaming "
            "with stream: true; chat through the folder's chat template), GET /v1/models, /health and /metrics "
            "(Prometheus). One og.Engine runs every request with continuous batching over the paged pool; text "
            f"goes through the folder's Hugging Face tokenizer. Needs the serve extra ({SERVE_EXTRA}); "
            f"--replicas runs N engines as a Ray Serve deployment behind Ray Serve's HTTP proxy ({RAY_EXTRA}). "
            "SIGINT / SIGTERM stop it: no new connections, requests in flight get --shutdown-grace seconds, "
            "then exit 0. Exit 2 for a usage error (a folder it cannot serve, a missing extra)."
        ),
        examples=[
            "./tiny-llama-genai  # http://127.0.0.1:8000/v1",
            "./tiny-llama-genai --port 9000 --api-key secret --max-queue 64",
            "./tiny-llama-genai --num-blocks 1024 --max-batch-size 32 --threads 2",
            "./tiny-llama-genai --replicas 2  # a local Ray instance, two engines",
            "./tiny-llama-genai --replicas 4 --address auto  # the Ray cluster `ray start --head` started",
        ],
    )
    _args.add_input_folder(parser, "FOLDER", help="a folder pakv-onnx export wrote", check=_servable)
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)"
    )
    parser.add_argument("--port", type=port, default=8000, help="TCP port (default 8000; 0: a free one, printed)")
    parser.add_argument(
        "--api-key", default=None, help="require `Authorization: Bearer KEY` on every /v1 request (401 otherwise)"
    )
    _args.add_max_batch_size(
        parser, default=None, help="requests og.Engine runs together at most (default: the folder's engine.dynamic_batching)"
    )
    _args.add_num_blocks(
        parser, default=None, help="blocks per layer pool og.Engine allocates (default: the folder's engine.dynamic_batching)"
    )
    parser.add_argument(
        "--max-queue", type=_args.positive_int, default=256,
        help="requests that may wait for room in the engine; one more gets HTTP 429 (default 256)",
    )  # fmt: skip
    _args.add_threads(parser, help="ORT intra-op threads per engine (default: the folder's)")
    parser.add_argument(
        "--shutdown-grace", type=grace_seconds, default=10.0,
        help="seconds requests in flight may run on after SIGINT / SIGTERM before they are cancelled (default 10)",
    )  # fmt: skip
    parser.add_argument(
        "--replicas", type=_args.positive_int, default=None,
        help="run N replicas (each its own og.Engine) as a Ray Serve deployment behind its HTTP proxy",
    )  # fmt: skip
    parser.add_argument(
        "--address", default=None,
        help="the Ray cluster for --replicas (e.g. auto, or ray://HOST:10001; default: start a local Ray instance)",
    )  # fmt: skip
    parser.set_defaults(run=run)
