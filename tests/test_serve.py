"""``pakv-onnx serve``: the official openai client (plain and streaming) against a real uvicorn server on a
free loopback port, over the sample Llama as ``pakv-onnx export`` writes it (tests/conftest.py: one
folder and one server for the session, killed at its end).

Greedy outputs equal og.Engine driven directly (and so transformers': tests/test_genai_export.py), alone
and with 16 requests at once; every error path answers an OpenAI error body; 100 clients that leave
mid-stream leave the pool as they found it. Servers with other options (a full queue, SIGTERM / SIGINT)
are slow.
"""

from __future__ import annotations

import http.client
import os
import json
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import SERVE_API_KEY
from serve_helpers import HOST, http_json, metric, og_greedy, running_server

from pakv_onnx import cli
from pakv_onnx.serve import folder as serve_folder_module
from pakv_onnx.serve.text import StopMatcher

PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3], [200, 17, 45, 3, 3, 9, 12, 90, 91, 92, 4], [77], [30, 31, 32, 33]]
BUDGETS = [9, 12, 6, 20, 3]


def client(server, key: str = SERVE_API_KEY, **kwargs):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60, **kwargs)


def words(ids: list[int]) -> str:
    """The sample tokenizer's text of ``ids`` (token i is the word ``t<i>``)."""
    return " ".join(f"t{i}" for i in ids)


@pytest.fixture(scope="module")
def reference(serve_folder: Path) -> list[list[int]]:
    return og_greedy(serve_folder, PROMPTS, BUDGETS)


def test_greedy_completions_equal_og_engine(served, serve_folder: Path, reference) -> None:
    api = client(served)
    name = serve_folder.name
    for prompt, budget, want in zip(PROMPTS, BUDGETS, reference):
        done = api.completions.create(model=name, prompt=prompt, max_tokens=budget, temperature=0)
        assert done.choices[0].text == words(want)
        assert done.choices[0].finish_reason == ("length" if len(want) == budget else "stop")
        assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(prompt), len(want))
    text = api.completions.create(model=name, prompt=words(PROMPTS[0]), max_tokens=BUDGETS[0], temperature=0)
    assert text.choices[0].text == words(reference[0])  # a text prompt, through the folder's tokenizer


def test_streaming_equals_plain(served, serve_folder: Path, reference) -> None:
    api = client(served)
    chunks = list(
        api.completions.create(
            model=serve_folder.name, prompt=PROMPTS[3], max_tokens=BUDGETS[3], temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == words(reference[3])
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) == len(reference[3])  # one chunk per token
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == len(reference[3]) and not chunks[-1].choices


def test_chat_renders_the_folders_template(served, serve_folder: Path) -> None:
    """The sample template: t6 (user) CONTENT t4 (end of turn), then t7 (the assistant's turn)."""
    api = client(served)
    messages = [{"role": "user", "content": "t9 t10"}]
    want = og_greedy(serve_folder, [[6, 9, 10, 4, 7]], [8])[0]
    done = api.chat.completions.create(model=serve_folder.name, messages=messages, max_tokens=8, temperature=0)
    assert done.choices[0].message.content == words(want) and done.choices[0].message.role == "assistant"
    assert done.usage.prompt_tokens == 5
    stream = api.chat.completions.create(
        model=serve_folder.name, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == words(want)


def test_chat_without_a_template_is_refused(serve_folder: Path, tmp_path: Path) -> None:
    from pakv_onnx.serve import protocol
    from pakv_onnx.serve.text import TextCodec

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((serve_folder / "tokenizer.json").read_bytes())
    info = serve_folder_module.read_folder(serve_folder)
    body = protocol.ChatBody(messages=[protocol.Message(role="user", content="t9")])
    with pytest.raises(protocol.RequestError, match="no chat template") as caught:
        protocol.check_chat(body, TextCodec(bare), info, 257)
    assert caught.value.status == 400 and caught.value.param == "messages"


def test_concurrent_requests_each_equal_og_engine(served, serve_folder: Path) -> None:
    prompts = [[(7 * k + j) % 250 + 3 for j in range(1 + k % 9)] for k in range(16)]
    budgets = [4 + (5 * k) % 17 for k in range(16)]
    want = og_greedy(serve_folder, prompts, budgets)
    api = client(served)

    def one(k: int) -> str:
        if k % 2:
            stream = api.completions.create(
                model=serve_folder.name, prompt=prompts[k], max_tokens=budgets[k], temperature=0, stream=True
            )
            return "".join(c.choices[0].text for c in stream if c.choices)
        return (
            api.completions.create(model=serve_folder.name, prompt=prompts[k], max_tokens=budgets[k], temperature=0)
            .choices[0]
            .text
        )

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, range(16)))
    assert got == [words(w) for w in want]


