"""``pakv-onnx serve FOLDER`` in one process: the engine, the app, uvicorn, and the signals.

SIGINT and SIGTERM end the server the same way, with exit code 0: uvicorn stops accepting connections,
gives the requests in flight ``shutdown_grace`` seconds to finish, cancels what is left (each stream
ends; og.Engine drops the jobs), then the engine thread stops. (uvicorn would re-raise the signal after
its shutdown, which would turn a clean stop into 130 or a kill; :class:`_Server` does not.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from pakv_onnx.serve.app import ServeState, build_app, engine_gauges
from pakv_onnx.serve.engine import EngineLoop
from pakv_onnx.serve.folder import read_folder
from pakv_onnx.serve.metrics import Metrics
from pakv_onnx.serve.text import TextCodec

READY = "serving"  # the first word of the line printed once the port accepts connections


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """The command line's options (``None``: the folder's genai_config.json value / ORT's choice)."""

    folder: Path
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_batch_size: int | None = None
    num_blocks: int | None = None
    max_queue: int = 256
    threads: int | None = None
    shutdown_grace: float = 10.0


def replica_name() -> str:
    """``host:pid``: which process answered (the ``x-pakv-replica`` header, /health)."""
    return f"{socket.gethostname()}:{os.getpid()}"


def make_state(options: ServeOptions) -> ServeState:
    """Load the folder into a started engine and the app's state (og.Engine loads here)."""
    info = read_folder(options.folder, num_blocks=options.num_blocks, max_batch_size=options.max_batch_size)
    metrics = Metrics()
    engine = EngineLoop(info, threads=options.threads, max_queue=options.max_queue, observe=metrics.observe).start()
    metrics.gauges.update(engine_gauges(engine))
    return ServeState(engine, TextCodec(options.folder), metrics, options.api_key, replica_name())


def build_replica_app(options: ServeOptions):
    """The app over a fresh engine (the builder each Ray Serve replica calls)."""
    return build_app(make_state(options))


def ready_line(host: str, port: int, state: ServeState) -> str:
    info = state.info
    return (
        f"{READY} {info.name} on http://{host}:{port}/v1 (pool {info.num_blocks} blocks x {info.block_size} tokens, "
        f"max batch {info.max_batch_size}, up to {state.engine.max_request_length} tokens per request)"
    )


def serve(options: ServeOptions) -> int:
    """Run the server until SIGINT / SIGTERM; returns 0."""
    import uvicorn

    state = make_state(options)

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                port = self.servers[0].sockets[0].getsockname()[1] if self.servers else options.port
                print(ready_line(options.host, port, state), flush=True)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(
        build_app(state), host=options.host, port=options.port, log_level="warning", access_log=False,
        timeout_graceful_shutdown=options.shutdown_grace, lifespan="on",
    )  # fmt: skip
    server = _Server(config)
    try:
        server.run()
    except SystemExit:
        pass  # uvicorn exits 1 when it cannot bind: reported below
    finally:
        state.engine.stop()
    if not server.started:
        print(f"pakv-onnx serve: error: could not listen on {options.host}:{options.port}", file=sys.stderr)
        return 2
    print("pakv-onnx serve: stopped", file=sys.stderr, flush=True)
    return 0
