"""Grammar-constrained decoding on xgrammar: compile a `StructuredOutput` once, match tokens per request.

`GrammarCache.compile` turns a constraint into an xgrammar CompiledGrammar (LRU-cached on (kind, spec),
thread-safe; in a killable worker process once `use_pool` is called, see `compile_pool`) or raises
`StructuredOutputError`, whose message is fit for a 400 response; specs are checked first without
compiling (`spec_checks`: size, unsupported keywords, repetition bounds). `GrammarCache.matcher` gives a
request its own `Matcher`: the pushdown automaton that says which tokens may come next.

What each kind accepts (xgrammar's dialects):
- json_object: one JSON object, any keys and values, separators ", " and ": ", no other whitespace.
- json_schema: strict (no properties or items the schema does not name), same separators. Keywords that
  xgrammar would silently ignore, so that outputs could break the schema, are refused (`spec_checks`);
  oneOf is enforced as anyOf.
  For both JSON kinds, tokens holding a raw control character (U+0000-U+001F) are masked too
  (`extra_mask`): xgrammar lets them into strings, where JSON forbids them, and there is no other place
  for them in JSON without free whitespace.
- regex: the whole output matches; `.` also matches a newline; no lookaround, no backreferences.
- choice: exactly one of the strings.
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict
from concurrent.futures import Future

import torch

from loramux.engine.sampling.params import StructuredOutput
from loramux.engine.structured.compile_pool import (
    CompileBusy,
    CompileLimits,
    CompilePool,
    CompileRefused,
    CompileTooComplex,
)
from loramux.engine.structured.prechecks import LABELS as _LABELS
from loramux.engine.structured.prechecks import MAX_SPEC_BYTES, StructuredOutputError, check_spec, choice_grammar

__all__ = ["MAX_SPEC_BYTES", "StructuredOutputError", "StructuredOutputTooComplex", "GrammarCache", "Matcher",
           "allocate_mask", "pack_mask", "apply_mask_"]

_CONTROL = re.compile(rb"[\x00-\x1f]")
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class StructuredOutputTooComplex(StructuredOutputError):
    """A spec whose compile passed its time, memory or size limit and was stopped (HTTP 400
    response_format_too_complex); cached like any refusal."""


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
    one spec compile it once. A cached result is shared: whoever holds a CompiledGrammar (a request's
    `Constraint`) keeps it alive whatever the LRU evicts.

    By default a compile runs in the calling thread, uninterruptible (the sync `LLMEngine`, tests). After
    `use_pool(limits)` every compile runs in a worker process of a `CompilePool` that is killed past the
    limits (`StructuredOutputTooComplex`), and `compile_future` never compiles in the calling thread."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids=(), max_entries: int = 256):
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_entries = max_entries
        self.max_repetition = CompileLimits.max_repetition
        self._tokenizer = tokenizer
        self._compiler = None
        self._info = None
        self._json_mask: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._limits: CompileLimits | None = None
        self._pool: CompilePool | None = None
        allowed = torch.ones(1, vocab_size, dtype=torch.bool)
        allowed[0, [t for t in self.stop_token_ids if t < vocab_size]] = False
        # A mask whose AND with this one is empty allows nothing but stopping (the grammar is complete).
        self.non_stop_mask = pack_mask(allowed)

    def use_pool(self, limits: CompileLimits) -> None:
        """Compile in worker processes within `limits` from now on (the pool starts on the first compile)."""
        self._limits = limits
        self.max_repetition = limits.max_repetition

    @property
    def pool(self) -> CompilePool | None:
        """The worker pool, once a compile started it (None without `use_pool`)."""
        return self._pool

    def shutdown(self) -> None:
        """Stop the worker pool (a running compile is killed)."""
        with self._lock:
            pool, self._pool, self._limits = self._pool, None, None
        if pool is not None:
            pool.shutdown()

    def compiler(self):
        """The xgrammar GrammarCompiler (built on the first call)."""
        with self._lock:
            if self._compiler is None:
                xgr = _xgr()
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids or None)
                # Our own LRU caches results; one thread per compile (callers compile in parallel).
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                self._info = info
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
        """The CompiledGrammar of `spec` (from the cache when compiled before); blocking. Raise
        StructuredOutputError (StructuredOutputTooComplex when a limit stopped it) or CompileBusy."""
        return self.compile_future(spec).result()

    def compile_future(self, spec: StructuredOutput) -> Future:
        """A future of `spec`'s CompiledGrammar, with `compile`'s errors. With a pool it resolves only once
        the compile has finished or its worker is dead, and nothing compiles in the calling thread (an
        event loop may await it); without one the compile runs here and the future is done on return."""
        key = (spec.kind, spec.spec)
        with self._lock:
            entry = self._entries.get(key)
            owner = entry is None
            if owner:
                entry = self._entries[key] = Future()
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
            else:
                self._entries.move_to_end(key)
            pooled = self._limits is not None
        if owner:
            if pooled:
                self._compile_in_pool(spec, key, entry)
            else:
                self._compile_here(spec, key, entry)
        out: Future = Future()
        entry.add_done_callback(lambda done: _relay(done, out))
        return out

    def matcher(self, spec: StructuredOutput) -> Matcher:
        """A fresh matcher at the start of `spec`'s grammar; raise StructuredOutputError."""
        return Matcher(self.compile(spec), self.stop_token_ids)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _compile_here(self, spec: StructuredOutput, key, entry: Future) -> None:
        try:
            entry.set_result(self._compile(spec))
        except StructuredOutputError as exc:
            entry.set_result(exc)  # kept as a value: raising one instance again and again grows its traceback
        except BaseException as exc:  # noqa: BLE001 - not the spec's fault (e.g. out of memory): not cached
            self._forget(key, entry)
            entry.set_exception(exc)

    def _compile_in_pool(self, spec: StructuredOutput, key, entry: Future) -> None:
        label = _LABELS[spec.kind]
        try:
            method, args = self._plan(spec)
            pool = self._started_pool()
        except StructuredOutputError as exc:
            entry.set_result(exc)
            return
        except BaseException as exc:  # noqa: BLE001 - e.g. the pool could not start: not cached
            self._forget(key, entry)
            entry.set_exception(exc)
            return
        info = self._info
        assert info is not None  # built with the compiler, which _started_pool made

        def settle(job: Future) -> None:  # on the pool's manager thread, never the engine's
            try:
                entry.set_result(_xgr().CompiledGrammar.deserialize_json(job.result(), info))
            except CompileRefused as exc:
                entry.set_result(StructuredOutputError(f"{label}: {_clean(str(exc))}"))
            except CompileTooComplex as exc:
                entry.set_result(StructuredOutputTooComplex(f"{label}: too complex to compile ({exc})"))
            except BaseException as exc:  # noqa: BLE001 - busy, or a failure of ours: not the spec's, not cached
                self._forget(key, entry)
                entry.set_exception(exc)

        pool.submit(method, args).add_done_callback(settle)

    def _started_pool(self) -> CompilePool:
        self.compiler()  # the tokenizer info the workers need
        info = self._info
        assert info is not None  # set by compiler()
        with self._lock:
            if self._pool is None:
                if self._limits is None:
                    raise CompileBusy("the compile pool is shut down")
                self._pool = CompilePool(info.serialize_json(), self._limits)
            return self._pool

    def _forget(self, key, entry: Future) -> None:
        with self._lock:
            if self._entries.get(key) is entry:
                del self._entries[key]

    def _plan(self, spec: StructuredOutput) -> tuple[str, dict]:
        """The GrammarCompiler method and arguments that compile `spec`; raise StructuredOutputError for a
        spec refused without compiling."""
        check_spec(spec, self.max_repetition)
        if spec.kind == "json_object":
            # A schema, not xgrammar's builtin JSON grammar: that one accepts any value and any whitespace.
            return "compile_json_schema", {"schema": '{"type": "object"}', "any_whitespace": False,
                                           "strict_mode": False}
        if spec.kind == "json_schema":
            return "compile_json_schema", {"schema": spec.spec, "any_whitespace": False, "strict_mode": True}
        if spec.kind == "regex":
            return "compile_regex", {"regex": spec.spec}
        return "compile_grammar", {"grammar": choice_grammar(spec.spec)}

    def _compile(self, spec: StructuredOutput):
        """Compile in the calling thread (no pool)."""
        method, args = self._plan(spec)
        try:
            return getattr(self.compiler(), method)(**args)
        except RuntimeError as exc:  # xgrammar reports a bad spec as RuntimeError "[time] file.cc:line: why"
            raise StructuredOutputError(f"{_LABELS[spec.kind]}: {_clean(str(exc))}") from None


def _relay(entry: Future, out: Future) -> None:
    """Copy a cache entry's outcome to one caller's future; a cached refusal raises a fresh error each time."""
    if out.cancelled():
        return
    if entry.exception() is not None:
        out.set_exception(entry.exception())
        return
    result = entry.result()
    if isinstance(result, StructuredOutputError):
        out.set_exception(type(result)(str(result)))
    else:
        out.set_result(result)


def _clean(message: str) -> str:
    """xgrammar's message without its source location, on one line, of bounded length."""
    first = _XGR_PREFIX.sub("", message.strip()).strip()
    first = " ".join(first.split())
    return first[:300] + ("..." if len(first) > 300 else "")
