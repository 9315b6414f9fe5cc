"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions.

`model` is the base model's id (or "base") or an adapter the tenant may use: its name, `ad_<id>`, or
`owner/name` for another tenant's public adapter, optionally `@<version>`. Responses follow OpenAI's
shapes; loramux's extras (queue_ms, ttft_ms, tokens_per_s, adapter version and cache tier, fallback)
are in the `loramux` field and in `X-Loramux-*` headers. Extra request parameters: top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, timeout_s.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import Field, field_validator

from loramux.engine.engine import RequestOutput
from loramux.engine.sampling_params import SamplingParams
from loramux.server.bodies import RequestBody
from loramux.server.deps import ServerDep, ServicesDep, TenantDep
from loramux.server.serving import Running, RunningStreamingResponse, ServeError, collect_or_cancel

router = APIRouter(prefix="/v1", tags=["openai"])

MAX_STOP = 16


# A route that can stream documents the server-sent-event media type next to its JSON body.
STREAMED = {200: {"description": "The result: JSON, or a stream of server-sent events with `stream: true`",
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


class TextPart(RequestBody):
    type: Literal["text"]
    text: str


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(RequestBody):
    include_usage: bool = False


class SamplingFields(RequestBody):
    """Parameters shared by chat and completions (OpenAI's, then loramux's extras)."""

    model: str = Field(min_length=1, max_length=300)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=1, description="only n=1 is supported")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # loramux extras
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    timeout_s: float | None = Field(default=None, gt=0, le=86_400)
    speculative: bool = Field(default=True, description="allow prompt-lookup speculation (same outputs)")

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    def sampling_params(self, max_tokens: int, logprobs: bool) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens, min_tokens=min(self.min_tokens, max_tokens), temperature=self.temperature,
                top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, seed=self.seed,
                stop=self.stop or [], ignore_eos=self.ignore_eos, timeout_s=self.timeout_s,
                speculative=self.speculative)
        except ValueError as exc:
            raise ServeError(400, str(exc)) from None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None


def _unsupported(what: str) -> ServeError:
    return ServeError(400, f"{what} is not supported by this server", code="unsupported_parameter")


def _finish_reason(out: RequestOutput | None) -> str:
    return (out.finish_reason if out is not None else None) or "cancelled"


def _usage(running: Running, out: RequestOutput) -> dict:
    completion = len(out.token_ids)
    return {"prompt_tokens": running.prompt_tokens, "completion_tokens": completion,
            "total_tokens": running.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _tokenize_chat(services, body: ChatCompletionRequest) -> list[int]:
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    try:
        return await run_in_threadpool(services.engine.engine.encode_chat, messages)
    except Exception as exc:  # jinja TemplateError and friends: the messages do not fit the template
        raise ServeError(400, f"messages do not fit the model's chat template: {exc}") from None


def _max_tokens(services, asked: int | None, prompt_len: int, default_cap: int = 1024) -> int:
    room = services.engine.engine.max_model_len - prompt_len
    if room < 1:
        raise ServeError(400, f"the prompt has {prompt_len} tokens; this model accepts at most "
                              f"{services.engine.engine.max_model_len - 1} prompt tokens", code="context_length_exceeded")
    if asked is None:
        return min(default_cap, room)
    if asked > room:
        raise ServeError(400, f"max_tokens {asked} + the prompt's {prompt_len} tokens exceed the context length "
                              f"{services.engine.engine.max_model_len}; lower max_tokens to {room} or less",
                         code="context_length_exceeded")
    return asked


def _token_texts(services, ids: list[int]) -> list[str]:
    tok = services.engine.engine.tokenizer
    return [tok.decode([i]) for i in ids]


@router.get("/models")
async def list_models(services: ServicesDep, tenant: TenantDep, server: ServerDep) -> dict:
    """The base model and every adapter this tenant may use (its own, then other tenants' public ones)."""
    versions = await run_in_threadpool(services.registry.list, tenant.tenant_id)
    names = {}
    if versions:
        owners = {}
        for v in versions:
            if v.tenant_id != tenant.tenant_id and v.tenant_id not in owners:
                owners[v.tenant_id] = (await run_in_threadpool(services.registry.get_tenant, v.tenant_id)).name
        names = {v.adapter_id: v.name if v.tenant_id == tenant.tenant_id else f"{owners[v.tenant_id]}/{v.name}"
                 for v in versions}
    data = [{"id": server.model_id, "object": "model", "created": 0, "owned_by": "loramux"}]
    data += [{"id": names[v.adapter_id], "object": "model", "created": int(v.created_at.timestamp()),
              "owned_by": "you" if v.tenant_id == tenant.tenant_id else "public", "parent": server.model_id,
              "loramux": {"adapter_id": v.adapter_id, "version": v.version, "rank": v.rank,
                          "target_modules": list(v.target_modules)}} for v in versions]
    return {"object": "list", "data": data}


@router.post("/chat/completions", responses=STREAMED)
async def chat_completions(body: ChatCompletionRequest, request: Request, services: ServicesDep, tenant: TenantDep,
                           server: ServerDep):
    arrival = time.monotonic()
    if body.tools or body.tool_choice not in (None, "none"):
        raise _unsupported("tool calling")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise _unsupported(f"response_format {body.response_format.get('type')!r}")
    if body.top_logprobs:
        raise _unsupported("top_logprobs > 0 (only the chosen tokens' logprobs are returned)")
    prompt_ids = await _tokenize_chat(services, body)
    max_tokens = _max_tokens(services, body.max_completion_tokens or body.max_tokens, len(prompt_ids))
    params = body.sampling_params(max_tokens, body.logprobs)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    running = await server.start(tenant, body.model, prompt_ids, params, request_id, arrival)
    created = int(time.time())
    model_name = body.model

    if not body.stream:
        out = await collect_or_cancel(request, running)
        if out is None:
            return JSONResponse({"error": {"message": "client disconnected", "type": "cancelled"}}, status_code=499)
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                  "logprobs": _chat_logprobs(services, out) if body.logprobs else None,
                  "finish_reason": _finish_reason(out)}
        return JSONResponse({"id": request_id, "object": "chat.completion", "created": created, "model": model_name,
                             "choices": [choice], "usage": _usage(running, out), "system_fingerprint": None,
                             "loramux": running.extension(out)},
                            headers={**running.headers(), **_timing_headers(out)})

    async def events():
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model_name}
        yield _sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]})
        last = None
        async for out in running.outputs():
            last = out
            if out.delta_text or (body.logprobs and out.new_token_ids):
                lp = ({"content": _logprob_entries(services, out.new_token_ids, out.logprobs[-len(out.new_token_ids):])}
                      if body.logprobs and out.new_token_ids else None)
                yield _sse({**base, "choices": [{"index": 0, "delta": {"content": out.delta_text}, "logprobs": lp,
                                                 "finish_reason": None}]})
        yield _sse({**base, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                         "finish_reason": _finish_reason(last)}],
                    "usage": _usage(running, last), "loramux": running.extension(last)})
        if body.stream_options and body.stream_options.include_usage:
            yield _sse({**base, "choices": [], "usage": _usage(running, last)})
        yield _sse("[DONE]")

    return RunningStreamingResponse(_guarded(events(), running), running, media_type="text/event-stream",
                                    headers=running.headers())


