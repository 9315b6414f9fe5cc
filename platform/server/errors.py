"""Every HTTP error in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, in one place.

Routes and data-access code raise their own exceptions (tenancy, registry, upload validation, prices,
billing, admin keys, adapter loads, the engine); `install_error_handlers` maps each family to its status
and code, so no route translates exceptions by hand. `ApiError` is for refusals decided in the HTTP layer
itself (rate limits, deadlines, bad parameter combinations).
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loramux.adapters.registry import AdapterNotFoundError, RegistryError
from loramux.adapters.tiers import AdapterLoadError
from loramux.adapters.validation import AdapterFormatError
from loramux.admin.billing import BillingQueryError
from loramux.admin.keys import AdminKeyError
from loramux.admin.pricing import PriceError
from loramux.names import InvalidNameError
from loramux.services.adapters import AdapterUnavailableError, UploadError
from loramux.services.admin_keys import SelfRevocationError
from loramux.tenancy import KeyNotFoundError, TenancyError, TenantExistsError, TenantNotFoundError

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away before the answer"

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error", 415: "invalid_request_error",
          422: "invalid_request_error",
          429: "rate_limit_error", CLIENT_CLOSED_REQUEST: "cancelled", 503: "service_unavailable"}


class ApiError(Exception):
    """A request refused by the HTTP layer: `status` with this message (and Retry-After when given)."""

    def __init__(self, status: int, message: str, retry_after_s: float | None = None, code: str = "invalid_request",
                 param: str | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s
        self.code = code
        self.param = param


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}}


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   retry_after_s: float | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(retry_after_s)))
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers or None)


def client_disconnected() -> JSONResponse:
    """The answer to a request whose client left before it finished (nobody reads it; logs and tests do)."""
    return error_response(CLIENT_CLOSED_REQUEST, "client disconnected", "cancelled")


# Request fields whose malformed values are a 400, as OpenAI answers them (clients and SDKs handle a bad tool,
# response_format or logit_bias as a 400); other malformed fields are a 422.
BAD_REQUEST_FIELDS = frozenset({"tools", "tool_choice", "response_format", "logit_bias", "user"})


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
    from loramux.server.tool_calls import ToolError

    def handle(family, respond):
        async def handler(request: Request, exc):
            return respond(exc)
        app.add_exception_handler(family, handler)

    handle(ApiError, lambda e: error_response(e.status, str(e), e.code, e.param, e.retry_after_s))
    handle(StarletteHTTPException, lambda e: error_response(e.status_code, str(e.detail), headers=e.headers))
    handle(RequestValidationError, _validation_error)
    handle(ToolError, lambda e: error_response(400, str(e), "invalid_tools", "tools"))
    handle(EngineDeadError, lambda e: error_response(503, str(e), "engine_stopped", retry_after_s=5))
    handle(EngineStepError, lambda e: error_response(500, str(e), "engine_error"))
    handle(TenancyError, _tenancy_error)
    handle(RegistryError, lambda e: error_response(404 if isinstance(e, AdapterNotFoundError) else 400, str(e),
                                                   "adapter_not_found" if isinstance(e, AdapterNotFoundError)
                                                   else "invalid_request"))
    handle(InvalidNameError, lambda e: error_response(400, str(e), "invalid_name"))
    handle(AdapterFormatError, lambda e: error_response(413 if getattr(e, "code", "") == "too_large" else 400,
                                                        str(e), getattr(e, "code", "invalid_adapter")))
    handle(UploadError, lambda e: error_response(e.status, str(e), "upload_rejected"))
    handle(AdapterLoadError, lambda e: error_response(503, str(e), "adapter_unavailable", retry_after_s=5))
    handle(AdapterUnavailableError, lambda e: error_response(503, str(e), "adapter_unavailable", retry_after_s=5))
    handle(PriceError, lambda e: error_response(400, str(e), "invalid_price"))
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
