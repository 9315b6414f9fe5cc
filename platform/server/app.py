"""HTTP front end: health, readiness, engine stats and a native `POST /generate` (plain or SSE stream).

The OpenAI-compatible tenant API builds on this app (see the tenant API issue).
"""
from __future__ import annotations

import json
import uuid
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, model_validator

from loramux.engine.async_engine import AsyncEngine, EngineDeadError
from loramux.engine.engine import RequestError, RequestOutput
from loramux.engine.sampling_params import SamplingParams


class Message(BaseModel):
    role: str = Field(pattern="^(system|user|assistant)$")
    content: str


class GenerateRequest(BaseModel):
    """Either `prompt` (raw text, no template) or `messages` (chat template applied); `adapter` names a
    loaded LoRA adapter (omit it for the base model)."""

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
                              seed=self.seed, stop=stop, timeout_s=self.timeout_s)


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


def get_engine(request: Request) -> AsyncEngine:
    return request.app.state.engine


EngineDep = Annotated[AsyncEngine, Depends(get_engine)]


def create_app(engine_factory) -> FastAPI:
    """`engine_factory()` returns the AsyncEngine; it is called once at startup."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.engine = engine_factory()
        try:
            yield
        finally:
            app.state.engine.shutdown()

    app = FastAPI(title="loramux", version="0.1.0", lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(engine: EngineDep) -> dict:
        return {"status": "ready", "model": getattr(engine.engine, "model_name", "custom")}

    @app.get("/stats")
    async def stats(engine: EngineDep) -> dict:
        return engine.stats()

    @app.get("/adapters")
    async def adapters(engine: EngineDep) -> dict:
        return {"adapters": [{"name": a.name, "rank": a.rank, "targets": list(a.target_modules), "digest": a.digest}
                             for a in engine.engine.adapters.values()]}

    @app.post("/generate")
    async def generate(body: GenerateRequest, engine: EngineDep):
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
        if body.adapter is not None and body.adapter not in engine.engine.adapters:
            raise HTTPException(status_code=404, detail=f"unknown adapter {body.adapter!r}; GET /adapters lists them")
        stream = engine.generate(request_id, prompt, params, adapter=body.adapter)
        try:
            first = await anext(stream)
        except RequestError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        except EngineDeadError as exc:
            raise HTTPException(status_code=503, detail=str(exc), headers={"Retry-After": "5"}) from exc

        if not body.stream:
            out = first
            async for out in stream:
                pass
            return JSONResponse(_final_body(request_id, out), headers={"X-Request-Id": request_id})

        async def events():
            out = first
            try:
                while True:
                    if out.delta_text:
                        yield f"data: {json.dumps({'id': request_id, 'text': out.delta_text})}\n\n"
                    if out.finished:
                        yield f"data: {json.dumps(_final_body(request_id, out))}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    out = await anext(stream)
            except Exception as exc:  # the headers are sent: report the failure as a final event
                yield f"data: {json.dumps({'id': request_id, 'error': str(exc) or type(exc).__name__})}\n\n"
            finally:
                await stream.aclose()  # a client that went away aborts the request

        return StreamingResponse(events(), media_type="text/event-stream", headers={"X-Request-Id": request_id})

    return app
