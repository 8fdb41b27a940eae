"""Ctrl-C that always ends a command promptly, with one line and nothing half-written.

Python's own handling raises ``KeyboardInterrupt`` wherever the main thread happens to be, and
libraries lose it there: raised inside a weakref callback it is printed and dropped, raised inside
an import (torch's exporter imports lazily) it becomes an ``AttributeError`` that an exporter
catches and retries past, raised between a lock's acquire and its ``try`` it leaves the lock held.
A command interrupted there would run on to the end, or hang. So, while :func:`handling` is active:

- the first SIGINT raises ``KeyboardInterrupt`` as usual and marks the run interrupted;
- until the command line has caught it (:attr:`State.acknowledged`), a watchdog thread raises it
  again every :data:`RETRY_SECONDS` (never inside a handler already unwinding one, so ``finally``
  cleanups run undisturbed), and reports of one dropped in a callback are not printed;
- :func:`check` raises it at a command's checkpoints (its progress lines, each case), so an
  interrupt that became another exception and was caught as a failure still ends the run;
- any exception that reaches the command line after the interrupt counts as the interrupt;
- if the main thread still has not ended it after :data:`HARD_EXIT_SECONDS` (stuck in a long call
  into C), the watchdog runs the registered cleanups (:func:`on_hard_exit`), prints the line and exits 130.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
MESSAGE = "pakv-onnx: interrupted"
RETRY_SECONDS = 1.0
HARD_EXIT_SECONDS = 5.0


@dataclasses.dataclass
class State:
    """One :func:`handling` run's interrupt state (plain attributes: reading them runs no handler)."""

    requested: bool = False  # a SIGINT arrived
    acknowledged: bool = False  # the command line caught it: stop raising it
    active: bool = True  # the handling context is open
    cleanups: list[Callable[[], None]] = dataclasses.field(default_factory=list)


STATE = State(active=False)


def requested() -> bool:
    """Whether Ctrl-C was pressed during the current :func:`handling` run."""
    return STATE.requested


def check() -> None:
    """A checkpoint: raise ``KeyboardInterrupt`` if Ctrl-C was pressed and the run is still going."""
    if STATE.requested and not STATE.acknowledged:
        raise KeyboardInterrupt


def on_hard_exit(callback: Callable[[], None]) -> None:
    """Run ``callback`` (idempotent: a staging folder's removal, say) if this run ends by a hard exit
    (:data:`HARD_EXIT_SECONDS`), where no ``finally`` runs. Forgotten when :func:`handling` ends."""
    STATE.cleanups.append(callback)


@contextlib.contextmanager
def handling() -> Iterator[State]:
    """Install the SIGINT handling above for the block (main thread only; elsewhere: Python's own)."""
    global STATE
    if threading.current_thread() is not threading.main_thread():
        yield STATE
        return
    state = STATE = State()
    previous_handler = signal.signal(signal.SIGINT, lambda signum, frame: _on_sigint(state))
    previous_hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: _report_unraisable(state, unraisable, previous_hook)
    try:
        yield state
    finally:
        state.active = False
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous_handler is None else previous_handler)
        sys.unraisablehook = previous_hook


def _on_sigint(state: State) -> None:
    if not state.requested:
        state.requested = True
        threading.Thread(target=_watchdog, args=(state,), name="pakv-onnx-interrupt", daemon=True).start()
    if state.acknowledged or isinstance(sys.exc_info()[1], KeyboardInterrupt):
        return  # caught already, or a cleanup is running because of it: let it finish
    raise KeyboardInterrupt


def _report_unraisable(state: State, unraisable, previous_hook) -> None:
    if state.requested and isinstance(unraisable.exc_value, KeyboardInterrupt):
        return  # our Ctrl-C, dropped inside a callback: the watchdog raises it again
    previous_hook(unraisable)


def _watchdog(state: State) -> None:
    """Raise the interrupt again until the command line has it; exit hard if it never does."""
    deadline = time.monotonic() + HARD_EXIT_SECONDS
    main = threading.main_thread().ident
    while True:
        time.sleep(RETRY_SECONDS)
        if state.acknowledged or not state.active:
            return
        if time.monotonic() >= deadline:
            _hard_exit(state)
        signal.pthread_kill(main, signal.SIGINT)


def _hard_exit(state: State) -> None:
    for callback in list(state.cleanups):
        with contextlib.suppress(Exception):
            callback()
    os.write(2, f"{MESSAGE}\n".encode())  # not through sys.stderr, whose lock the stuck thread may hold
    os._exit(EXIT_INTERRUPTED)
