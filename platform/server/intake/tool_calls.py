"""Tool (function) calling for chat completions: the request's tools, how they reach the prompt, the
grammar of a forced call, and reading calls back out of the model's text. Free of HTTP types.

The answer format the model is asked for (and held to, when a call is forced) is JSON:
`{"name": "<function>", "parameters": {<arguments>}}`, or with parallel calls a JSON array of those.
The call schema lists "name" before "parameters" (the grammar keeps the schema's key order), so a stream
can announce the call before its arguments arrive. A tokenizer whose chat template takes `tools`
renders them itself (`apply_chat_template(..., tools=...)`); for other templates (SmolLM2's) the tools
go into the system message as JSON, with the answer format.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from loramux.engine.sampling.params import StructuredOutput
from loramux.server.http.bodies import RequestBody
from loramux.server.intake.params import ChatMessage, MessageToolCall
from loramux.server.intake.response_format import schema_output
from loramux.server.intake.tool_scan import scan_calls

MAX_TOOLS = 128
# Most calls in one answer with parallel calls: a model that loops (small ones do) cannot run on with calls.
MAX_PARALLEL_CALLS = 8
_NO_PARAMETERS = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """Tools, a tool choice or tool messages a request cannot use; the message says what to fix (a 400)."""


class FunctionDefinition(RequestBody):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="letters, digits, _ and -, at most 64")
    description: str | None = Field(default=None, description="what the function does, for the model")
    parameters: dict[str, Any] | None = Field(
        default=None, description='a JSON schema of the arguments, an object ({"type": "object", ...}); '
                                  "omitted: no arguments")
    strict: bool | None = Field(default=None, description="accepted; a forced call always follows the schema")


class Tool(RequestBody):
    type: Literal["function"] = Field(description='"function"')
    function: FunctionDefinition


class NamedFunction(RequestBody):
    name: str


class NamedToolChoice(RequestBody):
    """Force a call of this function."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolPlan:
    """The tools a request offers and whether a call is forced: `forced` None (auto: the model decides,
    its text is read as a call if it is one), "required" (some call) or a function's name (that call)."""

    tools: tuple[Tool, ...]
    forced: str | None
    parallel: bool

    @property
    def names(self) -> list[str]:
        return [t.function.name for t in self.tools]

    def _call_schema(self, tool: Tool) -> dict:
        return {"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                "properties": {"name": {"enum": [tool.function.name]},
                               "parameters": tool.function.parameters or _NO_PARAMETERS}}

    def answer_schema(self) -> dict:
        """The JSON schema of an answer that calls tools: one call of the named function; with "required"
        (or auto, for checking the tools) a call of any, or with parallel calls an array of 1 to
        MAX_PARALLEL_CALLS of them."""
        if self.forced not in (None, "required"):
            return self._call_schema(next(t for t in self.tools if t.function.name == self.forced))
        calls = [self._call_schema(t) for t in self.tools]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS} if self.parallel else one

    def structured(self) -> StructuredOutput:
        return schema_output(self.answer_schema())

    def system_prompt(self) -> str:
        """The tools and the answer format, for a system message (templates without tool support)."""
        listed = "\n".join(json.dumps({"name": t.function.name, "description": t.function.description or "",
                                       "parameters": t.function.parameters or _NO_PARAMETERS}, ensure_ascii=False)
                           for t in self.tools)
        several = (f" To make several calls at once (at most {MAX_PARALLEL_CALLS}), answer with a JSON array of such "
                   "objects.") if self.parallel else ""
        if self.forced is None:
            when = "Otherwise, answer in plain text."
        elif self.forced == "required":
            when = "You must call at least one function now."
        else:
            when = f"You must call the function {self.forced} now."
        return ("You can call these functions (each line: its name, what it does and a JSON schema of its "
                f"parameters):\n{listed}\nTo call a function, answer with JSON only: "
                '{"name": "<function name>", "parameters": {<its arguments>}}.' f"{several} {when}")