def test_stop_strings_cut_the_text(served, serve_folder: Path, reference) -> None:
    api = client(served)
    full = words(reference[3])
    stop = f" t{reference[3][5]}"  # the sixth token's word, with the space before it
    cut = full[: full.index(stop)]
    done = api.completions.create(
        model=serve_folder.name, prompt=PROMPTS[3], max_tokens=BUDGETS[3], temperature=0, stop=[stop, "never"]
    )
    assert (done.choices[0].text, done.choices[0].finish_reason) == (cut, "stop")
    stream = api.completions.create(
        model=serve_folder.name, prompt=PROMPTS[3], max_tokens=BUDGETS[3], temperature=0, stop=stop, stream=True
    )
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"


def test_stop_matcher_holds_a_possible_start() -> None:
    matcher = StopMatcher(("ab c",))
    assert matcher.feed("xx a") == "xx "  # "a" may start the stop string
    assert matcher.feed("b") == ""
    assert matcher.feed(" q") == "ab q" and not matcher.stopped
    assert matcher.feed("ab") == "" and matcher.feed(" c tail") == "" and matcher.stopped


def test_sampling_follows_seed_and_top_k(served, serve_folder: Path, reference) -> None:
    api = client(served)

    def sample(**kwargs) -> str:
        done = api.completions.create(model=serve_folder.name, prompt=PROMPTS[0], max_tokens=BUDGETS[0], **kwargs)
        return done.choices[0].text

    first = sample(temperature=1.5, seed=5)
    assert sample(temperature=1.5, seed=5) == first  # og's sampler, reseeded per request
    assert any(sample(temperature=1.5, seed=s) != first for s in (6, 7, 8))
    assert sample(temperature=1.0, extra_body={"top_k": 1}) == words(reference[0])  # top-1 is the top logit


