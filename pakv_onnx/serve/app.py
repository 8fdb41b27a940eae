"""The OpenAI-compatible FastAPI app over one :class:`~pakv_onnx.serve.engine.EngineLoop`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (plain JSON, or server-sent events with
``stream: true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``. Every response carries the
``x-pakv-replica`` header (which process answered: with ``--replicas`` each Ray Serve replica names
itself). With an API key, every ``/v1`` request without ``Authorization: Bearer KEY`` gets 401.

A request's life: the body is parsed and checked (:mod:`~pakv_onnx.serve.protocol`: 400 / 404 before
anything reaches og.Engine), submitted (429 when the queue is full, 503 while shutting down), then its
tokens arrive on an asyncio queue from the engine thread and become text through the folder's
tokenizer; stop strings end it early. A client that goes away cancels its job at once: og.Engine drops
it and its blocks at its next step (streaming: Starlette cancels the response's task on the
disconnect; plain: the handler polls for it).
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations (Request) at runtime.
import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

from pydantic import ValidationError

from pakv_onnx.serve import protocol
from pakv_onnx.serve.engine import EngineLoop, EngineStoppedError, Finished, QueueFullError, Ticket
from pakv_onnx.serve.metrics import CONTENT_TYPE, Metrics
from pakv_onnx.serve.text import Detokenizer, StopMatcher, TextCodec

REPLICA_HEADER = "x-pakv-replica"
DISCONNECT_POLL_SECONDS = 0.5  # how often a plain (non-streaming) response checks its client is there
FINISH_NAMES = {"cancelled": "abort"}  # engine reason -> OpenAI finish_reason where they differ


class ServeState:
    """What the app serves: the folder's engine, text codec and metrics, the key, the replica name."""

    def __init__(self, engine: EngineLoop, codec: TextCodec, metrics: Metrics, api_key: str | None, replica: str):
        self.engine, self.codec, self.metrics, self.api_key, self.replica = engine, codec, metrics, api_key, replica
        self.created = int(time.time())

    @property
    def info(self):
        return self.engine.info


def engine_gauges(engine: EngineLoop) -> dict[str, Callable[[], float]]:
    """The gauges /metrics reads from ``engine``."""
    return {
        "queue_depth": lambda: engine.queue_depth,
        "running_requests": lambda: engine.running,
        "pool_blocks_total": lambda: engine.info.num_blocks,
        "pool_blocks_free": lambda: engine.free_blocks,
        "pool_blocks_reserved": lambda: engine.reserved,
    }


class Guard:
    """ASGI middleware: the API key on ``/v1``, the replica header, requests counted by status.
    (Plain ASGI, not Starlette's BaseHTTPMiddleware, which would stand between a streaming response and
    the client's disconnect.)"""

    def __init__(self, app, state: ServeState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        api = scope["path"].startswith("/v1/")
        replica = (REPLICA_HEADER.encode(), self.state.replica.encode())

        async def send_counted(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), replica]
                if api:
                    self.state.metrics.count_request(message["status"])
            await send(message)

        key = self.state.api_key
        if api and key is not None:
            sent = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if sent != f"Bearer {key}":
                body = protocol.error_body(
                    "missing or wrong API key (Authorization: Bearer KEY)",
                    "authentication_error",
                    code="invalid_api_key",
                )
                await _send_json(send_counted, 401, body)
                return
        await self.app(scope, receive, send_counted)


