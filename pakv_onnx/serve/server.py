"""``pakv-onnx serve FOLDER`` in one process: the engine, the app, uvicorn, and the signals.

SIGINT and SIGTERM end the server the same way, with exit code 0: uvicorn stops accepting connections,
gives the requests in flight ``shutdown_grace`` seconds to finish, cancels what is left (each stream
ends; og.Engine drops the jobs), then the engine thread stops. (uvicorn would re-raise the signal after
its shutdown, which would turn a clean stop into 130 or a kill; :class:`_Server` does not.) The command
line runs :func:`serve` with SIGINT handed over to it (``commands._interrupt.handed_over``), so its
Ctrl-C watchdog does not end the process during that shutdown; a Ctrl-C that came before uvicorn's
handlers were in place is read through ``stop_requested`` and stops the server at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from pakv_onnx.serve.app import ServeState, build_app, engine_gauges
from pakv_onnx.serve.engine import EngineLoop
from pakv_onnx.serve.folder import read_folder
from pakv_onnx.serve.metrics import Metrics
from pakv_onnx.serve.text import TextCodec

BACKSTOP_SECONDS = 10.0  # after the grace and the cancel, how long uvicorn waits before it cancels the tasks
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


def serve(
    options: ServeOptions, state: ServeState | None = None, stop_requested: Callable[[], bool] = lambda: False
) -> int:
    """Run the server over ``state`` (default: :func:`make_state`'s) until SIGINT / SIGTERM, or at once
    when ``stop_requested()`` says a stop came before the server's handlers were installed; stops the
    engine; returns 0 (2: it could not listen)."""
    import uvicorn

    state = state or make_state(options)

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                port = self.servers[0].sockets[0].getsockname()[1] if self.servers else options.port
                print(ready_line(options.host, port, state), flush=True)

        async def shutdown(self, sockets=None) -> None:
            # At the end of the grace the engine cancels what is left: each stream then ends as a
            # stream does (a last chunk, finish_reason "abort", [DONE]) and uvicorn's wait for the
            # connections ends. uvicorn's own cancel of the tasks, later, is only the backstop: it would
            # print each cancelled request's traceback.
            cancel_later = asyncio.get_running_loop().call_later(options.shutdown_grace, state.engine.cancel_all)
            try:
                await super().shutdown(sockets)
            finally:
                cancel_later.cancel()

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            if stop_requested():
                self.handle_exit(signal.SIGINT, None)
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(
        build_app(state), host=options.host, port=options.port, log_level="warning", access_log=False,
        timeout_graceful_shutdown=options.shutdown_grace + BACKSTOP_SECONDS, lifespan="on",
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
