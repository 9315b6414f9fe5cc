"""The HTTP server: OpenAI-compatible tenant API (/v1), the native API (/generate), health, readiness,
metrics (engine-wide stats are an admin route).

Every route except /health, /ready, /metrics (behind `metrics_key` when one is set) and the API docs needs
a key (a tenant key; an admin key under /admin), checked by `loramux.server.http.ingress:Ingress` before any
body is read, which also caps bodies (`max_request_bytes`, 413) and their JSON nesting. Errors have OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`, with the right status (400/401/403/404/413/422/429/503)
and a Retry-After header where waiting helps.
"""
from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from loramux.admin.routes import router as admin_router
from loramux.admin.routes import vllm_adapters
from loramux.console.revocations import SessionRevocations
from loramux.console.routes import install_console
from loramux.console.session import SessionSigner
from loramux.names import base_model_id
from loramux.server.deps import ServicesDep
from loramux.server.error_handlers import install_error_handlers
from loramux.server.http.auth_failures import AuthFailureLimiter
from loramux.server.http.errors import error_response
from loramux.server.http.forwarded import parse_trusted_proxies
from loramux.server.http.ingress import OPEN_PATHS, Ingress
from loramux.server.http.metrics_auth import scrape_allowed
from loramux.server.routes import native, openai_api
from loramux.server.serving.metrics import ServerMetrics
from loramux.server.serving.pipeline import RequestPipeline
from loramux.tenancy.rate_limits import RateLimiter


def create_app(services_factory, ledger_hooks: list | None = None, limiter_factory=RateLimiter) -> FastAPI:
    """`services_factory()` returns the Services (engine, registry, caches, tenancy, ledger); it is called
    once at startup. Every finished request's RequestRecord goes to the ledger writer and to `ledger_hooks`.
    `limiter_factory()`: the tenants' rate limiter (in memory; shared through Redis on a cluster)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        services = services_factory()
        connect = getattr(services.engine, "connect", None)  # a remote engine learns the replicas' limits
        if connect is not None:
            await connect()
        tiers = [t.name for t in await run_in_threadpool(services.tenancy.tiers)]
        await run_in_threadpool(lambda: services.engine.max_chars_per_token)  # the prompt length bound, once
        metrics = ServerMetrics(tiers)
        # Per-tenant series (fair share) only behind a metrics key: an open /metrics never names a tenant.
        tenant_series = bool(services.settings.metrics_key)
        metrics.set_state_source(lambda: {**{k: v for k, v in services.engine.stats().items()
                                             if tenant_series or k != "fair_share"},
                                          "adapter_cache": services.adapter_cache.stats(),
                                          "pinned": sorted(services.pinned.digests())})
        if tenant_series and services.budgets is not None:  # budgets name tenants' end users and tags
            metrics.set_budget_source(services.budgets.statuses)
        app.state.services = services
        app.state.console_signer = SessionSigner(services.settings.console_secret or None,
                                                 services.settings.console_session_s)
        app.state.console_revocations = SessionRevocations(services.db)
        app.state.metrics = metrics
        app.state.trusted_proxies = parse_trusted_proxies(services.settings.trusted_proxies)
        app.state.auth_failures = AuthFailureLimiter(services.settings.auth_failures_per_min)
        hooks = [services.ledger.submit, *(ledger_hooks or [])]
        app.state.pipeline = RequestPipeline(services, limiter_factory(), metrics, hooks,
                                             base_model_id(services.settings.model))
        try:
            yield
        finally:
            app.state.pipeline.compositions.shutdown()
            services.shutdown()

    app = FastAPI(title="loramux", version="0.1.0", lifespan=lifespan,
                  description="Multi-tenant LoRA serving: OpenAI-compatible API over one base model and many adapters.")
    app.include_router(openai_api.router)
    app.include_router(native.router)
    app.include_router(admin_router)
    app.include_router(vllm_adapters.router)
    install_error_handlers(app)
    install_console(app)
    docs = (app.docs_url, app.redoc_url, app.openapi_url, app.swagger_ui_oauth2_redirect_url)
    app.add_middleware(Ingress, open_paths=OPEN_PATHS | {p for p in docs if p})

    @app.get("/health", tags=["ops"])
    async def health() -> dict:
        """The process is up."""
        return {"status": "ok"}

    @app.get("/ready", tags=["ops"])
    async def ready(services: ServicesDep):
        """The model is loaded and the database answers."""
        try:
            await run_in_threadpool(services.db.check)
        except Exception as exc:  # noqa: BLE001
            return JSONResponse({"status": "not ready", "reason": f"database unreachable: {type(exc).__name__}"},
                                status_code=503)
        return {"status": "ready", "model": base_model_id(services.settings.model)}

    @app.get("/metrics", tags=["ops"], response_class=PlainTextResponse)
    async def metrics(request: Request, services: ServicesDep):
        """Prometheus text; with `metrics_key` set, only for `Authorization: Bearer <metrics_key>`."""
        if not scrape_allowed(services.settings.metrics_key, request.headers.get("authorization")):
            return error_response(401, "this server's metrics need `Authorization: Bearer <LORAMUX_METRICS_KEY>`",
                                  headers={"WWW-Authenticate": "Bearer"})
        await run_in_threadpool(request.app.state.metrics.refresh_budgets)  # a query: off the event loop
        body, content_type = request.app.state.metrics.render()
        return Response(body, media_type=content_type)

    return app
