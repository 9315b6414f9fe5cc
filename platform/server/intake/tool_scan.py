"""Reading tool calls out of text that may still be growing: a small JSON scanner for the answer format
(`{"name": ..., "parameters": {...}}`, or an array of those) that reports each call's name and the raw
text of its arguments so far, so a stream can forward argument text as it is generated.

`CallScanner` is fed the text piece by piece and keeps its place between pieces, so a stream of n
characters costs O(n) in all, whatever the number or size of its deltas (rescanning the whole text per
delta made long calls quadratic). `scan_calls(text)` scans a whole text at once.

Only the shape is checked here; `loramux.server.intake.tool_calls.parse_calls` checks a finished answer (known
names, arguments that parse as an object).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

_WS = frozenset(" \t\n\r")
_PRIMITIVE_END = frozenset(",}]") | _WS  # what ends a number, true, false or null
ARGUMENT_KEYS = ("parameters", "arguments")  # ours, and OpenAI's name for the same thing


@dataclass
class PartialCall:
    name: str | None = None  # None until its whole string has been generated
    done: bool = False  # the call's object is closed
    # The raw JSON text of the arguments so far (a prefix of the final text), in the pieces it came in:
    # appending is O(piece), and `arguments_since` reads the new end without joining the whole text.
    _parts: list[str] = field(default_factory=list, repr=False)
    _length: int = field(default=0, repr=False)

    @property
    def arguments(self) -> str:
        text = "".join(self._parts)
        self._parts = [text] if text else []
        return text

    @arguments.setter
    def arguments(self, text: str) -> None:
        self._parts, self._length = ([text] if text else []), len(text)

    @property
    def arguments_length(self) -> int:
        return self._length

    def arguments_since(self, start: int) -> str:
        """The argument text after its first `start` characters (costs what it returns, not the whole text)."""
        pieces, covered = [], self._length
        for part in reversed(self._parts):
            if covered <= start:
                break
            pieces.append(part)
            covered -= len(part)
        return "".join(reversed(pieces))[start - covered:]

    def _append_arguments(self, text: str) -> None:
        if text:
            self._parts.append(text)
            self._length += len(text)


@dataclass
class Scanned:
    calls: list[PartialCall] = field(default_factory=list)
    complete: bool = False  # the whole answer (object or array) is closed, with nothing after it


# Where the scanner is. Between values: _START (nothing yet), _ITEMS (in the array, between calls), _KEY
# (in a call object, before a key or its end), _COLON (after a key), _VALUE (after the colon), _TRAIL
# (the answer is closed). Inside a value: _STRING, _NESTED (an object or array), _PRIMITIVE.
_START, _ITEMS, _KEY, _KEY_STRING, _COLON, _VALUE, _STRING, _NESTED, _PRIMITIVE, _TRAIL, _DEAD = range(11)


class CallScanner:
    """What `scan_calls` answers for all the text fed so far, kept up to date one piece at a time.

    `feed(piece)` returns the same `Scanned` object each time (its calls are updated in place), or None
    once the text cannot be (the beginning of) the answer format; it stays None from then on.
    `chars_scanned` counts the characters examined, for tests that hold the cost linear."""

    def __init__(self):
        self.scanned: Scanned | None = Scanned()
        self.chars_scanned = 0
        self._state = _START
        self._array = False
        self._call: PartialCall | None = None
        self._key = ""  # the key whose value is being read
        self._text: list[str] = []  # the raw text of the key or name string being read
        self._escaped = False  # the previous character was a backslash inside a string
        self._depth = 0  # of a nested value
        self._in_string = False  # inside a string of a nested value

    def feed(self, piece: str) -> Scanned | None:
        if self.scanned is None:
            return None
        capture = 0 if self._capturing() else None  # where this piece's argument text starts
        i, n = 0, len(piece)
        while i < n:
            state = self._state
            c = piece[i]
            if state in (_STRING, _KEY_STRING, _NESTED):
                i = self._string(piece, i) if state != _NESTED else self._nested(piece, i)
                if self._state == _DEAD:
                    break
                if self._state != state and capture is not None:  # the argument value closed
                    self._call._append_arguments(piece[capture:i])
                    capture = None
                continue
            self.chars_scanned += 1
            if state == _PRIMITIVE:
                if c not in _PRIMITIVE_END:
                    i += 1
                    continue
                if capture is not None:
                    self._call._append_arguments(piece[capture:i])
                    capture = None
                self._state = state = _KEY  # the character that ended it is read as the object's next
            if c in _WS:
                i += 1
                continue
            if state == _VALUE:
                if not self._value_starts(c):
                    break
                if self._key in ARGUMENT_KEYS:
                    self._call.arguments = ""
                    capture = i
                if self._state != _PRIMITIVE:
                    i += 1
                continue
            if not self._structural(c):
                break
            i += 1
        if self._state == _DEAD:
            self.scanned = None
        elif capture is not None:
            self._call._append_arguments(piece[capture:])
        return self.scanned

    # -- the states --------------------------------------------------------------------------------------
    def _capturing(self) -> bool:
        return self._state in (_STRING, _NESTED, _PRIMITIVE) and self._key in ARGUMENT_KEYS

    def _structural(self, c: str) -> bool:
        """Read one non-space character between values; False when the text is not the format."""
        state = self._state
        if state == _START:
            if c == "[":
                self._array, self._state = True, _ITEMS
                return True
            return self._open_call(c)
        if state == _ITEMS:
            if c == ",":
                return True
            if c == "]":
                self.scanned.complete, self._state = True, _TRAIL
                return True
            return self._open_call(c)
        if state == _KEY:
            if c == "}":
                self._call.done = True
                if self._array:
                    self._state = _ITEMS
                else:
                    self.scanned.complete, self._state = True, _TRAIL
                return True
            if c == ",":
                return True
            if c == '"':
                self._state, self._text, self._escaped = _KEY_STRING, [], False
                return True
        if state == _COLON and c == ":":
            self._state = _VALUE
            return True
        self._state = _DEAD  # _TRAIL: text after the answer; else a character out of place
        return False

    def _open_call(self, c: str) -> bool:
        if c != "{":
            self._state = _DEAD
            return False
        self._call = PartialCall()
        self.scanned.calls.append(self._call)
        self._state = _KEY
        return True

    def _value_starts(self, c: str) -> bool:
        """The first character of a value; False when the text is not the format (a name that is no string)."""
        if self._key == "name" and c != '"':
            self._state = _DEAD
            return False
        if c == '"':
            self._state, self._text, self._escaped = _STRING, [], False
        elif c in "{[":
            self._state, self._depth, self._in_string, self._escaped = _NESTED, 1, False, False
        else:
            self._state = _PRIMITIVE  # this character is read again as the primitive's first
        return True

    def _string(self, piece: str, i: int) -> int:
        """Read a key or string value from piece[i] on; the index where reading stopped. The text of keys
        and names is kept (they are decoded when they close); other strings are only skipped."""
        start, n = i, len(piece)
        keep = self._state == _KEY_STRING or self._key == "name"
        while i < n:
            if self._escaped:
                self._escaped = False
            elif piece[i] == "\\":
                self._escaped = True
            elif piece[i] == '"':
                self.chars_scanned += i + 1 - start
                if keep:
                    self._text.append(piece[start:i])
                self._string_closed(keep)
                return i + 1
            i += 1
        self.chars_scanned += i - start
        if keep:
            self._text.append(piece[start:i])
        return i

    def _string_closed(self, kept: bool) -> None:
        if not kept:
            self._state = _KEY
            return
        try:
            text = json.loads('"' + "".join(self._text) + '"')
        except ValueError:  # an invalid escape: not JSON, so not a call
            self._state = _DEAD
            return
        if self._state == _KEY_STRING:
            self._key, self._state = text, _COLON
        else:
            self._call.name, self._state = text, _KEY

    def _nested(self, piece: str, i: int) -> int:
        """Read an object or array value from piece[i] on; the index where reading stopped."""
        start, n = i, len(piece)
        while i < n:
            c = piece[i]
            i += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._state = _KEY
                    break
        self.chars_scanned += i - start
        return i


def scan_calls(s: str) -> Scanned | None:
    """The calls in `s` so far, or None when `s` is not (the beginning of) the answer format."""
    return CallScanner().feed(s)
