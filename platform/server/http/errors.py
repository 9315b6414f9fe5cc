"""Every HTTP error in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, in one place.

Routes and data-access code raise their own exceptions (tenancy, registry, upload validation, prices,
billing, admin keys, adapter loads, the engine); `loramux.server.error_handlers` maps each family to its
status and code, so no route translates exceptions by hand. `ApiError` is for refusals decided in the HTTP
layer itself (rate limits, deadlines, bad parameter combinations).
"""
from __future__ import annotations

from fastapi.responses import JSONResponse

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away before the answer"

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error", 415: "invalid_request_error",
          422: "invalid_request_error", 402: "insufficient_quota",
          429: "rate_limit_error", CLIENT_CLOSED_REQUEST: "cancelled", 503: "service_unavailable"}


class ApiError(Exception):
    """A request refused by the HTTP layer: `status` with this message (and Retry-After when given)."""

    def __init__(self, status: int, message: str, retry_after_s: float | None = None, code: str = "invalid_request",
                 param: str | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s
        self.code = code
        self.param = param
        self.extra = extra  # more fields of the error object (a 402's budget: scope, remaining_usd, ...)


def error_body(status: int, message: str, code: str | None = None, param: str | None = None,
               extra: dict | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code,
                      **(extra or {})}}


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   retry_after_s: float | None = None, headers: dict[str, str] | None = None,
                   extra: dict | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(retry_after_s)))
    return JSONResponse(error_body(status, message, code, param, extra), status_code=status,
                        headers=headers or None)


def client_disconnected() -> JSONResponse:
    """The answer to a request whose client left before it finished (nobody reads it; logs and tests do)."""
    return error_response(CLIENT_CLOSED_REQUEST, "client disconnected", "cancelled")
