"""HTTP front end: health, readiness, engine stats and a native `POST /generate` (plain or SSE stream).

Adapters are resolved in the registry and brought into host RAM (store -> disk -> RAM) before the
request enters the engine queue; the load runs on the adapter cache's threads, so other requests keep
being served. The OpenAI-compatible tenant API builds on this app (see the tenant API issue).
"""
from __future__ import annotations

import json
import uuid
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, model_validator

from loramux.adapters.registry import AdapterNotFoundError
from loramux.adapters.tiers import Acquired, AdapterLoadError
from loramux.engine.async_engine import EngineDeadError
from loramux.engine.engine import RequestError, RequestOutput
from loramux.engine.sampling_params import SamplingParams
from loramux.adapters.registry import BASE_MODEL_ALIAS
from loramux.services import Services


class Message(BaseModel):
    role: str = Field(pattern="^(system|user|assistant)$")
    content: str


class GenerateRequest(BaseModel):
    """Either `prompt` (raw text, no template) or `messages` (chat template applied); `adapter` names a
    registered LoRA adapter: its name, `ad_<id>`, or `owner/name`, optionally `@<version>` (omit it, or
    give "base", for the base model)."""

    prompt: str | None = None
    adapter: str | None = None
    messages: list[Message] | None = None
    max_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=0)
    stop: list[str] | str | None = None
    timeout_s: float | None = Field(default=None, gt=0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
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
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              seed=self.seed, stop=stop, timeout_s=self.timeout_s, min_tokens=self.min_tokens,
                              ignore_eos=self.ignore_eos)


def _final_body(request_id: str, out: RequestOutput) -> dict:
    return {
        "id": request_id,
        "text": out.text,
        "finish_reason": out.finish_reason,
        "usage": {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": len(out.token_ids),
                  "total_tokens": out.num_prompt_tokens + len(out.token_ids)},
        "timings": out.timings,
        "adapter": out.adapter,
    }


def _adapter_fields(lease: Acquired | None, version) -> dict:
    if version is None:
        return {}
    return {"adapter_id": version.adapter_id, "adapter_version": version.version,
            "adapter_tier": lease.tier if lease else None, "adapter_load_ms": round(lease.load_ms, 1) if lease else None}


def get_services(request: Request) -> Services:
    return request.app.state.services


ServicesDep = Annotated[Services, Depends(get_services)]
DEFAULT_ADAPTER_TIMEOUT_S = 60.0


def create_app(services_factory) -> FastAPI:
    """`services_factory()` returns the Services (engine, registry, adapter cache); called once at startup."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.services = services_factory()
        try:
            yield
        finally:
            app.state.services.shutdown()

    app = FastAPI(title="loramux", version="0.1.0", lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(services: ServicesDep):
        try:
            await run_in_threadpool(services.db.check)
        except Exception as exc:
            return JSONResponse({"status": "not ready", "reason": f"database unreachable: {type(exc).__name__}"},
                                status_code=503)
        return {"status": "ready", "model": getattr(services.engine.engine, "model_name", "custom")}

    @app.get("/stats")
    async def stats(services: ServicesDep) -> dict:
        return {**services.engine.stats(), "adapter_cache": services.adapter_cache.stats()}

    @app.get("/adapters")
    async def adapters(services: ServicesDep) -> dict:
        tenant_id = await run_in_threadpool(services.local_tenant_id)
        listed = await run_in_threadpool(services.registry.list, tenant_id)
        return {"adapters": [{"id": v.adapter_id, "name": v.name, "version": v.version, "rank": v.rank,
                              "targets": list(v.target_modules), "digest": v.digest} for v in listed]}

    @app.post("/generate")
    async def generate(body: GenerateRequest, services: ServicesDep):
        engine = services.engine
        try:
            params = body.sampling_params()
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        try:
            prompt = body.prompt if body.prompt is not None else engine.engine.encode_chat(
                [m.model_dump() for m in body.messages])
        except Exception as exc:  # jinja TemplateError and friends: the messages do not fit the template
            raise HTTPException(status_code=400, detail=f"messages do not fit the model's chat template: {exc}")
        request_id = f"gen-{uuid.uuid4().hex}"
        version = lease = None
        if body.adapter not in (None, BASE_MODEL_ALIAS):
            try:
                tenant_id = await run_in_threadpool(services.local_tenant_id)
                version = await run_in_threadpool(services.registry.resolve, tenant_id, body.adapter)
                lease = await services.adapter_cache.acquire(version, body.timeout_s or DEFAULT_ADAPTER_TIMEOUT_S)
            except AdapterNotFoundError as exc:
                raise HTTPException(status_code=404, detail=f"{exc}; GET /adapters lists them") from exc
            except (AdapterLoadError, TimeoutError) as exc:
                raise HTTPException(status_code=503, detail=f"adapter {body.adapter!r} could not be loaded: {exc}",
                                    headers={"Retry-After": "5"}) from exc
        released = False

        def release():
            nonlocal released
            if lease is not None and not released:
                released = True
                services.adapter_cache.release(lease.adapter.digest)

        try:
            stream = engine.generate(request_id, prompt, params, adapter=lease.adapter if lease else None)
            first = await anext(stream)
        except RequestError as exc:
            release()
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        except EngineDeadError as exc:
            release()
            raise HTTPException(status_code=503, detail=str(exc), headers={"Retry-After": "5"}) from exc
        except BaseException:
            release()
            raise
        extra = _adapter_fields(lease, version)

        if not body.stream:
            try:
                out = first
                async for out in stream:
                    pass
            finally:
                release()
            return JSONResponse({**_final_body(request_id, out), **extra}, headers={"X-Request-Id": request_id})

        async def events():
            out = first
            try:
                while True:
                    if out.delta_text:
                        yield f"data: {json.dumps({'id': request_id, 'text': out.delta_text})}\n\n"
                    if out.finished:
                        yield f"data: {json.dumps({**_final_body(request_id, out), **extra})}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    out = await anext(stream)
            except Exception as exc:  # the headers are sent: report the failure as a final event
                yield f"data: {json.dumps({'id': request_id, 'error': str(exc) or type(exc).__name__})}\n\n"
            finally:
                await stream.aclose()  # a client that went away aborts the request
                release()

        return StreamingResponse(events(), media_type="text/event-stream", headers={"X-Request-Id": request_id})

    return app
