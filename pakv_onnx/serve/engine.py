"""One og.Engine and the thread that steps it: what the HTTP side submits jobs to and reads tokens from.

Every og call happens on the engine thread (:meth:`EngineLoop._loop`): the HTTP side only appends
commands (submit, cancel) to an inbox under a lock and wakes the thread; the thread applies them
between steps, runs ``engine.run`` while any request is live, and hands each step's tokens to the
requests' asyncio queues with one ``loop.call_soon_threadsafe`` per event loop per step. When nothing
is live it sleeps on the inbox. og.Engine's ``run`` releases the GIL while the model runs, so the
event loop serves HTTP meanwhile.

Admission by pool blocks. og.Engine 0.18 on a CPU does not preempt: requests whose tokens outgrow the
pool together stall forever (every ``run`` answers CAPACITY_BLOCKED). So a job enters og.Engine only
when the blocks it can ever need, ``ceil((prompt + max_tokens - 1) / block_size)`` (the last token is
never written to the cache), fit beside those of the live jobs, and at most ``max_batch_size`` jobs are
live; the rest wait here, in order, up to ``max_queue`` (then :class:`QueueFullError`: HTTP 429).
Blocks og.Engine keeps for prefix caching after a request ends are evicted when a new request needs
them, so they do not count against admission.

Free blocks. og.Engine exposes no count of its pool's free blocks (0.18: ``get_capabilities`` gives
max_batch_size, max_request_length, max_scheduled_tokens only). The server counts, for each live job,
the blocks its tokens occupy, ``ceil((prompt + generated) / block_size)`` capped at its reservation;
``free = num_blocks - sum`` (:attr:`EngineLoop.free_blocks`). It is derived from og's events (a job
leaves the count when og reports its turn finished, cancelled included), not read from og's allocator;
docs/serve.md says so, and tests/test_serve.py checks og's side by serving a request that needs the
whole pool after many cancellations.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import json
import threading
import time
from collections.abc import Callable

from pakv_onnx.serve.folder import FolderInfo

# og.FinishReason name -> the OpenAI finish_reason (CANCELLED: the job's own reason, see Ticket.cancel_reason)
FINISH_REASONS = {
    "EOS": "stop",
    "STOP_STRING": "stop",
    "MAX_GENERATED_TOKENS": "length",
    "MAX_SESSION_TOKENS": "length",
    "FAILED": "error",
}


class QueueFullError(RuntimeError):
    """``max_queue`` jobs wait already (HTTP 429)."""


class EngineStoppedError(RuntimeError):
    """The engine is shutting down and takes no new jobs (HTTP 503)."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How a job picks tokens: greedy (og's top logit) at temperature 0, else og's sampler."""

    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass(frozen=True)
class Job:
    """One generation: ``prompt`` token ids, at most ``max_tokens`` new tokens."""

    prompt: tuple[int, ...]
    max_tokens: int
    sampling: Sampling = Sampling(temperature=0.0)


@dataclasses.dataclass(frozen=True)
class Tokens:
    """New token ids of one job (what one engine step gave it)."""

    ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Finished:
    """A job's end: the OpenAI ``finish_reason`` (``stop``, ``length``) or ``cancelled`` / ``error``,
    and og.Engine's usage counts."""

    reason: str
    prompt_tokens: int
    generated_tokens: int
    cached_prompt_tokens: int = 0
    error: str | None = None


Event = Tokens | Finished


