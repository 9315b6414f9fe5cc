"""One choice of a streamed chat completion: text deltas in, `chat.completion.chunk` deltas out.

Without tools a delta is content. With tools, a forced call is streamed as OpenAI does: per call one
delta with its index, id, type and function name (arguments ""), then the argument text in pieces as it
is generated; the official `openai` client accumulates these by index. With `tool_choice` "auto" the model
decides, so text that may still turn out to be a call (it starts like JSON) is held back until it either
stops looking like one (then it goes out as content) or the choice ends (then it is a call, or content).

Each delta costs O(its length): the call is read by a `CallScanner` that keeps its place, only the
beginning of the text decides whether it may be a call, and the text is joined once, at the end.
"""
from __future__ import annotations

from loramux.server.intake.tool_calls import ToolPlan, new_call_id, parse_calls
from loramux.server.intake.tool_scan import CallScanner, Scanned

Delta = tuple[dict, list | None]  # (the chunk's `delta`, the chunk's logprobs `content` entries or None)


HEAD_CHARS = 11  # the beginning that decides whether an answer may be a call: len("<tool_call>")


def may_be_call(text: str) -> bool:
    """Whether a growing answer can still be a tool call in the answer format (maybe wrapped)."""
    head = text.lstrip()[:HEAD_CHARS]
    return not head or head[0] in "{[" or any(head.startswith(w) or w.startswith(head) for w in ("```", "<tool_call>"))


class ChoiceStream:
    """The deltas of one choice; `finish()` once it ended tells (`tool_calls`) how it answered."""

    def __init__(self, plan: ToolPlan | None):
        self.plan = plan
        self.mode = "content" if plan is None else ("call" if plan.forced else "maybe")
        self._pieces: list[str] = []  # the text so far, joined once when asked for
        self._head = ""  # its first HEAD_CHARS characters after leading whitespace
        self._scanner = CallScanner()
        self._held: list[Delta] = []  # content held back while it may be a call
        self._sent: list[list] = []  # per call announced: [its id, argument characters sent]
        self.tool_calls = False

    @property
    def text(self) -> str:
        """The whole text of the choice so far."""
        text = "".join(self._pieces)
        self._pieces = [text] if text else []
        return text

    def feed(self, delta: str, logprobs: list | None) -> list[Delta]:
        self._pieces.append(delta)
        if len(self._head) < HEAD_CHARS:
            self._head = (self._head + delta).lstrip()[:HEAD_CHARS] if delta else self._head
        if self.mode == "content":
            return [({"content": delta}, logprobs)] if delta or logprobs else []
        self._held.append(({"content": delta}, logprobs))
        if self.mode == "maybe":
            return [] if may_be_call(self._head) else self._as_content()
        scanned = self._scanner.feed(delta)
        if scanned is None:  # a forced call that is not one (the grammar would not allow it): plain content
            return self._as_content() if not self._sent else []
        return self._call_deltas(scanned)

    def finish(self) -> list[Delta]:
        """The deltas still due once the choice ended."""
        if self.mode == "content":
            return []
        calls = parse_calls(self.text, self.plan)
        self.tool_calls = calls is not None
        if self.mode == "call":
            scanned = self._scanner.scanned
            return self._call_deltas(scanned) if scanned is not None else []
        if calls is None:
            return self._as_content()
        deltas = []
        for k, call in enumerate(calls):
            fn = call["function"]
            deltas.append(({"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                            "function": {"name": fn["name"], "arguments": ""}}]}, None))
            deltas.append(({"tool_calls": [{"index": k, "function": {"arguments": fn["arguments"]}}]}, None))
        return deltas

    def _as_content(self) -> list[Delta]:
        self.mode = "content"
        held, self._held = self._held, []
        text = "".join(d["content"] for d, _ in held)
        logprobs = [e for _, lp in held for e in (lp or [])]
        return [({"content": text}, logprobs or None)] if text or logprobs else []

    def _call_deltas(self, scanned: Scanned) -> list[Delta]:
        self._held.clear()
        deltas = []
        first = max(0, len(self._sent) - 1)  # the calls before the last one announced are closed and all sent
        for k, call in enumerate(scanned.calls[first:], first):
            if call.name is None:  # the name comes first: nothing of this call (or later ones) yet
                break
            if k == len(self._sent):
                self._sent.append([new_call_id(), 0])
                deltas.append(({"tool_calls": [{"index": k, "id": self._sent[k][0], "type": "function",
                                                "function": {"name": call.name, "arguments": ""}}]}, None))
            sent = self._sent[k]
            if call.arguments_length > sent[1]:
                deltas.append(({"tool_calls": [{"index": k, "function": {"arguments": call.arguments_since(sent[1])}}]},
                               None))
                sent[1] = call.arguments_length
        return deltas
