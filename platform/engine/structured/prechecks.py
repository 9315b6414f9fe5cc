"""Cheap checks of a `StructuredOutput` before anything compiles it: size, JSON-schema keywords xgrammar
would not enforce, nesting depth, and repetition bounds. No xgrammar, no tokenizer: the Ray ingress runs
them locally, the engine runs them before handing a spec to a compile worker.

Repetition bounds are refused above `max_repetition` (LORAMUX_STRUCTURED_MAX_REPETITION): a regex
quantifier `{m}`, `{m,}`, `{m,n}` (in a regex, or a schema's `pattern`), and the schema counts
minLength / maxLength / minItems / maxItems / minProperties / maxProperties. Compile cost and memory
grow with them; the scan is conservative (a `{m,n}` inside a character class counts too). Bounds that
multiply through nesting (`(a{1,99}){1,99}`) are left to the compile's time and memory limits.
"""
from __future__ import annotations

import json
import re

from loramux.engine.sampling.params import StructuredOutput

__all__ = ["MAX_SPEC_BYTES", "LABELS", "StructuredOutputError", "check_spec", "choice_grammar"]

MAX_SPEC_BYTES = 64 * 1024  # a schema, regex or choice list larger than this is refused
_MAX_SCHEMA_DEPTH = 64  # nesting of schema objects (the converter recurses)
# Keywords xgrammar 0.2 accepts but does not enforce (or enforces wrongly); outputs could violate them.
_UNSUPPORTED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "contains", "minContains",
                "maxContains", "patternProperties", "uniqueItems", "$dynamicRef", "$recursiveRef")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_QUANTIFIER = re.compile(r"\{(\d+)(?:,(\d*))?\}")
LABELS = {"json_object": "response_format json_object", "json_schema": "response_format json_schema",
          "regex": "structured output regex", "choice": "structured output choice"}


class StructuredOutputError(ValueError):
    """A structured-output spec that cannot be enforced (invalid, unsupported or too large); the message
    names the kind and what is wrong, without internals, fit to return to the user (HTTP 400)."""


def check_spec(spec: StructuredOutput, max_repetition: int) -> None:
    """Raise StructuredOutputError for a spec refused without compiling it."""
    label = LABELS[spec.kind]
    size = len(spec.spec.encode())
    if size > MAX_SPEC_BYTES:
        raise StructuredOutputError(f"{label}: the spec is {size} bytes; at most {MAX_SPEC_BYTES} are accepted")
    if spec.kind == "json_schema":
        _walk(_parse_schema(spec.spec, label), 0, label, max_repetition)
    elif spec.kind == "regex":
        if not spec.spec:
            raise StructuredOutputError(f"{label}: the pattern is empty")
        _check_quantifiers(spec.spec, label, "the repetition", max_repetition)
    elif spec.kind == "choice":
        choice_grammar(spec.spec)


def choice_grammar(text: str) -> str:
    """EBNF accepting exactly one of the JSON list of strings `text`: each a JSON string literal, whose
    escapes xgrammar's EBNF shares."""
    label = LABELS["choice"]
    try:
        choices = json.loads(text)
    except ValueError:
        raise StructuredOutputError(f"{label}: the choices must be a JSON list of strings") from None
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise StructuredOutputError(f"{label}: the choices must be a list of strings")
    if not choices:
        raise StructuredOutputError(f"{label}: the list of choices is empty")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))


def _parse_schema(text: str, label: str) -> dict:
    try:
        schema = json.loads(text)
    except RecursionError:
        raise StructuredOutputError(f"{label}: the schema is nested too deeply") from None
    except ValueError as exc:
        raise StructuredOutputError(f"{label}: the schema is not valid JSON ({exc})") from None
    if not isinstance(schema, dict):
        raise StructuredOutputError(f"{label}: the schema must be a JSON object, got {type(schema).__name__}")
    return schema


def _walk(schema, depth: int, label: str, max_repetition: int) -> None:
    """Raise StructuredOutputError unless `schema` (and every subschema) is one xgrammar enforces in full,
    within the repetition bound."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise StructuredOutputError(f"{label}: a subschema must be an object or a boolean, got "
                                    f"{json.dumps(schema)[:80]}")
    if depth > _MAX_SCHEMA_DEPTH:
        raise StructuredOutputError(f"{label}: the schema is nested more than {_MAX_SCHEMA_DEPTH} levels deep")
    for key in _UNSUPPORTED:
        if key in schema and not (key == "uniqueItems" and schema[key] is False):
            raise StructuredOutputError(f"{label}: unsupported keyword {key!r}")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        raise StructuredOutputError(f"{label}: unsupported keyword 'allOf' with more than one subschema")
    for key in _COUNTS:
        value = schema.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > max_repetition:
            raise StructuredOutputError(f"{label}: {key} {value:g} exceeds the limit of {max_repetition} "
                                        "(LORAMUX_STRUCTURED_MAX_REPETITION)")
    if isinstance(schema.get("pattern"), str):
        _check_quantifiers(schema["pattern"], label, "the pattern's repetition", max_repetition)
    children = []
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            children += schema[key].values()
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            children += schema[key]
    for key in _SUBSCHEMAS:
        if key in schema:
            value = schema[key]
            children += value if key == "items" and isinstance(value, list) else [value]
    for child in children:
        _walk(child, depth + 1, label, max_repetition)


def _check_quantifiers(pattern: str, label: str, what: str, max_repetition: int) -> None:
    i = 0
    while i < len(pattern):
        if pattern[i] == "\\":  # an escaped character (e.g. a literal brace) is no quantifier
            i += 2
            continue
        if pattern[i] == "{" and (m := _QUANTIFIER.match(pattern, i)):
            largest = max(int(n) for n in m.groups() if n)
            if largest > max_repetition:
                raise StructuredOutputError(f"{label}: {what} {m.group(0)} exceeds the limit of {max_repetition} "
                                            "(LORAMUX_STRUCTURED_MAX_REPETITION)")
            i = m.end()
            continue
        i += 1
