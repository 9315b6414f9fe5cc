"""The native API: `POST /generate` (JSON or SSE) and `GET /adapters`, for clients that want loramux's
own shape: `prompt` or `messages`, `adapter_id` (a name, `ad_<id>`, `owner/name`, `@<version>`), every
sampling control, timings in the body."""
from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import AliasChoices, Field, model_validator

from loramux.engine.outputs import RequestOutput
from loramux.server.deps import PipelineDep, ServicesDep, TenantDep
from loramux.server.http.sse import DONE, STREAMED, sse_event
from loramux.server.intake.body_prechecks import PrecheckedRoute
from loramux.server.intake.generation import Intake, RouteDefaults
from loramux.server.intake.params import ChatMessage, GenerationParams
from loramux.server.intake.prompts import Prompt
from loramux.server.intake.response_format import MAX_CHOICES, ResponseFormat, from_native
from loramux.server.intake.tags import TAGS_HEADER, request_tags
from loramux.server.intake.tool_calls import template_messages
from loramux.server.routes.responses import respond
from loramux.server.serving.running import Running

router = APIRouter(tags=["native"], route_class=PrecheckedRoute)

DEFAULTS = RouteDefaults("gen", max_tokens=256, temperature=0.0)  # greedy unless asked otherwise


class GenerateRequest(GenerationParams):
    """Either `prompt` (raw text, no template) or `messages` (chat template applied); `adapter_id` names
    an adapter the tenant may use (omit it, or give "base", for the base model)."""

    prompt: str | None = None
    adapter_id: str | None = Field(default=None, validation_alias=AliasChoices("adapter_id", "adapter"))
    messages: list[ChatMessage] | None = None
    # At most one output constraint (400 for two); see loramux.server.intake.response_format.
    response_format: ResponseFormat | None = None
    regex: str | None = Field(default=None, max_length=10_000, description="the output matches this regular "
                              "expression in full")
    choice: list[str] | None = Field(default=None, max_length=MAX_CHOICES,
                                     description="the output is exactly one of these strings")

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` or `messages`")
        if self.prompt is not None and not self.prompt:
            raise ValueError("`prompt` must not be empty")
        return self


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
        "adapter_tier": running.adapter_level,  # the field keeps its published name
        "fallback": running.extension(out).get("fallback"),
        "composition": running.composition.extension() if running.composition is not None else None,
        **(running.spend.extension() if running.spend is not None else {}),  # cost, budgets
    }


@router.get("/adapters")
async def adapters(services: ServicesDep, tenant: TenantDep) -> dict:
    listed = await run_in_threadpool(services.registry.list, tenant.tenant_id)
    return {"adapters": [{"id": v.adapter_id, "name": v.name, "version": v.version, "rank": v.rank,
                          "targets": list(v.target_modules), "digest": v.digest, "visibility": v.visibility,
                          "own": v.tenant_id == tenant.tenant_id} for v in listed]}


@router.post("/generate", responses=STREAMED)
async def generate(body: GenerateRequest, request: Request, tenant: TenantDep, pipeline: PipelineDep):
    arrival = time.monotonic()
    # Tokenized once admitted (see RequestPipeline.start_generation).
    prompt = (Prompt(text=body.prompt) if body.prompt is not None
              else Prompt(messages=template_messages(body.messages, native=False)))
    structured = from_native(body.response_format, body.regex, body.choice)
    running = await pipeline.start_generation(tenant, Intake(
        body.adapter_id, prompt, body, arrival, DEFAULTS, max_tokens=body.max_tokens,
        sampling={"structured": structured}, constraints=[(structured, None)],
        tags=request_tags(request.headers.get(TAGS_HEADER), body.metadata)))

    def final(outs: list[RequestOutput]) -> JSONResponse:
        return JSONResponse(_final_body(running, outs[0]), headers=running.headers())

    async def events():
        last = None
        async for out in running.outputs():
            last = out
            if out.delta_text:
                yield sse_event({"id": running.request_id, "text": out.delta_text})
        yield sse_event(_final_body(running, last))
        yield DONE

    return await respond(request, running, stream=body.stream, final=final, events=events)
