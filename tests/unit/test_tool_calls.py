"""Tool calling without a server: the request's tools as a plan, the prompt they make, reading calls out of
finished and growing text, and the stream deltas the official `openai` client accumulates."""
from __future__ import annotations

import json

import pytest
from openai.lib.streaming.chat._completions import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from loramux.server.intake.params import ChatMessage
from loramux.server.intake.tool_calls import (
    NamedToolChoice,
    Tool,
    ToolError,
    parse_calls,
    plan_tools,
    template_messages,
)
from loramux.server.intake.tool_scan import scan_calls
from loramux.server.routes.chat_stream import ChoiceStream, may_be_call

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city"]}
TOOLS = [Tool.model_validate({"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                                                "parameters": WEATHER}}),
         Tool.model_validate({"type": "function", "function": {"name": "now"}})]


def named(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


def test_plans_and_their_schemas():
    assert plan_tools(None, None, True) is None and plan_tools(TOOLS, "none", True) is None
    auto = plan_tools(TOOLS, None, True)
    assert auto.forced is None and auto.parallel and auto.names == ["get_weather", "now"]
    one = plan_tools(TOOLS, named("get_weather"), True)
    assert not one.parallel  # a named call is one call
    assert one.answer_schema() == {"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                                   "properties": {"name": {"enum": ["get_weather"]}, "parameters": WEATHER}}
    required = plan_tools(TOOLS, "required", True).answer_schema()
    assert required["type"] == "array" and (required["minItems"], required["maxItems"]) == (1, 8)
    assert len(required["items"]["anyOf"]) == 2
    assert required["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    single = plan_tools(TOOLS[:1], "required", False).answer_schema()
    assert single["properties"]["name"] == {"enum": ["get_weather"]}
    # The call schema lists the name before the parameters (order is kept): a stream can announce a call first.
    spec = plan_tools(TOOLS[:1], "required", False).structured().spec
    assert spec.index('"name"') < spec.index('"parameters"')


@pytest.mark.parametrize(("tools", "choice", "needle"), [
    (TOOLS, named("nope"), "tool_choice names the function 'nope', which is not in tools; use one of: get_weather"),
    (None, "required", "the request has no tools"),
    ([TOOLS[0], TOOLS[0]], None, "used twice"),
    ([Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}})], None,
     "parameters must be a JSON schema of an object"),
])
def test_bad_tools_say_what_to_fix(tools, choice, needle):
    with pytest.raises(ToolError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        plan_tools(tools, choice, True)


def test_system_prompt_lists_tools_and_the_format():
    prompt = plan_tools(TOOLS, named("now"), True).system_prompt()
    assert '"name": "get_weather"' in prompt and json.dumps(WEATHER) in prompt
    assert '{"name": "<function name>", "parameters": {<its arguments>}}' in prompt
    assert "You must call the function now now." in prompt and "array" not in prompt
    assert "array" in plan_tools(TOOLS, None, True).system_prompt()


def test_messages_with_calls_and_results_render_for_both_kinds_of_template():
    messages = [ChatMessage(role="user", content="Weather in Oslo?"),
                ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}),
                ChatMessage(role="tool", tool_call_id="call_1", content="sunny")]
    plain = template_messages(messages, native=False)
    assert plain[1] == {"role": "assistant", "content": '{"name": "get_weather", "parameters": {"city": "Oslo"}}'}
    assert plain[2] == {"role": "user", "content": "Result of the call call_1 of get_weather: sunny"}
    native = template_messages(messages, native=True)
    assert native[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert native[2] == {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"}
    with pytest.raises(ValueError, match="tool_call_id"):
        ChatMessage(role="tool", content="x")
    bad = ChatMessage.model_validate({"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]})
    with pytest.raises(ToolError, match="not JSON"):
        template_messages([bad], native=False)


@pytest.mark.parametrize(("text", "expected"), [
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', [("get_weather", '{"city": "Oslo"}')]),
    ('  {"parameters": {}, "name": "now"}\n', [("now", "{}")]),
    ('```json\n{"name": "now", "arguments": "{\\"a\\": 1}"}\n```', [("now", '{"a": 1}')]),
    ('<tool_call>{"name": "now", "arguments": {}}</tool_call>', [("now", "{}")]),
    ('[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "x}{"}}]',
     [("now", "{}"), ("get_weather", '{"city": "x}{"}')]),
    ('{"name": "unknown", "parameters": {}}', None),
    ('{"name": "now", "parameters": [1]}', None),
    ('{"name": "now", "parameters": {}', None),  # unfinished
    ('{"name": "now", "parameters": {}} and more', None),
    ("It is sunny.", None),
])
def test_finished_answers_parse_as_calls_or_not(text, expected):
    calls = parse_calls(text, plan_tools(TOOLS, None, True))
    if expected is None:
        assert calls is None
        return
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == expected
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 and c["type"] == "function" for c in calls)
    if len(expected) > 1:  # without parallel calls only the first is kept
        assert len(parse_calls(text, plan_tools(TOOLS, None, False))) == 1


def test_scanning_growing_text_reports_argument_prefixes():
    final = '[{"name": "get_weather", "parameters": {"city": "Os\\"lo", "days": 3}}, {"name": "now", "parameters": {}}]'
    previous = ""
    for end in range(len(final) + 1):
        scanned = scan_calls(final[:end])
        assert scanned is not None, final[:end]
        if scanned.calls and scanned.calls[0].arguments:
            assert final.find(scanned.calls[0].arguments) > 0  # a prefix of the final argument text
            assert scanned.calls[0].arguments.startswith(previous)
            previous = scanned.calls[0].arguments
    assert scanned.complete and [c.name for c in scanned.calls] == ["get_weather", "now"]
    assert scan_calls("Hello") is None and scan_calls('{"name": 3') is None


def _accumulate(deltas_by_choice: list[list[tuple[dict, list | None]]], reasons: list[str]):
    """Feed the deltas through the official client's own stream accumulator; return its final completion."""
    state = ChatCompletionStreamState()
    base = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    for i, deltas in enumerate(deltas_by_choice):
        state.handle_chunk(ChatCompletionChunk.model_validate(
            {**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}}]}))
        for delta, _ in deltas:
            state.handle_chunk(ChatCompletionChunk.model_validate({**base, "choices": [{"index": i, "delta": delta}]}))
        state.handle_chunk(ChatCompletionChunk.model_validate(
            {**base, "choices": [{"index": i, "delta": {}, "finish_reason": reasons[i]}]}))
    return state.get_final_completion()


def _feed(stream: ChoiceStream, text: str, step: int) -> list:
    deltas = []
    for start in range(0, len(text), step):
        deltas += stream.feed(text[start:start + step], None)
    return deltas + stream.finish()


def test_forced_calls_stream_name_first_then_argument_pieces_and_the_client_accumulates_them():
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}, {"name": "now", "parameters": {}}]'
    stream = ChoiceStream(plan_tools(TOOLS, "required", True))
    deltas = _feed(stream, text, 3)
    assert stream.tool_calls
    first = deltas[0][0]["tool_calls"][0]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["function"] == {
        "name": "get_weather", "arguments": ""}
    pieces = [d["tool_calls"][0]["function"]["arguments"] for d, _ in deltas
              if d["tool_calls"][0]["index"] == 0 and "name" not in d["tool_calls"][0]["function"]]
    assert len(pieces) > 3 and "".join(pieces) == '{"city": "Oslo", "days": 2}'
    completion = _accumulate([deltas], ["tool_calls"])
    calls = completion.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo", "days": 2}
    assert completion.choices[0].message.content in (None, "")


