"""Streaming a tool call costs O(its length): each delta is scanned once, where rescanning the whole text
per delta made a long call quadratic (a hostile shape: a tenant asks for huge arguments in tiny deltas).
The work is counted as Python lines executed in the streaming modules, whatever their implementation, so
the test holds the growth, not a wall time."""
from __future__ import annotations

import json
import random
import sys

import pytest

from loramux.server.intake.tool_calls import Tool, plan_tools
from loramux.server.routes.chat_stream import ChoiceStream

TOOLS = [Tool.model_validate({"type": "function", "function": {"name": "write", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}}}})]
STREAMING_FILES = ("chat_stream.py", "tool_scan.py")


def call_text(chars: int) -> str:
    """A forced call whose arguments hold about `chars` characters (strings, escapes, nesting)."""
    items = ", ".join(json.dumps({"k": f"v\"{i}\\n", "n": [i, {"x": "]}"}]}) for i in range(chars // 30 + 1))
    return json.dumps({"name": "write", "parameters": {"items": "PLACEHOLDER"}}).replace('"PLACEHOLDER"', f"[{items}]")


def lines_executed(text: str, delta_chars: int, tool_choice) -> tuple[int, list]:
    """Lines run in the streaming modules while `text` streams in `delta_chars` pieces, and the deltas."""
    stream = ChoiceStream(plan_tools(TOOLS, tool_choice, True))
    counted = [0]

    def tracer(frame, event, arg):
        if not frame.f_code.co_filename.endswith(STREAMING_FILES):
            return None

        def lines(frame, event, arg):
            if event == "line":
                counted[0] += 1
            return lines
        return lines(frame, event, arg)

    deltas = []
    sys.settrace(tracer)
    try:
        for start in range(0, len(text), delta_chars):
            deltas += stream.feed(text[start:start + delta_chars], None)
        deltas += stream.finish()
    finally:
        sys.settrace(None)
    return counted[0], deltas


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_streaming_a_call_costs_linear_work_in_its_length(tool_choice):
    short, long = call_text(1000), call_text(2000)
    assert 1.8 < len(long) / len(short) < 2.2
    work_short, deltas = lines_executed(short, 2, tool_choice)
    work_long, _ = lines_executed(long, 2, tool_choice)
    assert work_long < 2.6 * work_short, (work_short, work_long)  # quadratic would be about 4x
    arguments = "".join(d["tool_calls"][0]["function"].get("arguments", "") for d, _ in deltas if "tool_calls" in d)
    assert json.loads(arguments) == json.loads(short)["parameters"]


def test_the_scanner_examines_each_character_about_once():
    from loramux.server.intake.tool_scan import CallScanner

    text = call_text(20_000)
    scanner = CallScanner()
    for start in range(0, len(text), 3):
        scanned = scanner.feed(text[start:start + 3])
    assert scanned.complete and scanned.calls[0].name == "write"
    assert scanner.chars_scanned <= 2 * len(text)


CORPUS = [
    '[{"name": "get_weather", "parameters": {"city": "Os\\"lo", "days": 3}}, {"name": "now", "parameters": {}}]',
    '{"name": "a", "arguments": "{\\"x\\": 1}"}', '  {"name":"n","parameters":12 , "parameters" : [1,{"a":"]"}]}  ',
    '[,{"parameters": }, {"name": "x" "parameters": true}]', '{"name": "x"} extra', '{"na\\u006de": "q", "o": "\\q"}',
    '{"name": "bad \\q"}', "plain text", '[{"name": "x", "parameters": {}}] ]',
]


def view(scanned):
    return None if scanned is None else (scanned.complete, [(c.name, c.arguments, c.done) for c in scanned.calls])


def test_fed_in_pieces_the_scanner_answers_what_one_scan_of_the_text_so_far_answers():
    from loramux.server.intake.tool_scan import CallScanner, scan_calls

    rng = random.Random(5)
    alphabet = list('{}[]",:\\ nx1\n') + ['"name"', '"parameters"', '"arguments"']
    for trial in range(3000):
        text = list(CORPUS[trial % len(CORPUS)])
        for _ in range(rng.randint(0, 3) if trial >= len(CORPUS) else 0):
            text.insert(rng.randrange(len(text) + 1), rng.choice(alphabet))
        text = "".join(text)
        scanner, end = CallScanner(), 0
        while end < len(text):
            step = rng.randint(1, 6)
            got = view(scanner.feed(text[end:end + step]))
            end += step
            assert got == view(scan_calls(text[:end])), (text, end)


def test_arguments_since_reads_only_the_new_end():
    from loramux.server.intake.tool_scan import CallScanner

    scanner = CallScanner()
    for piece in ('{"name": "w", "parameters": {"a"', ': "bc', 'd"', "}}"):
        scanner.feed(piece)
    call = scanner.scanned.calls[0]
    assert call.arguments == '{"a": "bcd"}' and call.arguments_length == 12
    assert [call.arguments_since(k) for k in (0, 5, 12)] == ['{"a": "bcd"}', ' "bcd"}', ""]
