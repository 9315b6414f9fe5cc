"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions.

`model` is the base model's id (or "base") or an adapter the tenant may use: its name, `ad_<id>`, or
`owner/name` for another tenant's public adapter, optionally `@<version>`. Responses follow OpenAI's
shapes; loramux's extras (queue_ms, ttft_ms, tokens_per_s, adapter version and cache tier, fallback)
are in the `loramux` field and in `X-Loramux-*` headers. Extra request parameters: see
`loramux.server.params.GenerationParams`.
"""
from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import Field

from loramux.engine.engine import RequestOutput
from loramux.server.bodies import RequestBody
from loramux.server.deps import ServerDep, ServicesDep, TenantDep
from loramux.server.errors import ApiError
from loramux.server.params import ChatMessage, GenerationParams
from loramux.server.prompts import Prompt
from loramux.server.serving import Running, respond
from loramux.server.sse import DONE, STREAMED, sse_event

router = APIRouter(prefix="/v1", tags=["openai"])

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default
CHAT_DEFAULT_MAX_TOKENS = 1024  # when the client gives none (capped by the room left in the context)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class StreamOptions(RequestBody):
    include_usage: bool = False


class OpenAIParams(GenerationParams):
    model: str = Field(min_length=1, max_length=300)
    n: int = Field(default=1, ge=1, le=1, description="only n=1 is supported")
    stream_options: StreamOptions | None = None
    user: str | None = None


class ChatCompletionRequest(OpenAIParams):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None


class CompletionRequest(OpenAIParams):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None


def _unsupported(what: str) -> ApiError:
    return ApiError(400, f"{what} is not supported by this server", code="unsupported_parameter")


def _finish_reason(out: RequestOutput | None) -> str:
    return (out.finish_reason if out is not None else None) or "cancelled"


def _usage(running: Running, out: RequestOutput) -> dict:
    completion = len(out.token_ids)
    return {"prompt_tokens": running.prompt_tokens, "completion_tokens": completion,
            "total_tokens": running.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


def _final_json(running: Running, out: RequestOutput, body: dict) -> JSONResponse:
    """A non-streamed answer: OpenAI's fields + usage + the loramux extension, with the timing headers."""
    return JSONResponse({"id": running.request_id, "created": int(time.time()), **body, "usage": _usage(running, out),
                         "system_fingerprint": None, "loramux": running.extension(out)},
                        headers={**running.headers(), **_timing_headers(out)})


@router.get("/models")
async def list_models(services: ServicesDep, tenant: TenantDep, server: ServerDep) -> dict:
    """The base model and every adapter this tenant may use (its own, then other tenants' public ones)."""
    versions = await run_in_threadpool(services.registry.list, tenant.tenant_id)
    owners = {}
    for v in versions:
        if v.tenant_id != tenant.tenant_id and v.tenant_id not in owners:
            owners[v.tenant_id] = (await run_in_threadpool(services.tenancy.tenant, v.tenant_id)).name
    data = [{"id": server.model_id, "object": "model", "created": 0, "owned_by": "loramux"}]
    data += [{"id": v.name if v.tenant_id == tenant.tenant_id else f"{owners[v.tenant_id]}/{v.name}",
              "object": "model", "created": int(v.created_at.timestamp()),
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
    engine = services.engine
    prompt = Prompt(messages=[m.as_template_message() for m in body.messages])  # tokenized once admitted
    running = await server.start_generation(
        tenant, body.model, prompt, body, arrival, id_prefix="chatcmpl",
        max_tokens=body.max_completion_tokens or body.max_tokens, default_max_tokens=CHAT_DEFAULT_MAX_TOKENS,
        default_temperature=DEFAULT_TEMPERATURE)

    def final(out: RequestOutput) -> JSONResponse:
        logprobs = {"content": _logprob_entries(engine, out.token_ids, out.logprobs)} if body.logprobs else None
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": logprobs,
                  "finish_reason": _finish_reason(out)}
        return _final_json(running, out, {"object": "chat.completion", "model": body.model, "choices": [choice]})

    async def events():
        base = {"id": running.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": body.model}
        yield sse_event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}]})
        last = None
        async for out in running.outputs():
            last = out
            if out.delta_text or (body.logprobs and out.new_token_ids):
                lp = ({"content": _logprob_entries(engine, out.new_token_ids, out.new_logprobs)}
                      if body.logprobs and out.new_token_ids else None)
                yield sse_event({**base, "choices": [{"index": 0, "delta": {"content": out.delta_text},
                                                      "logprobs": lp, "finish_reason": None}]})
        yield sse_event({**base, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                              "finish_reason": _finish_reason(last)}],
                         "usage": _usage(running, last), "loramux": running.extension(last)})
        if body.stream_options and body.stream_options.include_usage:
            yield sse_event({**base, "choices": [], "usage": _usage(running, last)})
        yield DONE

    return await respond(request, running, stream=body.stream, final=final, events=events)


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
            raise ApiError(400, "batched prompts are not supported: send one prompt per request")
        prompt = prompt[0]
    if not prompt:
        raise ApiError(400, "prompt must not be empty")
    engine = services.engine
    prompt = Prompt(text=prompt) if isinstance(prompt, str) else Prompt(token_ids=list(prompt))
    want_logprobs = body.logprobs is not None
    running = await server.start_generation(
        tenant, body.model, prompt, body, arrival, id_prefix="cmpl", max_tokens=body.max_tokens,
        default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS, default_temperature=DEFAULT_TEMPERATURE)

    def final(out: RequestOutput) -> JSONResponse:
        choice = {"index": 0, "text": out.text, "finish_reason": _finish_reason(out),
                  "logprobs": _completion_logprobs(engine, out.token_ids, out.logprobs) if want_logprobs else None}
        return _final_json(running, out, {"object": "text_completion", "model": body.model, "choices": [choice]})

    async def events():
        base = {"id": running.request_id, "object": "text_completion", "created": int(time.time()),
                "model": body.model}
        last = None
        async for out in running.outputs():
            last = out
            if out.delta_text:
                lp = (_completion_logprobs(engine, out.new_token_ids, out.new_logprobs)
                      if want_logprobs and out.new_token_ids else None)
                yield sse_event({**base, "choices": [{"index": 0, "text": out.delta_text, "logprobs": lp,
                                                      "finish_reason": None}]})
        yield sse_event({**base, "choices": [{"index": 0, "text": "", "logprobs": None,
                                              "finish_reason": _finish_reason(last)}],
                         "usage": _usage(running, last), "loramux": running.extension(last)})
        yield DONE

    return await respond(request, running, stream=body.stream, final=final, events=events)


def _timing_headers(out: RequestOutput) -> dict[str, str]:
    t = out.timings
    named = (("X-Loramux-Queue-Ms", "queue_ms"), ("X-Loramux-TTFT-Ms", "ttft_ms"), ("X-Loramux-Total-Ms", "total_ms"))
    return {header: f"{t[key]:.1f}" for header, key in named if t.get(key) is not None}


def _logprob_entries(engine, ids: list[int], logprobs: list[float]) -> list[dict]:
    return [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(engine.token_texts(ids), logprobs)]


def _completion_logprobs(engine, ids: list[int], logprobs: list[float]) -> dict:
    texts = engine.token_texts(ids)
    offsets, pos = [], 0
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": texts, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": offsets}