def test_auto_holds_back_json_until_it_knows_and_streams_prose_at_once():
    plan = plan_tools(TOOLS, None, True)
    prose = ChoiceStream(plan)
    assert prose.feed("  ", None) == [] and prose.feed("It is", ["lp"]) == [({"content": "  It is"}, ["lp"])]
    assert prose.feed(" sunny", None) == [({"content": " sunny"}, None)] and prose.finish() == []
    call = ChoiceStream(plan)
    assert call.feed('{"name": "now", ', None) == [] and call.feed('"parameters": {}}', None) == []
    deltas = call.finish()
    assert call.tool_calls and _accumulate([deltas], ["tool_calls"]).choices[0].message.tool_calls[0].function.name \
        == "now"
    not_a_call = ChoiceStream(plan)
    assert not_a_call.feed('{"weather": 1}', None) == []
    assert not_a_call.finish() == [({"content": '{"weather": 1}'}, None)] and not not_a_call.tool_calls
    assert may_be_call("") and may_be_call(" [") and may_be_call("``") and may_be_call("<tool")
    assert not may_be_call("Sure") and not may_be_call("`x")


class _Engine:
    """What the prompt and compile helpers need of an EngineClient."""

    def __init__(self, tokenizer=None, compile_structured=None):
        self.tokenizer = tokenizer
        if compile_structured is not None:
            self.compile_structured = compile_structured

    def encode_chat(self, messages, tools=None):
        from loramux.engine.tokens import chat_template_ids

        return chat_template_ids(self.tokenizer, messages, tools)


