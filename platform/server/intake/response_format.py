"""Structured output: what a request asks its output to be (`response_format`, and on the native API also
`regex` or `choice`), as the engine's `StructuredOutput`, and the compile step that checks it before the
request reaches the engine.

Compiling a grammar costs time in proportion to the schema (and can blow up on a pathological one), so it
runs after the rate limiter admitted the request, in one of the engine's compile worker processes, which
is killed past `LORAMUX_STRUCTURED_COMPILE_TIMEOUT_S` or its memory limit (`loramux.engine.structured.compile_pool`);
the engine caches compiled grammars by their canonical spec, so a schema that many requests share compiles
once. `compile_structured` returns only when the compile has really stopped, so the request's admission
(its concurrency slot, its tokens) is held for the whole compile.
"""
from __future__ import annotations

import json
from typing import Any

from fastapi.concurrency import run_in_threadpool
from pydantic import ConfigDict, Field

from loramux.engine.sampling.params import StructuredOutput
from loramux.engine.structured.compile_pool import CompileBusy
from loramux.engine.structured.grammar import StructuredOutputTooComplex
from loramux.server.http.bodies import RequestBody
from loramux.server.http.errors import ApiError

FORMAT_TYPES = ("text", "json_object", "json_schema")
MAX_CHOICES = 1024  # strings in a native `choice` list


class JSONSchemaFormat(RequestBody):
    """OpenAI's `response_format.json_schema`: the output is JSON valid for `schema`."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(default="response", min_length=1, max_length=64, description="a name for the schema")
    description: str | None = Field(default=None, description="what the response is for (not used in decoding)")
    schema_: dict[str, Any] = Field(alias="schema", description="a JSON schema; the output is valid for it")
    strict: bool | None = Field(default=None, description="accepted; the schema is always enforced strictly")


class ResponseFormat(RequestBody):
    """What the output must be: `{"type": "text"}` (anything, the default), `{"type": "json_object"}` (a
    JSON object) or `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` (JSON valid for
    the schema). Enforced token by token, so the output parses whatever the model; a response cut short by
    max_tokens or a timeout (finish_reason "length" / "timeout") is not complete JSON."""

    type: str = Field(description="one of: text, json_object, json_schema")
    json_schema: JSONSchemaFormat | None = Field(default=None, description='with type "json_schema"')


def canonical_json(value) -> str:
    """The compact text of a JSON value (the grammar cache's key). Key order is kept, not sorted: the
    grammar emits an object's properties in the schema's order, as OpenAI's structured outputs do."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def schema_output(schema: dict) -> StructuredOutput:
    return StructuredOutput("json_schema", canonical_json(schema))


def from_response_format(fmt: ResponseFormat | None) -> StructuredOutput | None:
    """The constraint of `response_format` (None for text); 400 for a type this server does not know."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput("json_object")
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise ApiError(400, 'response_format of type "json_schema" needs a "json_schema" object: '
                                '{"name": ..., "schema": {...}}', code="invalid_response_format",
                           param="response_format")
        return schema_output(fmt.json_schema.schema_)
    raise ApiError(400, f"response_format type {fmt.type!r} is not supported; use one of {', '.join(FORMAT_TYPES)}",
                   code="invalid_response_format", param="response_format.type")


def from_native(fmt: ResponseFormat | None, regex: str | None, choice: list[str] | None) -> StructuredOutput | None:
    """The native API's constraint: at most one of `response_format`, `regex` and `choice` (400 otherwise)."""
    given = [name for name, value in (("response_format", fmt is not None and fmt.type != "text"),
                                      ("regex", regex is not None), ("choice", choice is not None)) if value]
    if len(given) > 1:
        raise ApiError(400, f"give at most one output constraint, not {' and '.join(given)}",
                       code="invalid_response_format")
    if regex is not None:
        return StructuredOutput("regex", regex)
    if choice is not None:
        if not choice or len(choice) > MAX_CHOICES or not all(choice):
            raise ApiError(400, f"choice must list 1 to {MAX_CHOICES} non-empty strings",
                           code="invalid_response_format", param="choice")
        return StructuredOutput("choice", json.dumps(choice, ensure_ascii=False))
    return from_response_format(fmt)


async def compile_structured(engine, structured: StructuredOutput | None, timeout_s: float,
                             what: str | None = None) -> None:
    """Compile `structured` in the engine's grammar cache (`AsyncEngine.compile_structured`; the Ray ingress's
    engine only checks it, its replica compiles), waiting in the threadpool: 400 `invalid_response_format`
    with the grammar engine's message (which names the kind) for a constraint it cannot take or whose
    repetition bounds pass the limit, 400 `response_format_too_complex` when the compile passed its time
    (`timeout_s`, the engine's own limit, named in the message) or memory limit and was stopped, 503
    `overloaded` when no compile worker was free in time. Returns or raises only once the compile it
    started has finished or been killed. `what` names the constraint in messages when it is not the
    request's own (e.g. the schema made of the tools)."""
    if structured is None:
        return
    try:
        await run_in_threadpool(engine.compile_structured, structured)
    except StructuredOutputTooComplex:
        raise ApiError(400, f"the {what or _KINDS[structured.kind]} is too complex to compile within {timeout_s:g} s "
                            "and its memory limit; simplify it (fewer alternatives, smaller bounds, less nesting)",
                       code="response_format_too_complex") from None
    except CompileBusy:
        raise ApiError(503, "the server is busy compiling other structured-output constraints; retry later",
                       retry_after_s=max(1.0, timeout_s), code="overloaded") from None
    except ValueError as exc:  # the grammar engine's StructuredOutputError (a ValueError), written for clients
        message = f"the {what} cannot be enforced ({exc})" if what else str(exc)
        raise ApiError(400, message, code="invalid_response_format") from None


_KINDS = {"json_object": "response_format", "json_schema": "JSON schema", "regex": "regex", "choice": "choice list"}