@dataclasses.dataclass(eq=False)
class Ticket:
    """One submitted job; :attr:`queue` receives its :class:`Tokens` and one :class:`Finished`."""

    id: int
    job: Job
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    reserved: int  # pool blocks admission set aside for it
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    # engine thread only
    request: object = None  # og.Request while live (og closes a request nobody references)
    turn: int = 0
    generated: int = 0
    held: int = 0  # blocks its tokens occupy (counted in EngineLoop.held_blocks)
    last_token_at: float = 0.0
    cancel_requested: bool = False
    cancel_reason: str = "cancelled"  # what its Finished says when og reports it CANCELLED

    def blocks_for(self, tokens: int, block_size: int) -> int:
        return min(self.reserved, -(-tokens // block_size))


def reserved_blocks(prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """Blocks a job can ever occupy: its prompt and every generated token but the last (never cached)."""
    return max(1, -(-(prompt_tokens + max_tokens - 1) // block_size))


class EngineLoop:
    """og.Engine over ``info``'s folder, stepped by one thread (see the module docstring).

    ``observe`` receives ``(name, value)`` measurements from the engine thread: ``ttft`` and ``itl``
    seconds, ``prompt_tokens`` / ``generated_tokens`` counts and ``finished:<reason>``.
    """

    def __init__(
        self,
        info: FolderInfo,
        *,
        threads: int | None = None,
        max_queue: int = 256,
        observe: Callable[[str, float], None] = lambda name, value: None,
    ) -> None:
        self.info = info
        self.threads = threads
        self.max_queue = max_queue
        self.observe = observe
        self.max_request_length = 0  # og.Engine's cap on prompt + generated tokens (set by start)
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, Ticket]] = []
        self._waiting_count = 0  # jobs submitted and not yet admitted (inbox + waiting)
        self._stopping = False
        self._ids = itertools.count(1)
        # engine thread only
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._live: dict[int, Ticket] = {}  # id(og request) -> ticket
        self._reserved = 0
        self.held_blocks = 0
        self._thread: threading.Thread | None = None

    # --- the HTTP side ---------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        """Jobs waiting for admission."""
        return self._waiting_count

    @property
    def running(self) -> int:
        """Jobs live in og.Engine."""
        return len(self._live)

    @property
    def free_blocks(self) -> int:
        """``num_blocks`` minus the blocks live jobs' tokens occupy (derived: see the module docstring)."""
        return self.info.num_blocks - self.held_blocks

    @property
    def reserved(self) -> int:
        """Blocks admission has set aside for live jobs."""
        return self._reserved

    def start(self) -> EngineLoop:
        """Start the engine thread, which loads the model into an og.Engine (og.Engine must be driven
        by the thread that made it), and wait until it has. Returns ``self``; a load error is raised here."""
        loaded = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._main, args=(loaded, failure), name="pakv-serve-engine", daemon=True
        )
        self._thread.start()
        loaded.wait()
        if failure:
            self._thread.join()
            raise failure[0]
        return self

    def _load(self) -> None:
        import onnxruntime_genai as og

        overlay: dict = {
            "engine": {
                "dynamic_batching": {"num_blocks": self.info.num_blocks, "max_batch_size": self.info.max_batch_size}
            }
        }
        if self.threads:
            overlay["model"] = {"decoder": {"session_options": {"intra_op_num_threads": self.threads}}}
        config = og.Config(str(self.info.path))
        config.overlay(json.dumps(overlay))
        self._og = og
        self._model = og.Model(config)
        self._engine = og.Engine(self._model)
        self.max_request_length = int(self._engine.get_capabilities().max_request_length)

    def _main(self, loaded: threading.Event, failure: list) -> None:
        try:
            self._load()
        except BaseException as err:  # noqa: BLE001 (handed to start(), which raises it)
            failure.append(err)
            return
        finally:
            loaded.set()
        self._loop()

    def submit(self, job: Job, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> Ticket:
        """Queue ``job``; its events arrive on ``queue`` (through ``loop``).

        Raises:
            QueueFullError: ``max_queue`` jobs wait already.
            EngineStoppedError: the engine is shutting down.
        """
        reserved = reserved_blocks(len(job.prompt), job.max_tokens, self.info.block_size)
        ticket = Ticket(next(self._ids), job, loop, queue, reserved)
        with self._cond:
            if self._stopping:
                raise EngineStoppedError("the server is shutting down")
            if self._waiting_count >= self.max_queue:
                raise QueueFullError(f"{self._waiting_count} requests wait already (--max-queue {self.max_queue})")
            self._waiting_count += 1
            self._inbox.append(("submit", ticket))
            self._cond.notify()
        return ticket

    def cancel(self, ticket: Ticket, reason: str = "cancelled") -> None:
        """Stop ``ticket``'s job (a client that left; ``reason`` ``stop``: a stop string matched):
        og.Engine drops it and its blocks at its next step; a job still waiting leaves the queue. Its
        :class:`Finished` says ``reason`` unless it finished first."""
        ticket.cancel_reason = reason
        with self._cond:
            self._inbox.append(("cancel", ticket))
            self._cond.notify()

    def cancel_all(self) -> None:
        """Take no new jobs (:class:`EngineStoppedError`) and cancel every job, waiting or live: each
        gets its :class:`Finished` (``cancelled``) at the engine's next step, after which the engine
        thread ends. Returns at once (the server's shutdown, at the end of its grace)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def stop(self, timeout: float = 30.0) -> None:
        """:meth:`cancel_all`, then wait for the engine thread to end (at most ``timeout`` seconds)."""
        self.cancel_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # --- the engine thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        events = self._engine.create_event_buffer(4 * self.info.max_batch_size + 16)
        stopped = False
        while True:
            with self._cond:
                while not self._inbox and not self._live and not self._stopping:
                    self._cond.wait()
                inbox, self._inbox = self._inbox, []
                stopping = self._stopping
            out: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Event]]] = {}
            for command, ticket in inbox:
                if command == "submit":
                    self._waiting.append(ticket)
                else:
                    self._cancel(ticket, out)
            if stopping and not stopped:
                stopped = True
                for ticket in list(self._waiting) + list(self._live.values()):
                    self._cancel(ticket, out)
            self._admit()
            if self._live:
                self._dispatch(self._engine.run(events), out)
                self._admit()  # into the room finished jobs left (before the wait above)
            self._deliver(out)
            if stopping and not self._live and not self._waiting:
                return

    def _admit(self) -> None:
        while self._waiting and len(self._live) < self.info.max_batch_size:
            ticket = self._waiting[0]
            if self._reserved + ticket.reserved > self.info.num_blocks:
                return  # first come, first served: later jobs wait behind it
            self._waiting.popleft()
            with self._cond:
                self._waiting_count -= 1
            self._begin(ticket)

    def _begin(self, ticket: Ticket) -> None:
        import numpy as np

        og, job = self._og, ticket.job
        request = self._engine.create_request()
        options = og.TurnOptions(request)
        options.set_max_generated_tokens(job.max_tokens)
        if job.sampling.greedy:
            options.set_do_sample(False)
        else:
            options.set_do_sample(True)
            options.set_temperature(job.sampling.temperature)
            if job.sampling.top_p is not None:
                options.set_top_p(job.sampling.top_p)
            if job.sampling.top_k is not None:
                options.set_top_k(job.sampling.top_k)
            if job.sampling.seed is not None:
                options.set_seed(job.sampling.seed)
        ticket.turn = request.begin_turn(np.asarray(job.prompt, dtype=np.int32), options)
        ticket.request = request
        self._live[id(request)] = ticket
        self._reserved += ticket.reserved
        self._hold(ticket, len(job.prompt))

    def _hold(self, ticket: Ticket, tokens: int) -> None:
        held = ticket.blocks_for(tokens, self.info.block_size)
        self.held_blocks += held - ticket.held
        ticket.held = held

    def _cancel(self, ticket: Ticket, out: dict) -> None:
        if ticket.request is not None:
            if not ticket.cancel_requested and id(ticket.request) in self._live:
                ticket.cancel_requested = True
                ticket.request.cancel_turn(ticket.turn)  # og reports CANCELLED at its next run
            return
        try:
            self._waiting.remove(ticket)
        except ValueError:
            return  # finished already, or cancelled twice
        with self._cond:
            self._waiting_count -= 1
        self._emit(out, ticket, Finished("cancelled", len(ticket.job.prompt), 0))
        self.observe("finished:cancelled", 1)

    def _dispatch(self, done, out: dict) -> None:
        finished_flag = int(self._og.EngineEventFlags.TURN_FINISHED)
        failed_flag = int(self._og.EngineEventFlags.FAILED)
        now = time.perf_counter()
        for event in done:
            ticket = self._live.get(id(event.request)) if event.request is not None else None
            if ticket is None:
                continue  # CAPACITY_BLOCKED has no request; admission keeps it from lasting
            flags = int(event.flags)
            if event.token is not None:
                ticket.generated += 1
                self.observe(
                    "ttft" if ticket.generated == 1 else "itl", now - (ticket.last_token_at or ticket.submitted)
                )
                ticket.last_token_at = now
                self._hold(ticket, len(ticket.job.prompt) + ticket.generated)
                self._emit(out, ticket, Tokens((int(event.token),)))
            if flags & (finished_flag | failed_flag):
                self._finish(ticket, event, failed=bool(flags & failed_flag), out=out)

    def _finish(self, ticket: Ticket, event, *, failed: bool, out: dict) -> None:
        name = event.finish_reason.name
        reason = ticket.cancel_reason if name == "CANCELLED" else FINISH_REASONS.get(name, "error")
        if failed:
            reason = "error"
        usage = event.usage
        prompt = int(usage.prompt_tokens) if usage is not None else len(ticket.job.prompt)
        error = f"og.Engine: {event.error_code.name}" if reason == "error" else None
        self._emit(
            out,
            ticket,
            Finished(reason, prompt, ticket.generated, int(getattr(usage, "cached_prompt_tokens", 0) or 0), error),
        )
        self.observe("prompt_tokens", prompt)
        self.observe("generated_tokens", ticket.generated)
        self.observe(f"finished:{reason}", 1)
        self._reserved -= ticket.reserved
        self._hold(ticket, 0)
        del self._live[id(ticket.request)]
        ticket.request = None  # og closes it

    @staticmethod
    def _emit(out: dict, ticket: Ticket, event: Event) -> None:
        out.setdefault(ticket.loop, []).append((ticket.queue, event))

    @staticmethod
    def _deliver(out: dict) -> None:
        for loop, items in out.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                pass  # that event loop is closed: its responses are gone


def _put_all(items: list[tuple[asyncio.Queue, Event]]) -> None:
    for queue, event in items:
        queue.put_nowait(event)
