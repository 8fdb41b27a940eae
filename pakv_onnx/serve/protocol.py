"""The OpenAI request bodies the server takes, and their checks into engine jobs.

Bodies are pydantic models that forbid unknown fields and take JSON types strictly (``"16"`` is not a
``max_tokens``, ``true`` is not a token id). Everything a request can get wrong raises
:class:`RequestError` with the OpenAI error body's ``message`` and ``param``; the app answers it with
HTTP 400 (404 for an unknown model) before anything reaches og.Engine.

Only what og.Engine serves is accepted: one choice (``n`` 1), no logprobs or penalties; sampling
``temperature`` (0: greedy, og's top logit), ``top_p``, ``top_k`` and ``seed``; ``stop`` strings
(matched on the server's text); ``max_tokens`` (16 when not given, as OpenAI's completions).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pakv_onnx.serve.engine import Job, Sampling, reserved_blocks
from pakv_onnx.serve.folder import FolderInfo
from pakv_onnx.serve.text import ChatTemplateError, TextCodec

DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_SEED = 2**63 - 1


class RequestError(ValueError):
    """A request the server refuses: ``message`` and ``param`` of the OpenAI error body, and the
    HTTP status (400, or 404 for an unknown model)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None):
    """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _Generation(_Body):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    user: str | None = None


class CompletionBody(_Generation):
    prompt: str | list[int]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart]
    name: str | None = None


class ChatBody(_Generation):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


@dataclasses.dataclass(frozen=True)
class Checked:
    """A request the server will run: its job, stop strings and stream settings."""

    job: Job
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool


def pydantic_message(err) -> tuple[str, str | None]:
    """``(message, param)`` of a pydantic ValidationError's first error: the field path and why."""
    first = err.errors()[0]
    path = ".".join(str(p) for p in first["loc"] if not str(p).startswith(("function-", "list[", "str", "int")))
    if first["type"] == "extra_forbidden":
        return f"unknown or unsupported field {path!r} (this server takes: see docs/serve.md)", path
    if first["type"] == "missing":
        return f"missing required field {path!r}", path
    given = first.get("input")
    shown = repr(given) if not isinstance(given, (dict, list)) or len(repr(given)) < 80 else type(given).__name__
    return f"{path}: {first['msg']} (got {shown})", path or None


def check_model(body: _Generation, info: FolderInfo) -> None:
    if body.model is not None and body.model != info.name:
        raise RequestError(
            f"the model {body.model!r} does not exist here; this server serves {info.name!r}",
            "model",
            404,
            "model_not_found",
        )


def check_prompt(ids: list[int], info: FolderInfo, param: str) -> tuple[int, ...]:
    if not ids:
        raise RequestError(f"{param} is empty (want at least one token)", param)
    bad = next((t for t in ids if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise RequestError(f"{param}: token id {bad} is outside the vocabulary (0..{info.vocab_size - 1})", param)
    return tuple(ids)


def check_budget(prompt: int, max_tokens: int, info: FolderInfo, max_request_length: int, param: str) -> None:
    """``prompt + max_tokens`` must fit og.Engine's request length (the context, and the pool: one
    request may hold every block) and its blocks the pool."""
    if (
        prompt + max_tokens > max_request_length
        or reserved_blocks(prompt, max_tokens, info.block_size) > info.num_blocks
    ):
        raise RequestError(
            f"{param} {max_tokens} with a prompt of {prompt} tokens needs {prompt + max_tokens} tokens; this server "
            f"serves at most {max_request_length} per request (context_length {info.context_length}, pool "
            f"{info.num_blocks} blocks x {info.block_size} tokens)",
            param,
        )


def check_common(
    body: _Generation, prompt: tuple[int, ...], max_tokens: int | None, param: str, info, limit
) -> Checked:
    tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    check_budget(len(prompt), tokens, info, limit, param if max_tokens is not None else "max_tokens")
    stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise RequestError("stop: a stop string is empty", "stop")
    if body.stream_options is not None and not body.stream:
        raise RequestError("stream_options is only allowed with stream: true", "stream_options")
    sampling = Sampling(body.temperature, body.top_p, body.top_k, body.seed)
    return Checked(
        Job(prompt, tokens, sampling),
        stops,
        body.stream,
        bool(body.stream_options and body.stream_options.include_usage),
    )


def check_completion(body: CompletionBody, codec: TextCodec, info: FolderInfo, limit: int) -> Checked:
    """The job of a ``/v1/completions`` body (``prompt``: text, or token ids)."""
    check_model(body, info)
    if isinstance(body.prompt, str):
        if not body.prompt:
            raise RequestError("prompt is empty (want text or a list of token ids)", "prompt")
        ids = codec.encode(body.prompt)
    else:
        ids = body.prompt
    return check_common(body, check_prompt(ids, info, "prompt"), body.max_tokens, "max_tokens", info, limit)


def check_chat(body: ChatBody, codec: TextCodec, info: FolderInfo, limit: int) -> Checked:
    """The job of a ``/v1/chat/completions`` body: the folder's chat template over ``messages``."""
    check_model(body, info)
    messages = [
        {"role": m.role, "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)}
        for m in body.messages
    ]
    try:
        text = codec.chat_prompt(messages)
    except ChatTemplateError as err:
        raise RequestError(str(err), "messages") from None
    prompt = check_prompt(codec.encode(text, special=False), info, "messages")
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise RequestError("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    max_tokens, param = (
        (body.max_completion_tokens, "max_completion_tokens")
        if body.max_completion_tokens is not None
        else (body.max_tokens, "max_tokens")
    )
    return check_common(body, prompt, max_tokens, param, info, limit)
