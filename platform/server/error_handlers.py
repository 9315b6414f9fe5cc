"""The app's exception handlers: each error family of the layers below (HTTP refusals, request validation,
tools, the engine, tenancy, the registry (adapters and Medusa heads), uploads, adapter loads, prices, billing,
admin keys) mapped to its status and a stable `code`, in OpenAI's error shape (`loramux.server.http.errors`)."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loramux.adapters.formats.validation import AdapterFormatError
from loramux.adapters.residency.cache_levels import AdapterLoadError
from loramux.adapters.storage.medusa_registry import MedusaNotFoundError
from loramux.adapters.storage.registry import AdapterNotFoundError, RegistryError
from loramux.billing.budgets import BudgetConflict, BudgetError, BudgetNotFound
from loramux.billing.pricing import PriceError
from loramux.billing.reports import BillingQueryError
from loramux.billing.webhooks import WebhookError, WebhookNotFound
from loramux.names import InvalidNameError
from loramux.server.http.errors import ApiError, error_response
from loramux.services.adapters import AdapterUnavailableError, UploadError
from loramux.services.admin_keys import SelfRevocationError
from loramux.tenancy.admin_keys import AdminKeyError
from loramux.tenancy.tenants import KeyNotFoundError, TenancyError, TenantExistsError, TenantNotFoundError

# Request fields whose malformed values are a 400, as OpenAI answers them (clients and SDKs handle a bad tool,
# response_format or logit_bias as a 400); other malformed fields are a 422.
BAD_REQUEST_FIELDS = frozenset({"tools", "tool_choice", "response_format", "logit_bias", "user", "models"})


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    """422 naming every invalid field (400 when all of them are in BAD_REQUEST_FIELDS); `param` is the
    first one."""
    problems, fields = [], set()
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        fields.add(loc[0] if loc else "")
        where = ".".join(loc)
        problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    first = exc.errors()[0].get("loc", ()) if exc.errors() else ()
    param = ".".join(str(p) for p in first if p != "body") or None
    status = 400 if fields and fields <= BAD_REQUEST_FIELDS else 422
    return error_response(status, "invalid request: " + "; ".join(problems), "invalid_parameter", param)


def install_error_handlers(app: FastAPI) -> None:
    """One handler per error family; each maps its exceptions to a status and a stable `code`."""
    from loramux.engine.async_engine import EngineDeadError, EngineStepError
    from loramux.server.intake.tool_calls import ToolError

    def handle(family, respond):
        async def handler(request: Request, exc):
            return respond(exc)
        app.add_exception_handler(family, handler)

    handle(ApiError, lambda e: error_response(e.status, str(e), e.code, e.param, e.retry_after_s, extra=e.extra))
    handle(StarletteHTTPException, lambda e: error_response(e.status_code, str(e.detail), headers=e.headers))
    handle(RequestValidationError, _validation_error)
    handle(ToolError, lambda e: error_response(400, str(e), "invalid_tools", "tools"))
    handle(EngineDeadError, lambda e: error_response(503, str(e), "engine_stopped", retry_after_s=5))
    handle(EngineStepError, lambda e: error_response(500, str(e), "engine_error"))
    handle(TenancyError, _tenancy_error)
    handle(RegistryError, lambda e: error_response(404 if isinstance(e, AdapterNotFoundError) else 400, str(e),
                                                   "adapter_not_found" if isinstance(e, AdapterNotFoundError)
                                                   else "invalid_request"))
    handle(MedusaNotFoundError, lambda e: error_response(404, str(e), "medusa_not_found"))
    handle(InvalidNameError, lambda e: error_response(400, str(e), "invalid_name"))
    handle(AdapterFormatError, lambda e: error_response(413 if getattr(e, "code", "") == "too_large" else 400,
                                                        str(e), getattr(e, "code", "invalid_adapter"),
                                                        getattr(e, "param", None)))
    handle(UploadError, lambda e: error_response(e.status, str(e), "upload_rejected"))
    handle(AdapterLoadError, lambda e: error_response(503, str(e), "adapter_unavailable", retry_after_s=5))
    handle(AdapterUnavailableError, lambda e: error_response(503, str(e), "adapter_unavailable", retry_after_s=5))
    handle(PriceError, lambda e: error_response(400, str(e), "invalid_price"))
    handle(BudgetError, lambda e: error_response(400, str(e), "invalid_budget"))
    handle(BudgetConflict, lambda e: error_response(409, str(e), "budget_conflict"))
    handle(BudgetNotFound, lambda e: error_response(404, str(e), "budget_not_found"))
    handle(WebhookError, lambda e: error_response(400, str(e), "invalid_webhook"))
    handle(WebhookNotFound, lambda e: error_response(404, str(e), "webhook_not_found"))
    handle(BillingQueryError, lambda e: error_response(400, str(e), "invalid_period"))
    handle(AdminKeyError, lambda e: error_response(404, str(e), "admin_key_not_found"))
    handle(SelfRevocationError, lambda e: error_response(400, str(e), "invalid_request"))


def _tenancy_error(exc: TenancyError) -> JSONResponse:
    if isinstance(exc, TenantNotFoundError):
        return error_response(404, str(exc), "tenant_not_found")
    if isinstance(exc, KeyNotFoundError):
        return error_response(404, str(exc), "key_not_found")
    if isinstance(exc, TenantExistsError):
        return error_response(409, str(exc), "tenant_exists")
    return error_response(400, str(exc), "invalid_request")
