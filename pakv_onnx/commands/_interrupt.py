"""Ctrl-C that always ends a command promptly, with one line and nothing half-written.

Python's own handling raises ``KeyboardInterrupt`` wherever the main thread happens to be, and that
is not safe: raised while a C++ extension is on the stack (onnx's nanobind module during
``import onnx``, a torch or ORT callback into Python) it becomes a C++ exception that can end the
process in ``std::terminate`` ("terminate called after throwing an instance of
'nanobind::python_error'", exit 134); raised inside a weakref callback it is printed and dropped;
raised inside an import it becomes another error a library catches and retries past. So, while
:func:`handling` is active, **no exception is ever raised from the signal handler**:

- the SIGINT handler only stores a flag (:attr:`State.requested`); Python's C-level handler also
  writes the signal's number to a pipe (``signal.set_wakeup_fd``), so a watchdog thread learns of
  it at once even while the main thread sits in a long native call (an ORT run, an export);
- the command raises ``KeyboardInterrupt`` itself at its safe points, plain Python code of its own
  (:func:`check`: each progress line, each case, after each heavy import), so its ``finally``
  blocks remove what it staged and the command line prints the line and returns 130;
- if the main thread reaches no safe point within :data:`GRACE_SECONDS` (it is inside a library:
  an export, a model load, a session run), or a second Ctrl-C comes, the watchdog runs the
  registered cleanups (:func:`on_hard_exit`: every staging and temporary folder), prints the line
  and ends the process with ``os._exit(130)``;
- outputs are written to a staging folder and published by renames after :func:`commit`
  (:mod:`pakv_onnx.commands._outputs`); from then on the command finishes as if no Ctrl-C had come
  (the publish takes milliseconds), so a run ends with none of its outputs or with all of them.

Before :func:`handling` starts (the interpreter's own start-up, site imports included: 0.1-0.4 s
on the 2-core machine, then ``import pakv_onnx.cli``'s tens of milliseconds) Python's own handling
applies; after it ends (the command has its exit code) SIGINT is ignored while the process exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
MESSAGE = "pakv-onnx: interrupted"
GRACE_SECONDS = 2.0  # how long the main thread has to reach a safe point before the hard exit
POLL_SECONDS = 0.25  # the watchdog also reads the flag this often (another library may own the wakeup fd)


@dataclasses.dataclass
class State:
    """One :func:`handling` run's interrupt state (plain attributes: the handler only stores one)."""

    requested: bool = False  # a SIGINT arrived
    committed: bool = False  # the outputs are being published: a Ctrl-C now is too late to stop them
    handed_over: bool = False  # a server stops itself on SIGINT (:func:`handed_over`): the watchdog stands by
    active: bool = True  # the handling context is open
    cleanups: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    # Whoever takes it ends the run: the command line (the line, then 130) or the watchdog (hard exit).
    ending: threading.Lock = dataclasses.field(default_factory=threading.Lock)


STATE = State(active=False)


def requested() -> bool:
    """Whether Ctrl-C was pressed during the current :func:`handling` run."""
    return STATE.requested


def check() -> None:
    """A safe point: raise ``KeyboardInterrupt`` if Ctrl-C was pressed and the outputs are not being
    published. Call it only from the command's own Python code, never from a callback a library
    (C++ or Python) calls: there the exception could meet native frames or be swallowed."""
    if STATE.requested and not STATE.committed:
        raise KeyboardInterrupt


def commit() -> None:
    """The last safe point before a command publishes its outputs (renames, in place edits): raise
    ``KeyboardInterrupt`` if Ctrl-C was pressed, else mark the run committed, after which a Ctrl-C
    neither stops the command nor changes its exit code (the publish takes milliseconds)."""
    check()
    STATE.committed = True


@contextlib.contextmanager
def handed_over() -> Iterator[State]:
    """A long-running command that stops itself on SIGINT (``pakv-onnx serve``: stop accepting, finish or
    cancel what is in flight within its grace, exit 0) runs this block with SIGINT its own: a safe point
    on entry (a Ctrl-C before it, during the start-up, ends the run as anywhere else: 130), then the
    watchdog neither marks the run interrupted nor ends it, however long the server's shutdown takes.
    The block installs its own SIGINT handler; one that comes before it does sets the flag, which the
    block reads with :func:`requested` once its handler is in place (and then stops at once). When the
    block ends the Ctrl-C has been dealt with: the run ends with the block's exit code, not 130."""
    check()
    state = STATE
    state.handed_over = True
    try:
        yield state
    finally:
        state.handed_over = False
        state.requested = False


