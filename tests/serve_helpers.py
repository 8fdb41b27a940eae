"""Test helpers for ``pakv-onnx serve``: a server in a child process (its own session, so nothing it
starts outlives the test), og.Engine driven directly for the reference tokens, raw HTTP for what the
openai client cannot send."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"  # loopback only: the tests never listen anywhere else
READY = re.compile(r"^serving \S+ on http://127\.0\.0\.1:(\d+)/v1")
START_TIMEOUT = 180.0


def needs(module: str):
    """``import module``, or skip (outside CI; under CI, which installs the serve extras, a failure)."""
    if os.environ.get("CI"):
        return __import__(module)
    return pytest.importorskip(module, reason=f"the serve extra ({module}) is not installed")


class Server:
    """``pakv-onnx serve FOLDER ARGS --port 0`` in a child process; :attr:`port` once it listens."""

    def __init__(self, folder: Path, *args: str, port: int = 0) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        command = [
            sys.executable,
            "-m",
            "pakv_onnx.cli",
            "serve",
            str(folder),
            "--host",
            HOST,
            "--port",
            str(port),
            *args,
        ]
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
        )
        self.lines: list[str] = []
        self.port = self._wait_ready(port)

    def _wait_ready(self, port: int) -> int:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited {self.process.returncode}: {self.process.stderr.read()[-3000:]}")
            ready, _, _ = select.select([self.process.stdout], [], [], 0.5)
            if ready:
                line = self.process.stdout.readline()
                self.lines.append(line)
                match = READY.match(line)
                if match or line.startswith("serving "):
                    return int(match.group(1)) if match else port
        raise RuntimeError("the server did not start in time")

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)

    def kill(self) -> None:
        """End the server and everything it started (its process group)."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)
        for stream in (self.process.stdout, self.process.stderr):
            stream.close()


@contextlib.contextmanager
def running_server(folder: Path, *args: str) -> Iterator[Server]:
    server = Server(folder, *args)
    try:
        yield server
    finally:
        server.kill()


def http_json(server: Server, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """``(status, parsed JSON body)`` of one raw request."""
    connection = http.client.HTTPConnection(HOST, server.port, timeout=60)
    try:
        connection.request(method, path, body=body, headers={"content-type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"null"), dict(response.getheaders())
    finally:
        connection.close()


def og_greedy(folder: Path, prompts: list[list[int]], budgets: list[int]) -> list[list[int]]:
    """og.Engine over ``folder`` driven directly: each prompt's greedy tokens (at most its budget; it
    stops at EOS, as the server's requests do)."""
    import numpy as np
    import onnxruntime_genai as og

    engine = og.Engine(og.Model(str(folder)))
    events = engine.create_event_buffer(64)
    tokens = []
    for prompt, budget in zip(prompts, budgets):
        request = engine.create_request()
        options = og.TurnOptions(request)
        options.set_do_sample(False)
        options.set_max_generated_tokens(budget)
        request.begin_turn(np.array(prompt, dtype=np.int32), options)
        got: list[int] = []
        while engine.has_pending_requests():
            got += [int(e.token) for e in engine.run(events) if e.request is request and e.token is not None]
        tokens.append(got)
    return tokens


def metric(text: str, name: str) -> float:
    """One sample's value in Prometheus text (``name`` with its labels, exactly)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0
