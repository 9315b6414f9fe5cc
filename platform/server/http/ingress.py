"""What every HTTP request meets first, before any route reads a byte of its body.

`Ingress` is a pure ASGI middleware. In order, cheapest first:

1. **The key.** Routes under /admin need an admin key (`lmxa-...`), and so do vLLM's adapter endpoints
   (`ADMIN_PATHS_OUTSIDE_ADMIN`), the open ones (/health, /ready,
   /metrics, the docs) none, the console (/console) its own session cookie, every other path a tenant
   key (`lmx-...`): unknown paths too, so an
   anonymous client learns nothing about the route table. The caller is resolved in the threadpool
   (`TENANT_KEYS` / `ADMIN_KEYS`, answers cached by the key cache) and stored in `scope["state"]`
   ("tenant" / "admin"), where `loramux.server.deps:get_tenant` and `loramux.admin.deps:get_admin` (both
   made by `loramux.server.http.caller_deps:caller_dependency`) find it instead of authenticating twice.
   Refusals (401, 403) are answered at once in OpenAI's error shape, the body unread. A client address (see
   `loramux.server.http.forwarded`) past `Settings.auth_failures_per_min` unknown keys gets 429 with
   Retry-After before its key is looked up (`loramux.server.http.auth_failures`).
2. **The size.** Bodies are capped at `Settings.max_request_bytes` (413): a declared Content-Length
   above it is refused at once, a chunked body as soon as the bytes streamed in pass it. Adapter uploads
   (`POST /admin/adapters`) and Medusa heads uploads (`POST /admin/medusa`) are passed through unbuffered:
   `loramux.admin.uploads:receive_upload` caps them itself while it spools them to disk.
3. **The shape.** A JSON body must be UTF-8 (RFC 8259 §8.1) with no NUL byte, else 400
   `invalid_json_encoding`: `json.loads` would otherwise guess UTF-16/32 from the bytes, and the depth scan
   below, which reads them as UTF-8, would check other text than the parser reads (a UTF-16 body hid its
   nesting from it). A UTF-8 byte order mark is ignored, as the parser does (RFC 8259 allows it). A JSON
   body nested deeper than `MAX_JSON_DEPTH` is refused (400) by a linear scan, before any recursive parser
   or validator sees it.

A refusal that leaves a body unread closes the connection (`Connection: close`), so a client streaming
hundreds of megabytes is cut off rather than drained. The body that passed is handed to the app from
memory, followed by the client's own messages (a later `http.disconnect` still reaches the route).
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Generic, TypeVar

from fastapi.concurrency import run_in_threadpool
from fastapi.security.utils import get_authorization_scheme_param
from starlette.datastructures import Headers

from loramux.server.http.auth_failures import AuthFailureLimiter
from loramux.server.http.errors import error_response
from loramux.server.http.forwarded import client_address
from loramux.tenancy.admin_keys import ADMIN_KEY_PREFIX, AdminKeyInfo
from loramux.tenancy.tenants import KEY_PREFIX, TenantContext

MAX_JSON_DEPTH = 64  # arrays and objects nested in each other; OpenAI's request shapes need fewer than 8
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
# vLLM's adapter endpoints: under /v1 as vLLM has them, but operations on the server, so for admin keys.
ADMIN_PATHS_OUTSIDE_ADMIN = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
# The operator console authenticates with its own signed session cookie (loramux.console), not a bearer key.
OWN_AUTH_PREFIXES = ("/console",)
# Capped by their route, at max_upload_bytes + 1 MiB.
UPLOAD_ROUTES = frozenset({("POST", "/admin/adapters"), ("POST", "/admin/medusa"),
                           ("POST", "/console/adapters/upload")})
_SCAN_IN_THREAD_BYTES = 64 * 1024  # encoding + depth scans of a larger body run in the threadpool, off the loop

C = TypeVar("C")  # who a kind of key authenticates: a TenantContext or an AdminKeyInfo


@dataclass(frozen=True)
class Refusal:
    """An authentication failure: the status and the message the client gets."""

    status: int
    message: str

    @property
    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}


MISSING_TENANT_KEY = Refusal(401, "missing API key: send `Authorization: Bearer <your key>`")
INVALID_TENANT_KEY = Refusal(401, "invalid or revoked API key")
ADMIN_KEY_ON_TENANT_ROUTE = Refusal(403, "admin keys are not accepted on tenant routes: use a tenant API key")
MISSING_ADMIN_KEY = Refusal(401, "missing admin key: send `Authorization: Bearer <admin key>`")
INVALID_ADMIN_KEY = Refusal(401, "invalid or revoked admin key")
TENANT_KEY_ON_ADMIN_ROUTE = Refusal(403, "tenant API keys are not accepted on admin routes: use an admin key")
FAILED_KEYS = (INVALID_TENANT_KEY, INVALID_ADMIN_KEY)  # the refusals a failed-authentication limit counts


def too_many_failures(retry_after_s: float) -> Refusal:
    return Refusal(429, f"too many failed authentications from this address; retry in {retry_after_s:.0f} s")


def retry_after_header(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def failure_limit(scope) -> tuple[AuthFailureLimiter | None, str]:
    """The app's failed-authentication limiter (None before its lifespan ran) and this request's client."""
    state = scope["app"].state
    return getattr(state, "auth_failures", None), client_address(scope, getattr(state, "trusted_proxies", ()))


def bearer_token(authorization: str | None) -> str | None:
    """The credentials of an `Authorization: Bearer <token>` header (as FastAPI's HTTPBearer reads it)."""
    scheme, credentials = get_authorization_scheme_param(authorization)
    if not authorization or not credentials or scheme.lower() != "bearer":
        return None
    return credentials


def _accept(caller) -> Refusal | None:
    return None


@dataclass(frozen=True)
class BearerKeys(Generic[C]):
    """One kind of bearer key (tenant or admin): how it is looked up and what refusing it says."""

    state_key: str  # where the caller is left in scope["state"] for the routes' dependencies
    missing: Refusal
    other_prefix: str  # the other kind's keys: refused with `other`, never looked up
    other: Refusal
    invalid: Refusal
    lookup: Callable[[Any], Callable[[str], C | None]]  # services -> its key lookup (answers cached by a KeyCache)
    vet: Callable[[C], Refusal | None] = _accept  # a refusal for a valid key's caller (a suspended tenant)

    async def resolve(self, services, raw: str | None) -> C | Refusal:
        """The caller a raw key is, or why it is refused."""
        if raw is None:
            return self.missing
        if raw.startswith(self.other_prefix):
            return self.other
        caller = await run_in_threadpool(self.lookup(services), raw)
        if caller is None:
            return self.invalid
        return self.vet(caller) or caller


def _suspended(tenant: TenantContext) -> Refusal | None:
    if tenant.active:
        return None
    return Refusal(403, f"tenant {tenant.tenant_name!r} is suspended; contact your administrator")


TENANT_KEYS: BearerKeys[TenantContext] = BearerKeys(
    "tenant", MISSING_TENANT_KEY, ADMIN_KEY_PREFIX, ADMIN_KEY_ON_TENANT_ROUTE, INVALID_TENANT_KEY,
    lambda services: services.tenancy.authenticate, _suspended)
ADMIN_KEYS: BearerKeys[AdminKeyInfo] = BearerKeys(
    "admin", MISSING_ADMIN_KEY, KEY_PREFIX, TENANT_KEY_ON_ADMIN_ROUTE, INVALID_ADMIN_KEY,
    lambda services: services.admin_keys.authenticate)


async def resolve_tenant(services, raw: str | None) -> TenantContext | Refusal:
    """The active tenant a raw tenant key belongs to, or why it is refused."""
    return await TENANT_KEYS.resolve(services, raw)


async def resolve_admin(services, raw: str | None) -> AdminKeyInfo | Refusal:
    """The admin key a raw admin key is, or why it is refused."""
    return await ADMIN_KEYS.resolve(services, raw)


# -- JSON nesting ----------------------------------------------------------------------------------
# A JSON string, escapes included; an unterminated string runs to the end. Linear on any input without
# possessive quantifiers (Python 3.11+): the two branches start with disjoint bytes, so there is one way
# to match, and the closing quote is optional, so a match never fails and nothing backtracks.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1


def json_depth_exceeds(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether arrays/objects in `body` (JSON text, valid or not) nest more than `limit` deep. Brackets
    inside strings do not count. Linear time, no recursion: safe on a 100k-deep `[[[[...`."""
    if body.count(b"[") + body.count(b"{") <= limit:  # the usual case: too few openers to nest that deep
        return False
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    if brackets.count(b"[") + brackets.count(b"{") <= limit:
        return False
    return max(accumulate(map(_STEP.__getitem__, brackets))) > limit


def json_encoding_problem(body: bytes) -> str | None:
    """Why `body` is no UTF-8 JSON text the depth scan and the parser read alike, or None when it is.

    `json.loads(bytes)` picks UTF-16/32 when a NUL byte sits in the first four, and UTF-8 otherwise; a NUL
    byte is never valid in JSON text (a control character must be escaped), so a body that decodes strictly
    as UTF-8 and holds no NUL is parsed as the UTF-8 the depth scan read."""
    if b"\x00" in body:
        return ("the JSON body holds a NUL byte: send JSON text encoded as UTF-8 (RFC 8259 section 8.1), "
                "not UTF-16 or UTF-32, and escape control characters in strings (\\u0000)")
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return (f"the JSON body is not valid UTF-8 (byte {exc.start}): send JSON text encoded as UTF-8 "
                "(RFC 8259 section 8.1)")
    return None


def json_body_refusal(body: bytes, limit: int = MAX_JSON_DEPTH) -> tuple[str, str] | None:
    """(message, code) for a JSON body that is not UTF-8 or nests deeper than `limit`, else None."""
    problem = json_encoding_problem(body)
    if problem is not None:
        return problem, "invalid_json_encoding"
    if json_depth_exceeds(body, limit):
        return f"the JSON body nests arrays and objects more than {limit} levels deep", "json_too_deep"
    return None


def _is_json(headers: Headers) -> bool:
    """The bodies FastAPI parses as JSON: no content type, or application/json or application/*+json."""
    content_type = headers.get("content-type")
    if not content_type:
        return True
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


class _TooLarge(Exception):
    pass


class Ingress:
    """The ASGI middleware (see the module docstring). `open_paths` need no key; `upload_routes`
    ((method, path) pairs) are not buffered or capped here; their route caps them."""

    def __init__(self, app, open_paths: Iterable[str] = OPEN_PATHS,
                 upload_routes: Iterable[tuple[str, str]] = UPLOAD_ROUTES, max_json_depth: int = MAX_JSON_DEPTH):
        self.app = app
        self.open_paths = frozenset(p.rstrip("/") or "/" for p in open_paths)
        self.upload_routes = frozenset((m.upper(), p.rstrip("/")) for m, p in upload_routes)
        self.max_json_depth = max_json_depth

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = _route_path(scope).rstrip("/") or "/"
        headers = Headers(scope=scope)
        declared = _declared_length(headers)
        body_coming = bool(declared) or "transfer-encoding" in headers  # a refusal would leave it unread
        services = scope["app"].state.services

        if path not in self.open_paths and not _under(path, OWN_AUTH_PREFIXES):
            raw = bearer_token(headers.get("authorization"))
            admin_route = path == "/admin" or path.startswith("/admin/") or path in ADMIN_PATHS_OUTSIDE_ADMIN
            limiter, client = failure_limit(scope)
            wait = limiter.retry_after(client) if limiter is not None and raw is not None else None
            if wait is not None:
                refusal = too_many_failures(wait)
                await self._refuse(scope, receive, send, refusal.status, refusal.message, "too_many_auth_failures",
                                   retry_after_header(wait), close=body_coming)
                return
            keys = ADMIN_KEYS if admin_route else TENANT_KEYS
            caller = await keys.resolve(services, raw)
            if limiter is not None and isinstance(caller, Refusal) and caller in FAILED_KEYS:
                limiter.record_failure(client)
            if isinstance(caller, Refusal):
                await self._refuse(scope, receive, send, caller.status, caller.message, None, caller.headers,
                                   close=body_coming)
                return
            scope.setdefault("state", {})[keys.state_key] = caller

        if (scope["method"], path) in self.upload_routes:
            await self.app(scope, receive, send)
            return

        cap = services.settings.max_request_bytes
        if declared is not None and declared > cap:
            await self._refuse(scope, receive, send, 413, f"the request body is {declared} bytes; this server "
                               f"accepts at most {cap} bytes here", "request_body_too_large", close=True)
            return
        try:
            body = await _read_body(receive, cap)
        except _TooLarge:
            await self._refuse(scope, receive, send, 413, f"the request body is larger than this server's limit "
                               f"of {cap} bytes here", "request_body_too_large", close=True)
            return
        if body is None:  # the client left before its body arrived: nobody to answer
            return
        if body and _is_json(headers):
            refusal = (await run_in_threadpool(json_body_refusal, body, self.max_json_depth)
                       if len(body) > _SCAN_IN_THREAD_BYTES else json_body_refusal(body, self.max_json_depth))
            if refusal is not None:
                await self._refuse(scope, receive, send, 400, *refusal)
                return
        await self.app(scope, _replay(body, receive), send)

    @staticmethod
    async def _refuse(scope, receive, send, status: int, message: str, code: str | None,
                      headers: dict[str, str] | None = None, *, close: bool = False) -> None:
        headers = dict(headers or {})
        if close:  # the rest of the body is never read: end the connection instead of draining it
            headers["Connection"] = "close"
        await error_response(status, message, code, headers=headers)(scope, receive, send)


def _under(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == p or path.startswith(p + "/") for p in prefixes)


def _route_path(scope) -> str:
    """The path the router matches (without the root path a proxy mounts the app under)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _declared_length(headers: Headers) -> int | None:
    """The Content-Length the request declares (without chunked encoding), else None."""
    value = headers.get("content-length")
    if value is None or "transfer-encoding" in headers:
        return None
    value = value.strip()
    return int(value) if value.isdigit() else None


async def _read_body(receive, cap: int) -> bytes | None:
    """The whole body, or None when the client disconnects first; `_TooLarge` once more than `cap` bytes
    have arrived (nothing beyond that is read)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > cap:
            raise _TooLarge
        if chunk:
            chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive):
    """A `receive` that gives the app the buffered body first, then the client's later messages."""
    delivered = False

    async def replayed():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
