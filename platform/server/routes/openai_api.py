"""OpenAI-compatible routes: /v1/models, /v1/chat/completions (`loramux.server.routes.openai_chat`),
/v1/completions (`loramux.server.routes.openai_completions`).

`model` is the base model's id (or "base") or an adapter the tenant may use: its name, `ad_<id>`, or
`owner/name` for another tenant's public adapter, optionally `@<version>`. Responses follow OpenAI's
shapes; loramux's extras (queue_ms, ttft_ms, tokens_per_s, adapter version and cache level, fallback)
are in the `loramux` field and in `X-Loramux-*` headers. Extra request parameters: see
`loramux.server.intake.params.GenerationParams`. What OpenAI has and this server does not (legacy functions,
audio, images, suffix, batched prompts, best_of) is refused with 400, never silently ignored.
"""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool

from loramux.adapters.residency.cache_levels import adapter_reference
from loramux.server.deps import PipelineDep, ServicesDep, TenantDep
from loramux.server.routes import openai_chat, openai_completions

router = APIRouter(prefix="/v1", tags=["openai"])


@router.get("/models")
async def list_models(services: ServicesDep, tenant: TenantDep, pipeline: PipelineDep) -> dict:
    """The base model and every adapter this tenant may use (its own, then other tenants' public ones), in vLLM's
    model card shape: an adapter's `parent` is the base model, its `root` the reference `ad_<id>@<version>` that
    the metrics routers read (`vllm:lora_requests_info`, `vllm:lora_adapter_loaded`) name it by, also a valid
    `model`; `max_model_len` is the most tokens (prompt + output) one request may hold."""
    versions = await run_in_threadpool(services.registry.list, tenant.tenant_id)
    owners = {}
    for v in versions:
        if v.tenant_id != tenant.tenant_id and v.tenant_id not in owners:
            owners[v.tenant_id] = (await run_in_threadpool(services.tenancy.tenant, v.tenant_id)).name
    max_len = services.engine.max_model_len
    data = [{"id": pipeline.model_id, "object": "model", "created": 0, "owned_by": "loramux",
             "root": pipeline.model_id, "parent": None, "max_model_len": max_len}]
    data += [{"id": v.name if v.tenant_id == tenant.tenant_id else f"{owners[v.tenant_id]}/{v.name}",
              "object": "model", "created": int(v.created_at.timestamp()),
              "owned_by": "you" if v.tenant_id == tenant.tenant_id else "public", "root": adapter_reference(v),
              "parent": pipeline.model_id, "max_model_len": max_len,
              "loramux": {"adapter_id": v.adapter_id, "version": v.version, "rank": v.rank,
                          "target_modules": list(v.target_modules)}} for v in versions]
    return {"object": "list", "data": data}


router.include_router(openai_chat.router)
router.include_router(openai_completions.router)
