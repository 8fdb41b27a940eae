"""Benchmark: `pakv-onnx serve` under N concurrent streaming clients against og.Engine driven directly.

One closed-loop workload per client count (``--clients``, default 1,4,16,64): each client sends
``--requests`` greedy requests one after another, ragged prompt lengths (``--prompts``) and budgets
(``--generate``), seeded; the same workload runs through
  server  ``pakv-onnx serve`` in a child process, each client a thread streaming over raw HTTP (SSE), the
          threads in a process of their own (``--clients-in own-process``, default) or in this one
  direct  og.Engine in this process, each client's next request submitted when its last one finished
Both over the same exported folder (``--size``: the sample Llama or the mid-size one of benchmarks/_genai.py,
block size 16, ``--threads`` intra-op threads).
Figures: time to first token p50 / p99 (from the request's send), inter-token latency p50 / p99 (as
the client sees tokens arrive; one SSE event per token, several per socket write when they queued), generated tokens per second
(all tokens / wall time). Goals: at 16 clients the server keeps >= 90% of og.Engine's tokens/s and
its p99 ITL <= 1.5x og.Engine's. Then a soak (``--soak`` seconds at 16 clients): every request ends
once with its [DONE], and a request repeated gives the same token count each time (none lost or
duplicated), and the server's RSS is
sampled (flat: last sample within 10% of the first after warm-up).

    python benchmarks/bench_serve.py [--clients 1,4,16,64] [--requests 4] [--prompts 8,64] [--generate 16,64]
                                     [--threads 1] [--soak 60]
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def make_workload(
    clients: int, requests: int, prompts: tuple[int, int], generate: tuple[int, int], vocab: int, seed: int
):
    """Per client: ``requests`` (prompt ids, budget) pairs."""
    rng = random.Random(seed)
    return [
        [
            ([rng.randrange(3, vocab) for _ in range(rng.randint(*prompts))], rng.randint(*generate))
            for _ in range(requests)
        ]
        for _ in range(clients)
    ]


class Record:
    """Per-request send time and token arrival times; the run's totals."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.tokens = 0
        self.lock = threading.Lock()

    def add(self, sent: float, arrivals: list[float]) -> None:
        with self.lock:
            if arrivals:
                self.ttft.append(arrivals[0] - sent)
                self.itl += [b - a for a, b in itertools.pairwise(arrivals)]
            self.tokens += len(arrivals)


def stream_one(port: int, prompt: list[int], budget: int) -> tuple[float, list[float], bool]:
    """One streaming request: (send time, each token chunk's arrival time, ended with [DONE])."""
    body = json.dumps({"prompt": prompt, "max_tokens": budget, "temperature": 0, "stream": True})
    connection = http.client.HTTPConnection(HOST, port, timeout=300)
    sent = time.perf_counter()
    connection.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
    response = connection.getresponse()
    arrivals, done = [], False
    for raw in response:
        line = raw.strip()
        if line == b"data: [DONE]":
            done = True
        elif line.startswith(b"data: {"):
            now = time.perf_counter()
            choices = json.loads(line[6:])["choices"]
            if choices and choices[0]["text"]:
                arrivals.append(now)
    connection.close()
    return sent, arrivals, done


