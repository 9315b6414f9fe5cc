"""Grammar-constrained decoding on xgrammar: compile a `StructuredOutput` once, match tokens per request.

`GrammarCache.compile` turns a constraint into an xgrammar CompiledGrammar (LRU-cached on (kind, spec),
thread-safe, so the server can compile in a worker thread before the request reaches the engine) or
raises `StructuredOutputError`, whose message is fit for a 400 response. `GrammarCache.matcher` gives a
request its own `Matcher`: the pushdown automaton that says which tokens may come next.

What each kind accepts (xgrammar's dialects):
- json_object: one JSON object, any keys and values, separators ", " and ": ", no other whitespace.
- json_schema: strict (no properties or items the schema does not name), same separators. Keywords that
  xgrammar would silently ignore, so that outputs could break the schema, are refused (`_UNSUPPORTED`);
  oneOf is enforced as anyOf.
  For both JSON kinds, tokens holding a raw control character (U+0000-U+001F) are masked too
  (`extra_mask`): xgrammar lets them into strings, where JSON forbids them, and there is no other place
  for them in JSON without free whitespace.
- regex: the whole output matches; `.` also matches a newline; no lookaround, no backreferences.
- choice: exactly one of the strings.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future

import torch

from loramux.engine.sampling_params import StructuredOutput

__all__ = ["MAX_SPEC_BYTES", "StructuredOutputError", "GrammarCache", "Matcher", "allocate_mask", "pack_mask",
           "apply_mask_"]

MAX_SPEC_BYTES = 64 * 1024  # a schema, regex or choice list larger than this is refused
_MAX_SCHEMA_DEPTH = 64  # nesting of schema objects (the converter recurses)
# Keywords xgrammar 0.2 accepts but does not enforce (or enforces wrongly); outputs could violate them.
_UNSUPPORTED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "contains", "minContains",
                "maxContains", "patternProperties", "uniqueItems", "$dynamicRef", "$recursiveRef")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_CONTROL = re.compile(rb"[\x00-\x1f]")
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
_LABELS = {"json_object": "response_format json_object", "json_schema": "response_format json_schema",
           "regex": "structured output regex", "choice": "structured output choice"}


class StructuredOutputError(ValueError):
    """A structured-output spec that cannot be enforced (invalid, unsupported or too large); the message
    names the kind and what is wrong, without internals, fit to return to the user (HTTP 400)."""


def _xgr():
    import xgrammar

    return xgrammar


def allocate_mask(rows: int, vocab_size: int) -> torch.Tensor:
    """A packed token bitmask [rows, ceil(vocab / 32)] int32 on the CPU, every token allowed (bit j of word i
    set = token 32 i + j allowed; xgrammar's layout)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def pack_mask(allowed: torch.Tensor) -> torch.Tensor:
    """The packed bitmask (see `allocate_mask`) of a bool tensor [rows, V] (True = allowed)."""
    rows, vocab = allowed.shape
    width = (vocab + 31) // 32
    bits = torch.zeros(rows, width * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.to(torch.int64)
    words = (bits.view(rows, width, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # as int32 bit patterns


def apply_mask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """Set to -inf, in place, the logits [B, V] (float32) of the tokens that `bitmask` disallows, on `rows`
    only (bitmask row i masks logits row i) or on every row (None). xgrammar's kernel for the device."""
    _xgr().apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                       vocab_size=logits.shape[1], indices=rows)


class Matcher:
    """One request's position in its grammar (wraps xgrammar.GrammarMatcher; not thread-safe).

    Stop tokens (the engine's EOS / end-of-turn ids) are allowed exactly when the grammar is complete;
    accepting one terminates the matcher."""

    def __init__(self, compiled, stop_token_ids: list[int]):
        self._m = _xgr().GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)

    def fill_mask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the tokens allowed next into `bitmask[row]` (int32 CPU, xgrammar's packed layout: bit j of
        word i set = token 32 i + j allowed). Not valid once terminated."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar does not allow it here."""
        return self._m.accept_token(token_id)

    def is_terminated(self) -> bool:
        """A stop token has been accepted: nothing more may follow."""
        return self._m.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative drafts walked ahead)."""
        if num_tokens > 0:
            self._m.rollback(num_tokens)


class GrammarCache:
    """Compiles constraints for one tokenizer and vocabulary; thread-safe.

    The xgrammar tokenizer info (a pass over the vocabulary) is built on first use, so an engine that never
    sees a constraint never pays for it. At most `max_entries` results are kept (least recently used go
    first); refusals are cached too, so a bad spec sent again is refused at once. Concurrent compiles of
    one spec compile it once."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids=(), max_entries: int = 256):
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_entries = max_entries
        self._tokenizer = tokenizer
        self._compiler = None
        self._json_mask: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, str], Future] = OrderedDict()
        allowed = torch.ones(1, vocab_size, dtype=torch.bool)
        allowed[0, [t for t in self.stop_token_ids if t < vocab_size]] = False
        # A mask whose AND with this one is empty allows nothing but stopping (the grammar is complete).
        self.non_stop_mask = pack_mask(allowed)

    def compiler(self):
        """The xgrammar GrammarCompiler (built on the first call)."""
        with self._lock:
            if self._compiler is None:
                xgr = _xgr()
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids or None)
                # Our own LRU caches results; one thread per compile (callers compile in parallel).
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                no_control = torch.tensor([_CONTROL.search(t) is None for t in info.decoded_vocab], dtype=torch.bool)
                allowed = torch.zeros(1, self.vocab_size, dtype=torch.bool)
                n = min(self.vocab_size, len(no_control))
                allowed[0, :n] = no_control[:n]
                allowed[0, [t for t in self.stop_token_ids if t < self.vocab_size]] = True
                self._json_mask = pack_mask(allowed)
            return self._compiler

    def extra_mask(self, spec: StructuredOutput) -> torch.Tensor | None:
        """A [1, W] bitmask to AND into every mask of `spec`'s matcher (None: none): for the JSON kinds,
        every token without a raw control character, and the stop tokens."""
        if spec.kind in ("json_object", "json_schema"):
            self.compiler()
            return self._json_mask
        return None

    def compile(self, spec: StructuredOutput):
        """The CompiledGrammar of `spec` (from the cache when compiled before); raise StructuredOutputError."""
        key = (spec.kind, spec.spec)
        with self._lock:
            future = self._entries.get(key)
            owner = future is None
            if owner:
                future = self._entries[key] = Future()
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
            else:
                self._entries.move_to_end(key)
        if owner:
            try:
                future.set_result(self._compile(spec))
            except StructuredOutputError as exc:
                future.set_result(exc)  # kept as a value: raising one instance again and again grows its traceback
            except BaseException as exc:  # not the spec's fault (e.g. out of memory): do not cache it
                with self._lock:
                    if self._entries.get(key) is future:
                        del self._entries[key]
                future.set_exception(exc)
                raise
        result = future.result()
        if isinstance(result, StructuredOutputError):
            raise StructuredOutputError(str(result))
        return result

    def matcher(self, spec: StructuredOutput) -> Matcher:
        """A fresh matcher at the start of `spec`'s grammar; raise StructuredOutputError."""
        return Matcher(self.compile(spec), self.stop_token_ids)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _compile(self, spec: StructuredOutput):
        label = _LABELS[spec.kind]
        if len(spec.spec.encode()) > MAX_SPEC_BYTES:
            raise StructuredOutputError(f"{label}: the spec is {len(spec.spec.encode())} bytes; at most "
                                        f"{MAX_SPEC_BYTES} are accepted")
        compiler = self.compiler()
        try:
            if spec.kind == "json_object":
                # A schema, not xgrammar's builtin JSON grammar: that one accepts any value and any whitespace.
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if spec.kind == "json_schema":
                _check_schema(spec.spec)
                return compiler.compile_json_schema(spec.spec, any_whitespace=False, strict_mode=True)
            if spec.kind == "regex":
                if not spec.spec:
                    raise StructuredOutputError(f"{label}: the pattern is empty")
                return compiler.compile_regex(spec.spec)
            return compiler.compile_grammar(_choice_grammar(spec.spec))
        except RuntimeError as exc:  # xgrammar reports a bad spec as RuntimeError "[time] file.cc:line: why"
            raise StructuredOutputError(f"{label}: {_clean(str(exc))}") from None


