"""Reading tool calls out of text that may still be growing: a small JSON scanner for the answer format
(`{"name": ..., "parameters": {...}}`, or an array of those) that reports each call's name and the raw
text of its arguments so far, so a stream can forward argument text as it is generated.

Only the shape is checked here; `loramux.server.tool_calls.parse_calls` checks a finished answer (known
names, arguments that parse as an object).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

_WS = " \t\n\r"
ARGUMENT_KEYS = ("parameters", "arguments")  # ours, and OpenAI's name for the same thing


@dataclass
class PartialCall:
    name: str | None = None  # None until its whole string has been generated
    arguments: str = ""  # raw JSON text of the arguments so far (a prefix of the final text)
    done: bool = False  # the call's object is closed


@dataclass
class Scanned:
    calls: list[PartialCall] = field(default_factory=list)
    complete: bool = False  # the whole answer (object or array) is closed, with nothing after it


def _skip(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _string_end(s: str, i: int) -> int | None:
    """Index just past the JSON string starting at s[i] == '"'; None if it is unfinished."""
    i += 1
    while i < len(s):
        if s[i] == "\\":
            i += 2
        elif s[i] == '"':
            return i + 1
        else:
            i += 1
    return None


def _value_end(s: str, i: int) -> int | None:
    """Index just past the JSON value starting at s[i]; None if it is unfinished."""
    if s[i] == '"':
        return _string_end(s, i)
    if s[i] in "{[":
        depth = 0
        while i < len(s):
            c = s[i]
            if c == '"':
                end = _string_end(s, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    j = i
    while j < len(s) and s[j] not in ",}]" + _WS:
        j += 1
    return j if j < len(s) else None


def _scan_object(s: str, i: int, call: PartialCall) -> int | None | bool:
    """Scan the call object starting at s[i] == "{" into `call`: the index past it, None when the text
    ends inside it, False when it is not the answer format."""
    i += 1
    while True:
        i = _skip(s, i)
        if i >= len(s):
            return None
        if s[i] == "}":
            call.done = True
            return i + 1
        if s[i] == ",":
            i += 1
            continue
        if s[i] != '"':
            return False
        end = _string_end(s, i)
        if end is None:
            return None
        key = json.loads(s[i:end])
        i = _skip(s, end)
        if i >= len(s):
            return None
        if s[i] != ":":
            return False
        i = _skip(s, i + 1)
        if i >= len(s):
            return None
        end = _value_end(s, i)
        if key == "name":
            if s[i] != '"':
                return False
            if end is not None:
                call.name = json.loads(s[i:end])
        elif key in ARGUMENT_KEYS:
            call.arguments = s[i:] if end is None else s[i:end]
        if end is None:
            return None
        i = end


def scan_calls(s: str) -> Scanned | None:
    """The calls in `s` so far, or None when `s` is not (the beginning of) the answer format."""
    out = Scanned()
    i = _skip(s, 0)
    if i == len(s):
        return out
    array = s[i] == "["
    if array:
        i += 1
    while True:
        i = _skip(s, i)
        if i >= len(s):
            return out
        if array and s[i] == ",":
            i += 1
            continue
        if array and s[i] == "]":
            if _skip(s, i + 1) != len(s):
                return None
            out.complete = True
            return out
        if s[i] != "{":
            return None
        call = PartialCall()
        out.calls.append(call)
        end = _scan_object(s, i, call)
        if end is False:
            return None
        if end is None:
            return out
        i = end
        if not array:
            out.complete = _skip(s, i) == len(s)
            return out if out.complete else None