@router.post("/completions", responses=STREAMED)
async def completions(body: CompletionRequest, request: Request, services: ServicesDep, tenant: TenantDep,
                      server: ServerDep):
    arrival = time.monotonic()
    if body.echo:
        raise _unsupported("echo")
    if body.suffix:
        raise _unsupported("suffix")
    if body.logprobs:
        raise _unsupported("logprobs > 0 (use logprobs: 0 for the chosen tokens' logprobs)")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ServeError(400, "batched prompts are not supported: send one prompt per request")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ServeError(400, "prompt must not be empty")
        prompt_ids = await run_in_threadpool(services.engine.engine.tokenizer.encode, prompt)
    else:
        prompt_ids = list(prompt)
        if not prompt_ids:
            raise ServeError(400, "prompt must not be empty")
    max_tokens = _max_tokens(services, body.max_tokens, len(prompt_ids))
    want_logprobs = body.logprobs is not None
    params = body.sampling_params(max_tokens, want_logprobs)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    running = await server.start(tenant, body.model, prompt_ids, params, request_id, arrival)
    created = int(time.time())

    if not body.stream:
        out = await collect_or_cancel(request, running)
        if out is None:
            return JSONResponse({"error": {"message": "client disconnected", "type": "cancelled"}}, status_code=499)
        choice = {"index": 0, "text": out.text, "finish_reason": _finish_reason(out),
                  "logprobs": _completion_logprobs(services, out.token_ids, out.logprobs) if want_logprobs else None}
        return JSONResponse({"id": request_id, "object": "text_completion", "created": created, "model": body.model,
                             "choices": [choice], "usage": _usage(running, out), "system_fingerprint": None,
                             "loramux": running.extension(out)},
                            headers={**running.headers(), **_timing_headers(out)})

    async def events():
        base = {"id": request_id, "object": "text_completion", "created": created, "model": body.model}
        last = None
        async for out in running.outputs():
            last = out
            if out.delta_text:
                lp = (_completion_logprobs(services, out.new_token_ids, out.logprobs[-len(out.new_token_ids):])
                      if want_logprobs and out.new_token_ids else None)
                yield _sse({**base, "choices": [{"index": 0, "text": out.delta_text, "logprobs": lp,
                                                 "finish_reason": None}]})
        yield _sse({**base, "choices": [{"index": 0, "text": "", "logprobs": None,
                                         "finish_reason": _finish_reason(last)}],
                    "usage": _usage(running, last), "loramux": running.extension(last)})
        yield _sse("[DONE]")

    return RunningStreamingResponse(_guarded(events(), running), running, media_type="text/event-stream",
                                    headers=running.headers())


async def _guarded(events, running: Running):
    """Stream `events`; once headers are out, a failure becomes a final error event. A client that goes
    away closes this generator, which cancels the request in the engine."""
    try:
        async for event in events:
            yield event
    except Exception as exc:  # noqa: BLE001
        yield _sse({"error": {"message": str(exc) or type(exc).__name__, "type": "server_error"}})
    finally:
        await events.aclose()  # RunningStreamingResponse then ends the request if it has not ended


def _timing_headers(out: RequestOutput) -> dict[str, str]:
    t = out.timings
    return {k: f"{v:.1f}" for k, v in (("X-Loramux-Queue-Ms", t.get("queue_ms")), ("X-Loramux-TTFT-Ms", t.get("ttft_ms")),
                                       ("X-Loramux-Total-Ms", t.get("total_ms"))) if v is not None}


def _logprob_entries(services, ids: list[int], logprobs: list[float]) -> list[dict]:
    texts = _token_texts(services, ids)
    return [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(texts, logprobs)]


def _chat_logprobs(services, out: RequestOutput) -> dict:
    return {"content": _logprob_entries(services, out.token_ids, out.logprobs)}


def _completion_logprobs(services, ids: list[int], logprobs: list[float]) -> dict:
    texts = _token_texts(services, ids)
    offsets, pos = [], 0
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": texts, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": offsets}


def openai_error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 413: "invalid_request_error", 422: "invalid_request_error",
            429: "rate_limit_error", 503: "service_unavailable"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}

