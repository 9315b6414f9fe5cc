"""Cheap checks on a generation request's parsed JSON, before pydantic validates anything and before the
rate limiter is asked: count limits on its lists and maps, and the ids it sends to SQL and the ledger.

Validation walks every item of a body (each message, content part, stop string, logit_bias key, tool)
through its validators, which costs in proportion to the count: 100k empty messages took seconds before
their 400. `check_counts` only takes lengths (and, per message, the length of its content list, after the
message count has passed), so a 4 MB body is refused within milliseconds of being parsed. Each limit is a
Settings field; a request over one gets 400 `too_many_items` naming the field and the limit.

`user` (the end-user id in the ledger row) and `model` / `adapter_id` (looked up in the registry, kept as
the row's `requested`) with a control character (NUL among them, which PostgreSQL cannot store or even
compare) are a 400 naming the field; an empty `user` means no user (`GenerationParams`).

`PrecheckedRoute` is the route class of the generation routers: it runs the checks on the JSON body that
FastAPI parses anyway (Starlette caches `request.json()`, so it is parsed once).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.routing import APIRoute

from loramux.server.http.errors import ApiError
from loramux.server.intake.params import has_control_chars


@dataclass(frozen=True)
class CountLimits:
    """The most items one request may carry in each list or map (see Settings' request shape limits)."""

    messages: int = 2048
    content_parts: int = 256
    stop: int = 16
    logit_bias: int = 300
    tools: int = 128
    models: int = 16  # adapters one fan-out request names

    @classmethod
    def from_settings(cls, settings) -> CountLimits:
        return cls(messages=settings.max_messages, content_parts=settings.max_content_parts,
                   stop=settings.max_stop_sequences, logit_bias=settings.max_logit_bias_entries,
                   tools=settings.max_tools, models=settings.max_fanout)


_SETTING = {"messages": "max_messages", "content_parts": "max_content_parts", "stop": "max_stop_sequences",
            "logit_bias": "max_logit_bias_entries", "tools": "max_tools", "models": "max_fanout"}


def _too_many(param: str, count: int, limit: int, what: str, setting: str) -> ApiError:
    return ApiError(400, f"{param} has {count} {what}; this server accepts at most {limit} "
                         f"(LORAMUX_{setting.upper()})", code="too_many_items", param=param)


def _check(param: str, value, limit: int, kind: str, what: str) -> None:
    if isinstance(value, (list, dict)) and len(value) > limit:
        raise _too_many(param, len(value), limit, what, _SETTING[kind])


def check_counts(body, limits: CountLimits) -> None:
    """400 `too_many_items` for the first list or map of `body` (a parsed JSON request) longer than its
    limit; anything that is not the expected type is left to the validators. Cost: O(messages) at most."""
    if not isinstance(body, dict):
        return
    _check("messages", body.get("messages"), limits.messages, "messages", "messages")
    _check("stop", body.get("stop"), limits.stop, "stop", "stop sequences")
    _check("logit_bias", body.get("logit_bias"), limits.logit_bias, "logit_bias", "entries")
    _check("tools", body.get("tools"), limits.tools, "tools", "tools")
    _check("models", body.get("models"), limits.models, "models", "adapters")
    messages = body.get("messages")
    if isinstance(messages, list):
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            _check(f"messages[{i}].content", content, limits.content_parts, "content_parts", "content parts")


def _is_json(content_type: str | None) -> bool:
    """The bodies FastAPI parses as JSON: no content type, application/json or application/*+json."""
    if not content_type:
        return True
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


# Client strings that reach SQL (the registry's name lookup) and the ledger row (`requested`, `end_user`).
_ID_FIELDS = ("user", "model", "adapter_id", "adapter")


def check_ids(body) -> None:
    """400 naming the field when `user`, `model`, `adapter_id` or an entry of `models` holds a control
    character (U+0000-U+001F, U+007F-U+009F): none belongs in an id, and PostgreSQL cannot even take a NUL in
    a query (a 500)."""
    if not isinstance(body, dict):
        return
    for name in _ID_FIELDS:
        value = body.get(name)
        if isinstance(value, str) and has_control_chars(value):
            raise ApiError(400, f"{name} must not contain control characters (U+0000-U+001F, U+007F-U+009F)",
                           code=f"invalid_{name}", param=name)
    models = body.get("models")  # a fan-out's adapter references, each like `model`
    if isinstance(models, list):
        for i, value in enumerate(models):
            if isinstance(value, str) and has_control_chars(value):
                raise ApiError(400, f"models[{i}] must not contain control characters (U+0000-U+001F, "
                                    "U+007F-U+009F)", code="invalid_models", param="models")


class PrecheckedRoute(APIRoute):
    """An APIRoute that refuses a JSON body over the count limits of the app's Settings, or with a bad
    `user`, before FastAPI validates it (see the module docstring). A body that is no valid JSON goes on
    to FastAPI's own error."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def checked(request: Request):
            if request.method == "POST" and _is_json(request.headers.get("content-type")):
                try:
                    body = await request.json()  # cached on the request: FastAPI reuses it
                except (ValueError, RecursionError):  # not JSON, an int past 4300 digits: FastAPI's own 400
                    body = None
                check_counts(body, CountLimits.from_settings(request.app.state.services.settings))
                check_ids(body)
            return await handler(request)

        return checked
