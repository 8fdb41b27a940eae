"""``pakv-onnx serve FOLDER --replicas 2``: two og.Engine replicas as a Ray Serve deployment on a local Ray
instance (its CPUs and object store kept small; its files in a temp dir of the test's own), behind Ray
Serve's HTTP proxy. Both replicas answer (the ``x-pakv-replica`` header names the process), each
request's greedy tokens equal the single server's (og.Engine driven directly), and SIGTERM takes the
whole Ray instance down: the command exits 0 and no process of that instance is left."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import SERVE_API_KEY
from serve_helpers import Server, http_json, og_greedy
from test_serve_readme import free_port


def ray_processes(marker: str) -> list[str]:
    """Command lines of the processes whose command line names ``marker`` (the instance's temp dir)."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


@pytest.mark.slow  # a Ray instance and two engines (a minute or more on the shared machine)
def test_two_replicas_answer_with_the_single_servers_tokens(serve_folder: Path, tmp_path_factory, monkeypatch) -> None:
    from serve_helpers import needs

    needs("ray")
    ray_dir = Path("/tmp") / f"pakv-ray-{os.getpid()}"  # short: Ray's unix sockets live under it
    monkeypatch.setenv("RAY_TMPDIR", str(ray_dir))
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3], [77], [30, 31, 32, 33]]
    want = og_greedy(serve_folder, prompts, [8] * len(prompts))
    server = Server(serve_folder, "--replicas", "2", "--api-key", SERVE_API_KEY, port=free_port())
    try:
        auth = {"authorization": f"Bearer {SERVE_API_KEY}"}
        replicas: set[str] = set()
        deadline = time.monotonic() + 120
        k = 0
        while (len(replicas) < 2 or k < 2 * len(prompts)) and time.monotonic() < deadline:
            prompt = prompts[k % len(prompts)]
            status, body, headers = http_json(
                server, "POST", "/v1/completions",
                f'{{"prompt": {prompt}, "max_tokens": 8, "temperature": 0}}'.encode(), auth,
            )  # fmt: skip
            assert status == 200, body
            assert body["choices"][0]["text"] == " ".join(f"t{t}" for t in want[k % len(prompts)])
            replicas.add(headers["x-pakv-replica"])
            k += 1
        assert len(replicas) == 2, f"one replica answered all {k} requests: {replicas}"
        assert http_json(server, "POST", "/v1/completions", b'{"prompt": [1]}', {})[0] == 401  # the same app
        server.signal(signal.SIGTERM)
        assert server.wait(120) == 0
        left = ray_processes(str(ray_dir))
        assert not left, left
    finally:
        server.kill()
