"""Ctrl-C at any instant of a command: exit 130, one ``pakv-onnx: interrupted`` line, no traceback, no
``terminate called`` (no exception is raised from the signal handler while native code is on the
stack), and nothing left: no half-written output, no folder that was not there before, nothing in
TMPDIR (commands/_interrupt.py, commands/_outputs.py).

The sweeps send SIGINT at instants spread over a whole run of each command, measured from the moment
the command line's handling starts (its watchdog thread appears: before that, the interpreter's own
start-up, site imports included, is Python's). A SIGINT that lands after the outputs are published
is too late to stop anything: the run then ends as it would have without it, with all its outputs.
Quick: a few instants of genai-cpu, demo and a run stuck in native code. Slow: 6 instants each of
demo, export, generate and genai-cpu.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pakv_onnx.commands import _interrupt

MESSAGE = _interrupt.MESSAGE
# What a command may print on stderr besides the message: its progress lines.
PROGRESS_PREFIX = "  .. "
# What the libraries leave in TMPDIR on any run, interrupted or not: onnxruntime's session id file and
# torch's (empty) inductor folder. Not the command's: left out of the comparison.
LIBRARY_TEMP_NAMES = (".ses", "torchinductor_")


@dataclasses.dataclass
class Ending:
    """How one run ended after a SIGINT at ``instant`` seconds into it."""

    instant: float
    code: int
    out: str
    err: str
    seconds_after_signal: float  # from the SIGINT to the exit

    def problems(self) -> list[str]:
        """What is wrong with this ending as a Ctrl-C's (empty: nothing)."""
        lines = [line for line in self.err.splitlines() if line.strip()]
        found = []
        for bad in ("Traceback", "terminate called", "Exception ignored", "Fatal Python error", "KeyboardInterrupt"):
            if bad in self.err:
                found.append(f"{bad!r} on stderr")
        if self.code == 130:
            if not lines or lines[-1] != MESSAGE or lines.count(MESSAGE) != 1:
                found.append("not exactly one closing 'pakv-onnx: interrupted' line")
            others = [line for line in lines[:-1] if not line.startswith(PROGRESS_PREFIX)]
            if others:
                found.append(f"other lines on stderr: {others[:3]}")
        elif MESSAGE in lines:
            found.append(f"exit {self.code} after printing {MESSAGE!r}")
        return found


def tree(*roots: Path) -> dict[str, bytes | None]:
    """Every path under ``roots`` -> its bytes (``None``: a folder), less the libraries' temporary files."""
    listing: dict[str, bytes | None] = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            if dirpath == str(root):
                dirnames[:] = [d for d in dirnames if not d.startswith(LIBRARY_TEMP_NAMES)]
                filenames = [f for f in filenames if not f.startswith(LIBRARY_TEMP_NAMES)]
            for name in dirnames:
                listing[os.path.join(dirpath, name)] = None
            for name in filenames:
                path = os.path.join(dirpath, name)
                listing[path] = Path(path).read_bytes()
    return listing


def _threads(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))