async def _send_json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def build_app(state: ServeState):
    """The ASGI app (FastAPI inside :class:`Guard`) serving ``state``."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.get_running_loop().run_in_executor(None, state.engine.stop)

    app = FastAPI(title="pakv-onnx serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def error(status: int, message: str, kind: str = "invalid_request_error", param=None, code=None) -> JSONResponse:
        return JSONResponse(protocol.error_body(message, kind, param, code), status_code=status)

    async def parse(request: Request, model):
        raw = await request.body()
        try:
            return model.model_validate_json(raw or b"null")
        except ValidationError as err:
            if err.errors()[0]["type"] == "json_invalid":
                raise protocol.RequestError(f"the body is not valid JSON: {err.errors()[0]['msg']}") from None
            if err.errors()[0]["type"] == "model_type":
                raise protocol.RequestError("the body must be a JSON object") from None
            raise protocol.RequestError(*protocol.pydantic_message(err)) from None

    async def generate(request: Request, body_model, check, chat: bool):
        try:
            body = await parse(request, body_model)
            checked = check(body, state.codec, state.info, state.engine.max_request_length)
        except protocol.RequestError as err:
            kind = "invalid_request_error" if err.status == 400 else "not_found_error"
            return error(err.status, err.message, kind, err.param, err.code)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        try:
            ticket = state.engine.submit(checked.job, loop, queue)
        except QueueFullError as err:
            return error(429, f"the server is busy: {err}; retry later", "rate_limit_error", code="queue_full")
        except EngineStoppedError as err:
            return error(503, str(err), "server_error", code="shutting_down")
        reply = Reply(state, ticket, queue, checked, chat)
        if checked.stream:
            return StreamingResponse(
                reply.events(), media_type="text/event-stream", headers={"cache-control": "no-cache"}
            )
        result = await reply.collect(request)
        if result is None:
            return Response(status_code=499)  # the client left; nobody reads this
        if result.get("error"):
            return error(500, result["error"], "server_error")
        return JSONResponse(result)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, protocol.CompletionBody, protocol.check_completion, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, protocol.ChatBody, protocol.check_chat, chat=True)

    @app.get("/v1/models")
    async def models():
        info = state.info
        entry = {"id": info.name, "object": "model", "created": state.created, "owned_by": "pakv-onnx",
                 "max_model_len": state.engine.max_request_length}  # fmt: skip
        return {"object": "list", "data": [entry]}

    @app.get("/health")
    async def health():
        engine = state.engine
        return {"status": "ok", "model": state.info.name, "replica": state.replica, "running": engine.running,
                "queue_depth": engine.queue_depth, "free_blocks": engine.free_blocks}  # fmt: skip

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return Guard(app, state)


class Reply:
    """One request's tokens -> its response (plain JSON or server-sent events)."""

    def __init__(self, state: ServeState, ticket: Ticket, queue: asyncio.Queue, checked, chat: bool) -> None:
        self.state, self.ticket, self.queue, self.checked, self.chat = state, ticket, queue, checked, chat
        self.detokenizer = Detokenizer(state.codec)
        self.stops = StopMatcher(checked.stops)
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.completion_tokens = 0
        self.finish: Finished | None = None

    async def pieces(self) -> AsyncIterator[list[str]]:
        """The response's text, as the lists of pieces (one per token that completed some text) that
        had arrived each time this reader got to run: one engine step's worth when the event loop keeps
        up, several when it falls behind, so a stream then writes its socket once for all of them.
        Sets :attr:`finish`. Cancels the job when a stop string matches, or when the caller stops
        iterating (a client that left)."""
        done = False
        try:
            while True:
                batch: list[str] = []
                event = await self.queue.get()
                while True:
                    if isinstance(event, Finished):
                        done = True
                        self.finish = event
                        tail = self.stops.flush()
                        if tail:
                            batch.append(tail)
                        break
                    if self._feed(event, batch):
                        done = True
                        self.finish = Finished("stop", len(self.checked.job.prompt), self.completion_tokens)
                        self.state.engine.cancel(self.ticket, reason="stop")  # og frees its blocks at its next step
                        break
                    if self.queue.empty():
                        break
                    event = self.queue.get_nowait()
                if batch:
                    yield batch
                if done:
                    return
        finally:
            if not done:
                self.state.engine.cancel(self.ticket)

    def _feed(self, event, batch: list[str]) -> bool:
        """Append ``event``'s tokens' text to ``batch``; whether a stop string matched."""
        for token in event.ids:
            self.completion_tokens += 1
            text = self.stops.feed(self.detokenizer.add(token))
            if text:
                batch.append(text)
            if self.stops.stopped:
                return True
        return False

    def usage(self) -> dict:
        prompt = len(self.checked.job.prompt)
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens}  # fmt: skip

    def finish_reason(self) -> str:
        reason = self.finish.reason if self.finish else "cancelled"
        return FINISH_NAMES.get(reason, reason)

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.state.info.name}

    async def collect(self, request) -> dict | None:
        """The whole response (``None`` if the client left first)."""
        parts: list[str] = []
        pieces = self.pieces()
        try:
            while True:
                step = asyncio.ensure_future(pieces.__anext__())
                while True:
                    done, _ = await asyncio.wait({step}, timeout=DISCONNECT_POLL_SECONDS)
                    if done:
                        break
                    if await request.is_disconnected():
                        step.cancel()  # the job is cancelled in pieces()'s finally
                        await asyncio.gather(step, return_exceptions=True)
                        return None
                try:
                    parts += step.result()
                except StopAsyncIteration:
                    break
        finally:
            await pieces.aclose()
        if self.finish is not None and self.finish.reason == "error":
            return {"error": self.finish.error or "og.Engine failed this request"}
        text = "".join(parts)
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": self.finish_reason(),
            }
        else:
            choice = {"index": 0, "text": text, "finish_reason": self.finish_reason(), "logprobs": None}
        return {**self._head(False), "choices": [choice], "usage": self.usage()}

    def _chunk(self, text: str | None, finish: str | None, first: bool = False) -> str:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        return f"data: {json.dumps({**self._head(True), 'choices': [choice]})}\n\n"

    def _text_chunk_template(self) -> tuple[str, str]:
        """The text before and after the JSON string of a text chunk (:meth:`_chunk`'s, split where
        the text goes): a token's event is then one ``json.dumps`` of its text, not of the chunk."""
        marker = "\u0000pakv-text\u0000"
        before, _, after = self._chunk(marker, None).partition(json.dumps(marker))
        return before, after

    async def events(self) -> AsyncIterator[str]:
        """Server-sent events: ``data: {chunk}`` per piece, a last chunk with ``finish_reason``, a usage
        chunk when ``stream_options.include_usage``, then ``data: [DONE]``."""
        if self.chat:
            yield self._chunk(None, None, first=True)
        before, after = self._text_chunk_template()
        pieces = self.pieces()
        try:
            async for batch in pieces:  # one socket write for every token's event that has arrived
                yield "".join(f"{before}{json.dumps(text)}{after}" for text in batch)
        finally:
            await pieces.aclose()
        if self.finish is not None and self.finish.reason == "error":
            body = protocol.error_body(self.finish.error or "og.Engine failed this request", "server_error")
            yield f"data: {json.dumps(body)}\n\n"
        else:
            yield self._chunk(None, self.finish_reason())
        if self.checked.include_usage:
            yield f"data: {json.dumps({**self._head(True), 'choices': [], 'usage': self.usage()})}\n\n"
        yield "data: [DONE]\n\n"
