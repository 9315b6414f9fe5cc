"""The native API: `POST /generate` (JSON or SSE) and `GET /adapters`, for clients that want loramux's
own shape: `prompt` or `messages`, `adapter_id` (a name, `ad_<id>`, `owner/name`, `@<version>`), every
sampling control, timings in the body."""
from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import AliasChoices, Field, model_validator

from loramux.engine.engine import RequestOutput
from loramux.engine.sampling_params import SamplingParams
from loramux.server.deps import ServerDep, ServicesDep, TenantDep
from loramux.server.bodies import RequestBody
from loramux.server.openai_api import STREAMED
from loramux.server.serving import Running, RunningStreamingResponse, ServeError, collect_or_cancel

router = APIRouter(tags=["native"])


class Message(RequestBody):
    role: str = Field(pattern="^(system|user|assistant)$")
    content: str


class GenerateRequest(RequestBody):
    """Either `prompt` (raw text, no template) or `messages` (chat template applied); `adapter_id` names
    an adapter the tenant may use (omit it, or give "base", for the base model)."""

    prompt: str | None = None
    adapter_id: str | None = Field(default=None, validation_alias=AliasChoices("adapter_id", "adapter"))
    messages: list[Message] | None = None
    max_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: list[str] | str | None = None
    timeout_s: float | None = Field(default=None, gt=0, le=86_400)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    speculative: bool = True
    stream: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` or `messages`")
        if self.prompt is not None and not self.prompt:
            raise ValueError("`prompt` must not be empty")
        return self

    def sampling_params(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                                  top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                                  presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                                  seed=self.seed, stop=stop, timeout_s=self.timeout_s, min_tokens=self.min_tokens,
                                  ignore_eos=self.ignore_eos, speculative=self.speculative)
        except ValueError as exc:
            raise ServeError(400, str(exc)) from None


def _final_body(running: Running, out: RequestOutput) -> dict:
    version = running.version
    return {
        "id": running.request_id,
        "text": out.text,
        "finish_reason": out.finish_reason,
        "usage": {"prompt_tokens": running.prompt_tokens, "cached_tokens": out.num_cached_tokens,
                  "completion_tokens": len(out.token_ids),
                  "total_tokens": running.prompt_tokens + len(out.token_ids)},
        "timings": out.timings,
        "adapter": version.name if version else None,
        "adapter_id": version.adapter_id if version else None,
        "adapter_version": version.version if version else None,
        "adapter_tier": running.adapter_tier,
        "fallback": running.extension(out).get("fallback"),
    }


@router.get("/adapters")
async def adapters(services: ServicesDep, tenant: TenantDep) -> dict:
    listed = await run_in_threadpool(services.registry.list, tenant.tenant_id)
    return {"adapters": [{"id": v.adapter_id, "name": v.name, "version": v.version, "rank": v.rank,
                          "targets": list(v.target_modules), "digest": v.digest, "visibility": v.visibility,
                          "own": v.tenant_id == tenant.tenant_id} for v in listed]}


@router.post("/generate", responses=STREAMED)
async def generate(body: GenerateRequest, request: Request, services: ServicesDep, tenant: TenantDep,
                   server: ServerDep):
    arrival = time.monotonic()
    params = body.sampling_params()
    engine = services.engine.engine
    try:
        if body.prompt is not None:
            prompt_ids = await run_in_threadpool(engine.tokenizer.encode, body.prompt)
        else:
            prompt_ids = await run_in_threadpool(engine.encode_chat, [m.model_dump() for m in body.messages])
    except Exception as exc:  # jinja TemplateError and friends: the messages do not fit the template
        raise ServeError(400, f"messages do not fit the model's chat template: {exc}") from None
    running = await server.start(tenant, body.adapter_id, prompt_ids, params, f"gen-{uuid.uuid4().hex}", arrival)

    if not body.stream:
        out = await collect_or_cancel(request, running)
        if out is None:
            return JSONResponse({"error": {"message": "client disconnected", "type": "cancelled"}}, status_code=499)
        return JSONResponse(_final_body(running, out), headers=running.headers())

    async def events():
        last = None
        try:
            async for out in running.outputs():
                last = out
                if out.delta_text:
                    yield f"data: {json.dumps({'id': running.request_id, 'text': out.delta_text})}\n\n"
            yield f"data: {json.dumps(_final_body(running, last))}\n\n"
            yield "data: [DONE]\n\n"
        except Exception as exc:  # noqa: BLE001 - the headers are sent: report the failure as a final event
            yield f"data: {json.dumps({'id': running.request_id, 'error': str(exc) or type(exc).__name__})}\n\n"

    return RunningStreamingResponse(events(), running, media_type="text/event-stream", headers=running.headers())