def start(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[subprocess.Popen, float]:
    """Start ``pakv-onnx argv``; return it and the moment its Ctrl-C handling started (its watchdog,
    the first thread the command line starts, is running)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "pakv_onnx.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
    )
    deadline = time.monotonic() + 60
    while _threads(process.pid) < 2 and process.poll() is None:
        assert time.monotonic() < deadline, "the command line never started its handling"
        time.sleep(0.002)
    return process, time.monotonic()


def run_whole(argv: list[str], env: dict[str, str], cwd: Path) -> float:
    """Run once without a signal; the seconds from the handling's start to the exit."""
    process, ready = start(argv, env, cwd)
    out, err = process.communicate(timeout=900)
    assert process.returncode == 0, (argv, out[-2000:], err[-3000:])
    return time.monotonic() - ready


def interrupt_at(argv: list[str], instant: float, env: dict[str, str], cwd: Path) -> Ending:
    """Run ``pakv-onnx argv`` and send SIGINT ``instant`` seconds after its handling started."""
    process, ready = start(argv, env, cwd)
    time.sleep(max(0.0, ready + instant - time.monotonic()))
    process.send_signal(signal.SIGINT)
    sent = time.monotonic()
    out, err = process.communicate(timeout=120)
    return Ending(instant, process.returncode, out, err, time.monotonic() - sent)


@dataclasses.dataclass
class Command:
    """One command to sweep: its argv, what it writes, and how a complete run's outputs look."""

    argv: list[str]
    watched: list[Path]  # folders whose contents must be as before after an interrupted run
    complete: Callable[[], bool]  # whether a run that ended normally left its whole output
    reset: Callable[[], None] = lambda: None  # undo a completed run before the next instant


def sweep(command: Command, env: dict[str, str], cwd: Path, instants: int, whole: float | None = None) -> list[str]:
    """SIGINT at ``instants`` instants spread over a whole run (measured here unless ``whole``
    is given); the problems found, one line each (empty: none)."""
    command.reset()
    if whole is None:
        whole = run_whole(command.argv, env, cwd)
        command.reset()
    before = tree(*command.watched, Path(env["TMPDIR"]))
    problems = []
    for i in range(instants):
        ending = interrupt_at(command.argv, whole * (i + 0.5) / instants, env, cwd)
        label = f"{command.argv[0]} at {ending.instant:.2f}s of {whole:.1f}s (exit {ending.code})"
        problems += [f"{label}: {p}" for p in ending.problems()]
        if ending.code == 130:
            after = tree(*command.watched, Path(env["TMPDIR"]))
            changed = sorted(set(before) ^ set(after) | {p for p in before if p in after and before[p] != after[p]})
            if changed:
                problems.append(f"{label}: left {changed[:4]}")
            if ending.seconds_after_signal > _interrupt.GRACE_SECONDS + 15:
                problems.append(f"{label}: took {ending.seconds_after_signal:.1f}s to exit")
        elif ending.code == 0 and command.complete():
            command.reset()  # the SIGINT came after the publish: a whole run
        else:
            problems.append(f"{label}: {ending.err.strip()[-500:]}")
    return problems


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The commands' environment: their own TMPDIR (checked empty after each run) and cache."""
    (tmp_path / "tmp").mkdir()
    return {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "PAKV_ONNX_CACHE_DIR": str(tmp_path / "cache")}


# --------------------------------------------------------------------------- #
# The commands
# --------------------------------------------------------------------------- #
def demo_command(root: Path) -> Command:
    out = root / "work" / "models"
    (root / "work").mkdir(exist_ok=True)
    argv = ["demo", "--model", "gqa", "--tokens", "64", "--repeats", "1", "--backend", "native", "--out", str(out)]

    def reset() -> None:
        import shutil

        shutil.rmtree(out, ignore_errors=True)

    return Command(
        argv, [root / "work"], lambda: (out / "gqa.onnx").is_file() and (out / "gqa-bs128.onnx").is_file(), reset
    )


def genai_cpu_command(root: Path) -> Command:
    from test_genai_cpu import paged_folder

    folder = paged_folder(root / "paged")
    pristine = tree(folder)

    def reset() -> None:
        for path, data in pristine.items():
            if data is not None:
                Path(path).write_bytes(data)
        for extra in set(tree(folder)) - set(pristine):
            Path(extra).unlink()

    def complete() -> bool:
        from pakv_onnx import native_lib

        return (folder / native_lib.LIBRARY_NAME).is_file() and b"custom_ops_library" in (
            folder / "genai_config.json"
        ).read_bytes()

    return Command(["genai-cpu", str(folder), "--num-blocks", "8"], [folder], complete, reset)


def export_command(root: Path) -> Command:
    from pakv_onnx.models.hf import save_sample_folder

    hf = save_sample_folder(root / "hf", "llama", 0)
    (root / "work").mkdir(exist_ok=True)
    out = root / "work" / "genai"

    def reset() -> None:
        import shutil

        shutil.rmtree(out, ignore_errors=True)

    return Command(
        ["export", str(hf), str(out)], [root / "work", hf], lambda: (out / "genai_config.json").is_file(), reset
    )


def generate_command(root: Path) -> Command:
    (root / "work").mkdir(exist_ok=True)
    out = root / "work" / "step"
    argv = ["generate", "--batch", "2", "--new-tokens", "4", "--backend", "native", "--out", str(out)]

    def reset() -> None:
        import shutil

        shutil.rmtree(out, ignore_errors=True)

    return Command(argv, [root / "work"], lambda: any(out.glob("*.onnx")), reset)


# --------------------------------------------------------------------------- #
# Quick: a few instants
# --------------------------------------------------------------------------- #
def test_ctrl_c_anywhere_in_genai_cpu_leaves_the_folder_as_it_was(tmp_path: Path, env: dict[str, str]) -> None:
    """Three instants over the first 6 s (a quiet machine's whole run: its imports, its checks, its
    edits; a SIGINT after the edits is too late and the run completes)."""
    assert sweep(genai_cpu_command(tmp_path), env, tmp_path, instants=3, whole=6.0) == []


def test_ctrl_c_in_demo_leaves_nothing(tmp_path: Path, env: dict[str, str]) -> None:
    """Two instants of a demo (its imports, its first export), without measuring a whole run first."""
    assert sweep(demo_command(tmp_path), env, tmp_path, instants=2, whole=12.0) == []



def _as_command(script: str, name: str, arguments: tuple[str, ...]) -> str:
    """``script`` (it defines ``run(args)`` and imports sys, types, cli and _args) registered as the CLI
    command ``name`` taking the positional ``arguments``, then run with the script's own argv."""
    return script + f"""
def add_parser(commands):
    parser = _args.add_command(commands, {name!r}, help="test", description="test", examples=[""])
    for argument in {arguments!r}:
        parser.add_argument(argument)
    parser.set_defaults(run=run)

sys.modules[{name!r}] = types.SimpleNamespace(add_parser=add_parser)
cli.COMMAND_MODULES += ({name!r},)
sys.exit(cli.main([{name!r}, *sys.argv[1:]]))
"""


# A command that never reaches a safe point: `python` spins in Python code, `native` sits in a call
# into C (time.sleep holds no Python frame). Each registers its folder for the hard exit and prints
# "started"; a Ctrl-C ends it after the grace period, a second one at once.
_STUCK = r"""
import os, sys, time, types
from pakv_onnx import cli
from pakv_onnx.commands import _args, _interrupt

def run(args):
    os.makedirs(args.folder)
    _interrupt.on_hard_exit(lambda: _interrupt.remove_folder(args.folder))
    print("started", flush=True)
    while True:
        if args.how == "native":
            time.sleep(1000)
        else:
            sum(range(1000))
"""
_STUCK = _as_command(_STUCK, "stuck", ("how", "folder"))


@pytest.mark.parametrize(("how", "presses"), [("python", 1), ("native", 1), ("native", 2)])
def test_ctrl_c_ends_a_command_that_never_reaches_a_safe_point(how: str, presses: int, tmp_path: Path) -> None:
    folder = tmp_path / "work"
    process = subprocess.Popen(
        [sys.executable, "-c", _STUCK, how, str(folder)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert process.stdout.readline() == "started\n"
    for _ in range(presses):
        process.send_signal(signal.SIGINT)
        time.sleep(0.1)
    start = time.perf_counter()
    _out, err = process.communicate(timeout=60)
    seconds = time.perf_counter() - start
    assert process.returncode == 130 and err.strip().splitlines() == [MESSAGE], err
    assert not folder.exists()  # the hard exit ran the registered cleanup
    if presses == 1:
        assert _interrupt.GRACE_SECONDS - 0.5 <= seconds < _interrupt.GRACE_SECONDS + 10, seconds
    else:
        assert seconds < _interrupt.GRACE_SECONDS, seconds


# A server-like command: SIGINT handed over to it; its own handler starts a shutdown longer than the
# watchdog's grace (pakv-onnx serve's --shutdown-grace), on asyncio's loop as uvicorn without uvloop runs.
_SERVER = """
import asyncio, signal, sys, time, types
from pakv_onnx import cli
from pakv_onnx.commands import _args, _interrupt

SHUTDOWN = float(sys.argv[2])

async def serve():
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    previous = signal.signal(signal.SIGINT, lambda signum, frame: loop.call_soon_threadsafe(stop.set))
    if _interrupt.requested():
        stop.set()
    print("started", flush=True)
    await stop.wait()
    await asyncio.sleep(SHUTDOWN)  # the in-flight requests' grace
    signal.signal(signal.SIGINT, previous)

def run(args):
    if args.how == "handed-over":
        with _interrupt.handed_over():
            asyncio.run(serve())
    else:
        asyncio.run(serve())
    print("stopped", file=sys.stderr, flush=True)
    return 0
"""
_SERVER = _as_command(_SERVER, "server", ("how", "shutdown"))


@pytest.mark.parametrize("how", ["handed-over", "not-handed-over"])
def test_a_command_that_stops_itself_on_sigint_keeps_its_exit_code(how: str) -> None:
    """Handed over (``_interrupt.handed_over``: pakv-onnx serve), a SIGINT is the command's own stop: a
    shutdown longer than the watchdog's grace ends with the command's 0, no interrupted line. Not
    handed over, the same command is cut short by the watchdog (130): what serve did before."""
    shutdown = _interrupt.GRACE_SECONDS + 1.0
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVER, how, str(shutdown)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert process.stdout.readline() == "started\n"
    process.send_signal(signal.SIGINT)
    _out, err = process.communicate(timeout=60)
    if how == "handed-over":
        assert (process.returncode, err) == (0, "stopped\n")
    else:
        assert (process.returncode, err.strip().splitlines()) == (130, [MESSAGE])


def test_ctrl_c_between_cases_exits_130_with_one_line(tmp_path: Path) -> None:
    """The cases command checks before each case (a safe point): a Ctrl-C there ends it through the
    command line, one line, well within the hard exit's grace plus the interpreter's shutdown."""
    process, _ready = start(["cases", "heads1_k128_v64", "--random", "1000000"], {**os.environ}, tmp_path)
    seen = ""
    while "[2/" not in seen:
        line = process.stdout.readline()
        assert line, "cases ended early"
        seen += line
    process.send_signal(signal.SIGINT)
    start_time = time.perf_counter()
    _out, err = process.communicate(timeout=60)
    assert process.returncode == 130 and err.strip().splitlines() == [MESSAGE], err
    assert time.perf_counter() - start_time < 10


# --------------------------------------------------------------------------- #
# Slow: the broad sweep
# --------------------------------------------------------------------------- #
@pytest.mark.slow  # a whole run and 6 runs cut short at instants spread over it, per command (24 instants)
@pytest.mark.parametrize("make", [demo_command, export_command, generate_command, genai_cpu_command])
def test_ctrl_c_at_any_instant_of_a_command(make, tmp_path: Path, env: dict[str, str]) -> None:
    assert sweep(make(tmp_path), env, tmp_path, instants=6) == []