def on_hard_exit(callback: Callable[[], None]) -> Callable[[], None]:
    """Run ``callback`` (idempotent: a staging folder's removal, say) if this run ends by a hard exit,
    where no ``finally`` runs. Returns a function that forgets it again (its work was done)."""
    state = STATE
    state.cleanups.append(callback)
    return lambda: state.cleanups.remove(callback) if callback in state.cleanups else None


def remove_folder(path: Path) -> None:
    """Remove ``path`` and everything in it, retried while it still exists (the main thread may be
    writing a file into it while the watchdog removes it: once the folder itself is gone, nothing
    can be written there again)."""
    for _ in range(20):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            return


def end_run(state: State) -> bool:
    """Take the right to end the run (the command line calls it on its way out after a Ctrl-C):
    ``False`` when the watchdog's hard exit has it already."""
    return state.ending.acquire(blocking=False)


@contextlib.contextmanager
def handling(*, then_ignore: bool = False) -> Iterator[State]:
    """Install the SIGINT handling above for the block (main thread only; elsewhere: Python's own).

    When it ends, SIGINT is ignored from then on if the run was interrupted or ``then_ignore`` (the
    process is on its way out with its exit code decided: a Ctrl-C during the interpreter's
    shutdown, which can take a second after torch, must neither raise nor kill it by the signal);
    otherwise the previous handler is restored."""
    global STATE
    if threading.current_thread() is not threading.main_thread():
        yield STATE
        return
    state = STATE = State()
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    previous_handler = signal.signal(signal.SIGINT, lambda signum, frame: _on_sigint(state))
    try:
        previous_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:  # not supported here: the watchdog polls the flag alone
        previous_wakeup = None
    watchdog = threading.Thread(target=_watchdog, args=(state, read_fd), name="pakv-onnx-interrupt", daemon=True)
    watchdog.start()
    try:
        yield state
    finally:
        state.active = False
        if previous_wakeup is not None:
            signal.set_wakeup_fd(previous_wakeup)
        # Python's shutdown keeps SIG_IGN (it resets a Python-level handler to SIG_DFL).
        ignore = then_ignore or state.requested
        signal.signal(signal.SIGINT, signal.SIG_IGN if ignore else previous_handler or signal.SIG_DFL)
        with contextlib.suppress(OSError):
            os.write(write_fd, b"\0")  # wakes the watchdog, which sees the run over and returns
        watchdog.join(timeout=1.0)
        os.close(write_fd)
        if not watchdog.is_alive():
            os.close(read_fd)


def _on_sigint(state: State) -> None:
    state.requested = True  # nothing else: no exception, no lock, no allocation worth naming


def _watchdog(state: State, read_fd: int) -> None:
    """Wait for a SIGINT; then give the main thread :data:`GRACE_SECONDS` to end the run, else end it
    (at once on a second Ctrl-C)."""
    deadline = None
    while True:
        timeout = POLL_SECONDS if deadline is None else max(0.0, min(POLL_SECONDS, deadline - time.monotonic()))
        readable, _, _ = select.select([read_fd], [], [], timeout)
        sigints = _drain(read_fd).count(signal.SIGINT) if readable else 0
        if not state.active or state.ending.locked():
            return  # the run is over, or the command line is ending it
        if state.handed_over:
            deadline = None  # the command stops itself (handed_over)
            continue
        if sigints:
            state.requested = True  # the Python-level handler runs only when the main thread next can
        if state.committed:
            deadline = None  # publishing: let it finish
            continue
        if state.requested and deadline is None:
            deadline = time.monotonic() + GRACE_SECONDS
            sigints -= 1
        if deadline is not None and (sigints > 0 or time.monotonic() >= deadline):
            _hard_exit(state)
            return


def _drain(read_fd: int) -> bytes:
    data = b""
    with contextlib.suppress(BlockingIOError, InterruptedError):
        while chunk := os.read(read_fd, 512):
            data += chunk
    return data


def _hard_exit(state: State) -> None:
    if not end_run(state):
        return  # the command line is ending the run itself
    for callback in list(state.cleanups):
        with contextlib.suppress(Exception):
            callback()
    os.write(2, f"{MESSAGE}\n".encode())  # not through sys.stderr, whose lock the main thread may hold
    os._exit(EXIT_INTERRUPTED)