def test_a_template_that_takes_tools_renders_them_itself(tokenizer):
    import asyncio
    import copy

    from loramux.engine.tokens import template_takes_tools
    from loramux.server.intake.prompts import tokenize_chat

    assert not template_takes_tools(tokenizer)  # SmolLM2's template knows no tools
    tooled = copy.deepcopy(tokenizer)
    tooled.chat_template = ("{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}{% for m in messages %}"
                            "{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %} CALL {{ c.function.name }}"
                            "{% endfor %}\n{% endfor %}assistant:")
    engine = _Engine(tooled)
    assert template_takes_tools(tooled)
    messages = template_messages([ChatMessage(role="user", content="Weather?"), ChatMessage.model_validate(
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": "{}"}}]}),
        ChatMessage(role="tool", tool_call_id="c1", content="rain")], native=True)
    ids = asyncio.run(tokenize_chat(engine, messages, [t.model_dump(exclude_none=True) for t in TOOLS]))
    text = tooled.decode(ids)
    assert text.startswith("TOOLS [") and '"name": "get_weather"' in text and "CALL get_weather" in text
    assert "tool: rain" in text and text.endswith("assistant:")


def test_a_compile_that_takes_too_long_is_a_400_and_a_bad_spec_a_400_with_its_message():
    import asyncio

    from loramux.engine.sampling.params import StructuredOutput
    from loramux.engine.structured.grammar import StructuredOutputTooComplex
    from loramux.server.http.errors import ApiError
    from loramux.server.intake.response_format import compile_structured

    def stopped(spec):  # the engine stopped the compile at its time limit (see tests/http/test_compile_bounds.py)
        raise StructuredOutputTooComplex("response_format json_schema: too complex to compile")

    with pytest.raises(ApiError, match=r"JSON schema is too complex to compile within 0.05 s") as info:
        asyncio.run(compile_structured(_Engine(compile_structured=stopped), StructuredOutput("json_schema", "{}"),
                                       0.05))
    assert info.value.status == 400 and info.value.code == "response_format_too_complex"

    def refuse(spec):
        raise ValueError("response_format json_schema: unknown type 'nope'")

    with pytest.raises(ApiError, match="the tools' parameters schema cannot be enforced .*unknown type") as info:
        asyncio.run(compile_structured(_Engine(compile_structured=refuse), StructuredOutput("json_schema", "{}"), 1,
                                       "tools' parameters schema"))
    assert info.value.status == 400 and info.value.code == "invalid_response_format"
    asyncio.run(compile_structured(_Engine(), None, 1))  # nothing to compile