def run_server_clients(
    port: int, workload, record: Record, until: float | None = None, ledger: list | None = None
) -> float:
    def client(k: int) -> None:
        i = 0
        while True:
            if until is None and i >= len(workload[k]):
                return
            if until is not None and time.perf_counter() >= until:
                return
            prompt, budget = workload[k][i % len(workload[k])]
            sent, arrivals, done = stream_one(port, prompt, budget)
            record.add(sent, arrivals)
            if ledger is not None:
                ledger.append((k, i, len(arrivals), budget, done))
            i += 1

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(len(workload))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def run_clients_elsewhere(port: int, workload, record: Record) -> float:
    """:func:`run_server_clients` in a child process (``--client-worker``), so the clients' own Python
    (HTTP parsing, JSON, threads) is not billed to the server's process; their times land in ``record``."""
    done = subprocess.run(
        [sys.executable, __file__, "--client-worker"], input=json.dumps({"port": port, "workload": workload}),
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    result = json.loads(done.stdout)
    record.ttft, record.itl, record.tokens = result["ttft"], result["itl"], result["tokens"]
    return result["seconds"]


def client_worker() -> None:
    """The body of ``--client-worker``: the workload from stdin, the times as JSON on stdout."""
    job = json.loads(sys.stdin.read())
    record = Record()
    seconds = run_server_clients(job["port"], [[tuple(r) for r in c] for c in job["workload"]], record)
    print(json.dumps({"ttft": record.ttft, "itl": record.itl, "tokens": record.tokens, "seconds": seconds}))


def run_direct(folder: Path, workload, threads: int) -> tuple[Record, float]:
    """The workload through og.Engine in this process: each client's requests in turn."""
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    engine = og.Engine(og.Model(config))
    events = engine.create_event_buffer(1024)
    record, live = Record(), {}
    nexts = [0] * len(workload)

    def submit(k: int) -> None:
        prompt, budget = workload[k][nexts[k]]
        nexts[k] += 1
        request = engine.create_request()
        options = og.TurnOptions(request)
        options.set_do_sample(False)
        options.set_max_generated_tokens(budget)
        request.begin_turn(np.array(prompt, dtype=np.int32), options)
        live[id(request)] = (k, request, time.perf_counter(), [])

    start = time.perf_counter()
    for k in range(len(workload)):
        submit(k)
    finished = int(og.EngineEventFlags.TURN_FINISHED)
    while live:
        for event in engine.run(events):
            entry = live.get(id(event.request)) if event.request is not None else None
            if entry is None:
                continue
            if event.token is not None:
                entry[3].append(time.perf_counter())
            if int(event.flags) & finished:
                del live[id(event.request)]
                record.add(entry[2], entry[3])
                if nexts[entry[0]] < len(workload[entry[0]]):
                    submit(entry[0])
    return record, time.perf_counter() - start


def start_server(folder: Path, threads: int, max_batch: int) -> tuple[subprocess.Popen, int]:
    command = [sys.executable, "-m", "pakv_onnx.cli", "serve", str(folder), "--port", "0", "--threads", str(threads),
               "--max-batch-size", str(max_batch), "--max-queue", "4096"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = process.stdout.readline()
    match = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
    if not match:
        process.kill()
        raise RuntimeError(f"the server did not start: {line!r}")
    return process, int(match.group(1))


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def row(label: str, record: Record, seconds: float) -> dict:
    return {
        "label": label, "ttft50": 1e3 * percentile(record.ttft, 50), "ttft99": 1e3 * percentile(record.ttft, 99),
        "itl50": 1e3 * percentile(record.itl, 50), "itl99": 1e3 * percentile(record.itl, 99),
        "tps": record.tokens / seconds, "tokens": record.tokens,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,4,16,64")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompts", default="8,64")
    parser.add_argument("--generate", default="16,64")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--soak", type=float, default=60.0)
    parser.add_argument("--size", choices=("tiny", "mid"), default="tiny", help="benchmarks/_genai.py's Llama sizes")
    parser.add_argument(
        "--clients-in", choices=("server-host", "own-process"), default="own-process",
        help="own-process: the client threads run in a child process of their own (default); server-host: in "
        "this process, as before",
    )  # fmt: skip
    parser.add_argument("--client-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client_worker:
        return client_worker()
    span = lambda text: tuple(int(x) for x in text.split(","))
    clients = span(args.clients)
    max_batch = max(clients)
    from pakv_onnx import cli
    from pakv_onnx.models.hf import save_sample_folder

    with tempfile.TemporaryDirectory() as tmp:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import _genai

        hf = save_sample_folder(Path(tmp) / "hf", "llama", 0, **_genai.SIZES[args.size])
        folder = Path(tmp) / f"{args.size}-llama-genai"
        export = ["export", str(hf), str(folder), "--block-size", "16", "--num-blocks", "2048",
                  "--max-batch-size", str(max_batch), "--threads", str(args.threads)]  # fmt: skip
        assert cli.main(export) == 0
        vocab = json.loads((folder / "genai_config.json").read_text())["model"]["vocab_size"]
        process, port = start_server(folder, args.threads, max_batch)
        try:
            load = os.getloadavg()[0]
            print(f"load average at start: {load:.1f} on {os.cpu_count()} CPUs; threads {args.threads}; model "
                  f"{args.size}; clients in {args.clients_in}")  # fmt: skip
            print(
                "| clients | path | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | tokens/s | **server / og.Engine tokens/s** | **ITL p99 ratio** |"
            )
            print("|---|---|---|---|---|---|---|---|---|")
            for n in clients:
                workload = make_workload(n, args.requests, span(args.prompts), span(args.generate), vocab, seed=n)
                stream_one(port, [5], 2)  # warm
                direct_record, direct_s = run_direct(folder, workload, args.threads)
                server_record = Record()
                clients_run = run_clients_elsewhere if args.clients_in == "own-process" else run_server_clients
                server_s = clients_run(port, workload, server_record)
                d, s = row("og.Engine", direct_record, direct_s), row("server", server_record, server_s)
                assert d["tokens"] == s["tokens"], (d["tokens"], s["tokens"])
                for r in (d, s):
                    ratio = f"{s['tps'] / d['tps']:.2f}" if r is s else ""
                    itl = f"{s['itl99'] / d['itl99']:.2f}" if r is s else ""
                    print(f"| {n} | {r['label']} | {r['ttft50']:.1f} | {r['ttft99']:.1f} | {r['itl50']:.2f} | "
                          f"{r['itl99']:.2f} | {r['tps']:.0f} | {ratio} | {itl} |", flush=True)  # fmt: skip
            if args.soak:
                workload = make_workload(16, 8, span(args.prompts), span(args.generate), vocab, seed=99)
                ledger: list = []
                rss = [rss_mib(process.pid)]
                until = time.perf_counter() + args.soak
                sampler_stop = threading.Event()

                def sample() -> None:
                    while not sampler_stop.wait(5):
                        rss.append(rss_mib(process.pid))

                sampler = threading.Thread(target=sample)
                sampler.start()
                record = Record()
                seconds = run_server_clients(port, workload, record, until=until, ledger=ledger)
                sampler_stop.set()
                sampler.join()
                rss.append(rss_mib(process.pid))
                keys = [(k, i) for k, i, *_ in ledger]
                counts: dict = {}  # the same request (greedy) must give the same count every time
                for k, i, got, _, _ in ledger:
                    counts.setdefault((k, i % len(workload[k])), set()).add(got)
                short = [e for e in ledger if not e[4] or e[2] > e[3]] + [c for c in counts.values() if len(c) > 1]
                print(f"soak {seconds:.0f}s at 16 clients: {len(ledger)} requests, {record.tokens} tokens "
                      f"({record.tokens / seconds:.0f}/s), duplicates {len(keys) - len(set(keys))}, inconsistent or without [DONE] "
                      f"{len(short)}; server RSS MiB {' '.join(f'{v:.0f}' for v in rss)}")  # fmt: skip
            print(f"load average at end: {os.getloadavg()[0]:.1f}")
        finally:
            process.terminate()
            process.wait(60)


if __name__ == "__main__":
    main()