def _clean(message: str) -> str:
    """xgrammar's message without its source location, on one line, of bounded length."""
    first = _XGR_PREFIX.sub("", message.strip()).strip()
    first = " ".join(first.split())
    return first[:300] + ("..." if len(first) > 300 else "")


def _check_schema(text: str) -> None:
    """Raise StructuredOutputError unless `text` is a JSON object schema that xgrammar enforces in full."""
    label = _LABELS["json_schema"]
    try:
        schema = json.loads(text)
    except RecursionError:
        raise StructuredOutputError(f"{label}: the schema is nested too deeply") from None
    except ValueError as exc:
        raise StructuredOutputError(f"{label}: the schema is not valid JSON ({exc})") from None
    if not isinstance(schema, dict):
        raise StructuredOutputError(f"{label}: the schema must be a JSON object, got {type(schema).__name__}")
    _walk(schema, 0, label)


def _walk(schema, depth: int, label: str) -> None:
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
        _walk(child, depth + 1, label)


def _choice_grammar(text: str) -> str:
    """EBNF accepting exactly one of the JSON list of strings `text`: each a JSON string literal, whose
    escapes xgrammar's EBNF shares."""
    label = _LABELS["choice"]
    try:
        choices = json.loads(text)
    except ValueError:
        raise StructuredOutputError(f"{label}: the choices must be a JSON list of strings") from None
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise StructuredOutputError(f"{label}: the choices must be a list of strings")
    if not choices:
        raise StructuredOutputError(f"{label}: the list of choices is empty")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))