def test_models_health_and_metrics(served, serve_folder: Path) -> None:
    models = client(served).models.list()
    assert [m.id for m in models.data] == [serve_folder.name]
    status, health, headers = http_json(served, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["replica"] == headers["x-pakv-replica"]
    text = _metrics(served)
    for name in ("requests_total", "finished_total", "prompt_tokens_total", "generated_tokens_total",
                 "time_to_first_token_seconds", "inter_token_latency_seconds", "queue_depth", "pool_blocks_free"):  # fmt: skip
        assert f"# TYPE pakv_serve_{name} " in text
    client(served).completions.create(model=serve_folder.name, prompt=[5], max_tokens=3, temperature=0)
    after = _metrics(served)
    assert metric(after, 'pakv_serve_requests_total{status="200"}') >= 1
    assert metric(after, "pakv_serve_time_to_first_token_seconds_count") > metric(
        text, "pakv_serve_time_to_first_token_seconds_count"
    )
    assert (
        metric(after, "pakv_serve_inter_token_latency_seconds_count")
        >= metric(text, "pakv_serve_inter_token_latency_seconds_count") + 2
    )
    assert metric(after, "pakv_serve_pool_blocks_free") == 64


def _metrics(server) -> str:
    connection = http.client.HTTPConnection(HOST, server.port, timeout=30)
    connection.request("GET", "/metrics")
    return connection.getresponse().read().decode()


ERRORS = [
    # (body, status, param, words of the message)
    (b"{not json", 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "JSON object"),
    (json.dumps({"prompt": [1], "max_tokens": 4, "frequency_penalty": 1}).encode(), 400, "frequency_penalty", "unknown or unsupported"),
    (json.dumps({"prompt": [1], "max_tokens": "4"}).encode(), 400, "max_tokens", "valid integer"),
    (json.dumps({"prompt": [1, True]}).encode(), 400, "prompt", "prompt"),
    (json.dumps({"prompt": [1], "temperature": 3}).encode(), 400, "temperature", "less than or equal to 2"),
    (json.dumps({"prompt": [1], "max_tokens": 257}).encode(), 400, "max_tokens", "at most 257 per request"),
    (json.dumps({"prompt": [1] * 250, "max_tokens": 8}).encode(), 400, "max_tokens", "at most 257 per request"),
    (json.dumps({"prompt": "", "max_tokens": 4}).encode(), 400, "prompt", "empty"),
    (json.dumps({"prompt": [], "max_tokens": 4}).encode(), 400, "prompt", "empty"),
    (json.dumps({"prompt": [1, 256], "max_tokens": 4}).encode(), 400, "prompt", "token id 256 is outside the vocabulary (0..255)"),
    (json.dumps({"prompt": [-1], "max_tokens": 4}).encode(), 400, "prompt", "token id -1"),
    (json.dumps({"prompt": [1], "n": 2}).encode(), 400, "n", "n"),
    (json.dumps({"prompt": [1], "stop": ""}).encode(), 400, "stop", "empty"),
    (json.dumps({"prompt": [1], "stream_options": {"include_usage": True}}).encode(), 400, "stream_options", "stream: true"),
    (json.dumps({"prompt": [1], "model": "gpt-4"}).encode(), 404, "model", "does not exist"),
    (json.dumps({"max_tokens": 4}).encode(), 400, "prompt", "missing"),
]  # fmt: skip


@pytest.mark.parametrize(
    "body,status,param,message", ERRORS, ids=[e[3].split()[0] + f"-{i}" for i, e in enumerate(ERRORS)]
)
def test_bad_requests_get_openai_errors(served, body: bytes, status: int, param, message: str) -> None:
    auth = {"authorization": f"Bearer {SERVE_API_KEY}"}
    got, error, _ = http_json(served, "POST", "/v1/completions", body, auth)
    assert got == status, error
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert message in error["error"]["message"] and error["error"]["param"] == param
    assert http_json(served, "GET", "/health")[1]["status"] == "ok"  # the server is unharmed


def test_errors_through_the_openai_client(served, serve_folder: Path) -> None:
    import openai

    api = client(served)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        api.completions.create(model=serve_folder.name, prompt=[1, 999], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="at most 257"):
        api.chat.completions.create(
            model=serve_folder.name, messages=[{"role": "user", "content": "t1"}], max_tokens=300
        )
    with pytest.raises(openai.AuthenticationError):
        client(served, key="wrong").completions.create(model=serve_folder.name, prompt=[1], max_tokens=2)
    status, _, _ = http_json(served, "GET", "/v1/models")  # no key at all
    assert status == 401
    assert http_json(served, "GET", "/health")[0] == 200  # /health and /metrics need no key


def _open_stream(server, prompt: list[int], max_tokens: int) -> socket.socket:
    """A streaming request on a raw socket, read until its first token's chunk."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode()
    sock = socket.create_connection((HOST, server.port), timeout=60)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}\r\nAuthorization: Bearer {SERVE_API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
    sock.sendall(head.encode() + body)
    seen = b""
    while b'"text": "t' not in seen:
        part = sock.recv(65536)
        assert part, seen
        seen += part
    return sock


def _wait_idle(server, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = http_json(server, "GET", "/health")[1]
        if health["running"] == 0 and health["queue_depth"] == 0:
            return health
        time.sleep(0.05)
    raise AssertionError(f"still busy: {health}")


def test_disconnects_cancel_and_free_their_blocks(served, serve_folder: Path) -> None:
    """100 clients leave mid-stream (each reserving 61 of the 64 blocks, so one runs at a time): og.Engine
    cancels each (or it met EOS first), the free blocks return to the start, and a request that needs the
    whole pool then runs to its end (og.Engine would hold it forever had a cancelled request kept blocks)."""
    start = _wait_idle(served)["free_blocks"]
    counts = [f'pakv_serve_finished_total{{reason="{r}"}}' for r in ("cancelled", "stop", "length")]
    before = [metric(_metrics(served), name) for name in counts]
    for k in range(100):
        _open_stream(served, [3 + k % 10, 4 + k], 240).close()
    health = _wait_idle(served)
    assert health["free_blocks"] == start == 64
    cancelled, stopped, ran_out = (metric(_metrics(served), name) - b for name, b in zip(counts, before))
    assert cancelled + stopped == 100 and ran_out == 0  # none ran its 240 tokens (a few may meet EOS first)
    assert cancelled >= 90
    whole = client(served).completions.create(
        model=serve_folder.name, prompt=[9], max_tokens=256, temperature=0, timeout=120
    )
    assert whole.usage.completion_tokens == 256 or whole.choices[0].finish_reason == "stop"


def test_command_checks_before_importing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["serve", str(tmp_path / "none")]) == 2
    assert "none: no such folder" in capsys.readouterr().err
    (tmp_path / "genai_config.json").write_text('{"model": {}}')
    assert cli.main(["serve", str(tmp_path)]) == 2
    assert "not a paged og.Engine config" in capsys.readouterr().err
    assert cli.main(["serve", str(tmp_path), "--port", "70000"]) == 2
    assert "must be in 0..65535" in capsys.readouterr().err


def test_command_without_the_extra_names_the_pip_command(serve_folder: Path, monkeypatch, capsys) -> None:
    from pakv_onnx.commands import serve as command

    real = command.importlib.util.find_spec
    monkeypatch.setattr(command.importlib.util, "find_spec", lambda name: None if name == "fastapi" else real(name))
    assert cli.main(["serve", str(serve_folder)]) == 2
    assert "fastapi (pip install 'pakv-onnx[serve]')" in capsys.readouterr().err
    monkeypatch.setattr(command.importlib.util, "find_spec", lambda name: None if name == "ray" else real(name))
    assert cli.main(["serve", str(serve_folder), "--replicas", "2"]) == 2
    assert "pip install 'pakv-onnx[serve-ray]'" in capsys.readouterr().err


def test_config_file_name_is_the_exports() -> None:
    from pakv_onnx.models.hf import genai

    assert serve_folder_module.GENAI_CONFIG == genai.GENAI_CONFIG
    assert serve_folder_module.CHAT_TEMPLATE_FILE in genai.TOKENIZER_FILES


@pytest.mark.slow  # a server of its own
def test_full_queue_gets_429(serve_folder: Path) -> None:
    """One request runs (batches of 1), one waits (--max-queue 1): the next gets 429. The refused
    request's client is made, and the waiting one sent raw, before anything is timed, so the queue is
    still full when the third asks however busy the machine is (an openai client made in between took
    longer than the running request's tokens on a loaded machine)."""
    import openai

    with running_server(serve_folder, "--max-batch-size", "1", "--max-queue", "1", "--num-blocks", "1024") as server:
        refused = client(server, key="x")
        running = _open_stream(server, [5], 1000)
        body = json.dumps({"prompt": [6], "max_tokens": 2, "temperature": 0}).encode()
        waiting = ThreadPoolExecutor(1).submit(http_json, server, "POST", "/v1/completions", body)
        deadline = time.monotonic() + 30
        while (depth := http_json(server, "GET", "/health")[1]["queue_depth"]) < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert depth == 1, "the second request never waited in the queue"
        with pytest.raises(openai.RateLimitError, match="--max-queue 1"):
            refused.completions.create(model=serve_folder.name, prompt=[7], max_tokens=2)
        running.close()
        status, answer, _ = waiting.result(60)
        assert status == 200 and answer["usage"]["completion_tokens"] >= 1, answer


@pytest.mark.slow  # servers of their own
@pytest.mark.parametrize(
    "sig,grace,tokens",
    [(signal.SIGTERM, "60", 1000), (signal.SIGINT, "0", 1000), (signal.SIGINT, "3", 1000)],
    ids=["sigterm-finish", "sigint-cancel", "sigint-grace"],
)
def test_signal_stops_accepting_and_exits_0(serve_folder: Path, sig: int, grace: str, tokens: int) -> None:
    """A stream in flight: with a grace period it runs to its end (or, past the grace, is cancelled);
    with none it is cancelled (ends early). Either way the port stops accepting and the process exits
    0 with no traceback: the command line's Ctrl-C watchdog (2 s, exit 130) stands by while the
    server shuts down, however long its grace."""
    with running_server(serve_folder, "--num-blocks", "1024", "--shutdown-grace", grace) as server:
        sock = _open_stream(server, [5], tokens)
        server.signal(sig)
        received = b""
        while True:
            part = sock.recv(65536)
            if not part:
                break
            received += part
        assert server.wait(60) == 0, server.process.stderr.read()
        stderr = server.process.stderr.read()
        assert "interrupted" not in stderr and "Traceback" not in stderr, stderr
        with pytest.raises(OSError):
            socket.create_connection((HOST, server.port), timeout=5).close()
        lines = [line.rstrip("\r") for line in received.decode().split("\n")]  # an HTTP chunk may hold several events
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        tokens = sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"])
        if grace == "0":
            assert tokens < 1000  # cancelled mid-way
        elif grace == "60":
            assert reasons[-1] in ("length", "stop") and b"data: [DONE]" in received


@pytest.mark.slow  # a server of its own, interrupted while it loads
@pytest.mark.parametrize("after", [0.6, 1.5, 3.0])
def test_ctrl_c_during_start_up_is_130_and_one_line(serve_folder: Path, after: float) -> None:
    """A Ctrl-C before the server listens follows every command's rule: exit 130, one line, no
    traceback, no engine thread left running (the process ends); once it listens: a clean stop, 0."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "pakv_onnx.cli", "serve", str(serve_folder), "--host", HOST, "--port", "0"]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )  # fmt: skip
    try:
        time.sleep(after)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)
    assert "Traceback" not in stderr and "terminate called" not in stderr, stderr
    if stdout.startswith("serving "):
        assert process.returncode == 0, stderr
    else:
        assert (process.returncode, stderr) == (130, "pakv-onnx: interrupted\n")


def test_help_and_refusals_need_no_extra(tmp_path: Path) -> None:
    """`pakv-onnx --help`, `serve --help` and a refused folder work where fastapi, uvicorn, ray and
    onnxruntime_genai cannot be imported (and import none of them, nor torch)."""
    import subprocess
    import sys

    blocked = ["fastapi", "uvicorn", "ray", "onnxruntime_genai", "torch", "jinja2"]
    script = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None\n"
        "from pakv_onnx import cli\n"
        "assert cli.main(['serve', '--help']) == 0\n"
        f"assert cli.main(['serve', {str(tmp_path / 'none')!r}]) == 2\n"
        "import pakv_onnx.serve.folder\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "OpenAI HTTP API" in done.stdout and "no such folder" in done.stderr