def plan_tools(tools: list[Tool] | None, tool_choice: ToolChoice | None, parallel: bool) -> ToolPlan | None:
    """The request's ToolPlan (None: no tool calling); ToolError for tools the model cannot be given."""
    if isinstance(tool_choice, NamedToolChoice):
        forced: str | None = tool_choice.function.name
    else:
        forced = "required" if tool_choice == "required" else None
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("tool_choice forces a tool call, but the request has no tools: add them to `tools`")
        return None
    if tool_choice == "none":
        return None
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"at most {MAX_TOOLS} tools per request, got {len(tools)}")
    seen = set()
    for i, tool in enumerate(tools):
        fn = tool.function
        if fn.name in seen:
            raise ToolError(f"tools[{i}]: the function name {fn.name!r} is used twice; names must be unique")
        seen.add(fn.name)
        kind = (fn.parameters or {}).get("type", "object")
        if kind != "object":
            raise ToolError(f"tools[{i}] ({fn.name}): parameters must be a JSON schema of an object "
                            f'({{"type": "object", "properties": {{...}}}}), not of type {kind!r}')
    if forced not in (None, "required") and forced not in seen:
        raise ToolError(f"tool_choice names the function {forced!r}, which is not in tools; "
                        f"use one of: {', '.join(sorted(seen))}")
    return ToolPlan(tuple(tools), forced, parallel and forced in (None, "required"))


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def answer_text(calls: list[MessageToolCall]) -> str:
    """Calls an assistant made, written in the answer format (how the model is asked to write them)."""
    written = [{"name": c.function.name, "parameters": _arguments(c)} for c in calls]
    return json.dumps(written[0] if len(written) == 1 else written, ensure_ascii=False)


def _arguments(call: MessageToolCall):
    try:
        return json.loads(call.function.arguments)
    except (ValueError, RecursionError):  # a string is not depth-scanned at intake: `[[[...` nests past the stack
        raise ToolError(f"the tool call {call.id!r} of an assistant message has arguments that are not JSON: "
                        "send them as JSON text, e.g. \"{\\\"city\\\": \\\"Paris\\\"}\"") from None


def template_messages(messages: list[ChatMessage], native: bool) -> list[dict]:
    """The messages as the chat template takes them. With `native` (a template that takes tools) in the
    Hugging Face shape: assistant `tool_calls` with parsed arguments and `tool` messages; otherwise an
    assistant's calls become its text in the answer format and a tool result becomes a user message that
    names the call (templates without tool support often refuse unknown roles)."""
    names: dict[str, str] = {}
    out = []
    for m in messages:
        if m.role == "assistant" and m.tool_calls:
            names.update({c.id: c.function.name for c in m.tool_calls})
            if native:
                out.append({"role": "assistant", "content": m.text(), "tool_calls": [
                    {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                  "arguments": _arguments(c)}}
                    for c in m.tool_calls]})
            else:
                out.append({"role": "assistant", "content": "\n".join(filter(None, (m.text(),
                                                                                   answer_text(m.tool_calls))))})
        elif m.role == "tool":
            name = names.get(m.tool_call_id, "a function")
            if native:
                out.append({"role": "tool", "tool_call_id": m.tool_call_id, "name": name, "content": m.text()})
            else:
                out.append({"role": "user", "content": f"Result of the call {m.tool_call_id} of {name}: {m.text()}"})
        else:
            out.append(m.as_template_message())
    return out


def with_tool_prompt(messages: list[dict], plan: ToolPlan) -> list[dict]:
    """`messages` with the tools' system prompt: added to the first system message, or as a new one."""
    prompt = plan.system_prompt()
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


_WRAPPERS = (re.compile(r"^<tool_call>(.*?)</tool_call>$", re.S), re.compile(r"^```(?:json)?\s*(.*?)```$", re.S))


def parse_calls(text: str, plan: ToolPlan) -> list[dict] | None:
    """The tool calls in a finished answer, in OpenAI's shape (`{"id", "type": "function", "function":
    {"name", "arguments": JSON text}}`), or None when the text is not a complete call of offered tools.
    Also reads OpenAI-style `"arguments"` (an object or JSON text) and a call wrapped in a code fence or
    `<tool_call>` tags. Without parallel calls only the first call is kept."""
    body = text.strip()
    for wrapper in _WRAPPERS:
        found = wrapper.match(body)
        if found:
            body = found.group(1).strip()
    scanned = scan_calls(body)
    if scanned is None or not scanned.complete or not scanned.calls:
        return None
    calls = []
    for call in scanned.calls:
        if call.name not in plan.names:
            return None
        try:
            arguments = json.loads(call.arguments or "{}")
            if isinstance(arguments, str):
                call.arguments, arguments = arguments, json.loads(arguments)
        except (ValueError, RecursionError):  # the model's text may nest past the parser's stack
            return None
        if not isinstance(arguments, dict):
            return None
        calls.append({"id": new_call_id(), "type": "function",
                      "function": {"name": call.name, "arguments": call.arguments or "{}"}})
    return calls[:MAX_PARALLEL_CALLS] if plan.parallel else calls[:1]
