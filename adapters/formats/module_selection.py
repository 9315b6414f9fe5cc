"""Which modules of the base model a PEFT LoRA config targets, and each one's rank and alpha: PEFT's own rules.

Given the base model's LoRA-targetable module names (`model.layers.<i>.self_attn.q_proj`, ... as
`validation.module_names` gives them), `select_modules` returns the ones PEFT would wrap, exactly as
`peft.tuners.tuners_utils.check_target_module_exists` decides (PEFT 0.21):

* `exclude_modules` first: a string is a regex the name must match whole; a list excludes a name equal to
  an entry or ending in `.<entry>`.
* `target_modules` absent (null) with `target_parameters` set: no module (PEFT allows it; the parameters are
  the routed experts', see `experts`).
* `target_modules` as a string: "all-linear" (any case) selects every projection; any other string is a
  regex the name must match whole (`fullmatch`). `layers_to_transform` / `layers_pattern` are refused
  with a string, as PEFT's LoraConfig refuses them.
* `target_modules` as a list: a name equal to an entry is selected as is; a name ending in `.<entry>` is
  selected, and then, when `layers_to_transform` is set (an int, or a non-empty list), only if its layer
  index is one of them. The index is the first `<layers_pattern>.<digits>.` of the name (any
  `layers_pattern` of a list, tried in order), or without a `layers_pattern` the first `.<word>.<digits>.`.
  Entries that select nothing are ignored, as PEFT ignores them (an index past the last layer too).

Per selected module, `module_rank_alpha` applies `rank_pattern` / `alpha_pattern` as PEFT's
`get_pattern_key` does: the first key, in the config's order, for which `(.*\\.)?(<key>)$` matches the
name from its start gives the module's r (alpha); no key matching: the config's `r` (`lora_alpha`). A key
that matches no module changes nothing (PEFT ignores it silently too).

Every pattern here comes from the client, so each is compiled with RE2 (linear time, bounded memory), capped
in length and count, and the matching runs under a deadline; see `validation` for why.
"""
from __future__ import annotations

import math
import re
import time
from collections.abc import Hashable, Mapping
from typing import Protocol, TypeVar

try:  # linear-time regex engine for client-given patterns
    import re2
except ImportError:  # pragma: no cover - google-re2 is a dependency; without it client regexes are refused
    re2 = None

from loramux.adapters.formats.validation_common import fail, show

K = TypeVar("K", bound=Hashable)  # a module's key: (layer, target), or (layer, projection, expert) for experts
MAX_PATTERN_CHARS = 1000  # one regex (a pattern key, a layers_pattern, an exclude_modules string)
MAX_PATTERN_KEYS = 512  # entries of rank_pattern / alpha_pattern each
_DEADLINE_S = 1.0  # of this thread's CPU time (`_cpu_clock`)
# CPU time, not wall time: on a starved machine a thread may wait seconds for a core between two names, and a
# wall-clock deadline would then refuse a harmless pattern. RE2 matches on the calling thread, so the time a
# pattern really costs is counted.
_cpu_clock = time.thread_time
_RE2_MAX_MEM = 8 << 20
_HELP = ("patterns use RE2 syntax (no lookaround or backreferences) and are matched against module names such "
         "as 'model.layers.0.self_attn.q_proj'")
_DEFAULT_LAYER_INDEX = re.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.")  # PEFT's, when layers_pattern is not given


class RegexMatch(Protocol):
    def groupdict(self) -> dict[str, str | None]: ...


class ClientRegex(Protocol):
    """A client's pattern compiled with RE2, as used here (google-re2 ships no type hints)."""

    def match(self, text: str, /) -> RegexMatch | None: ...

    def fullmatch(self, text: str, /) -> RegexMatch | None: ...


def compile_client_regex(pattern: str, what: str, help: str = _HELP) -> ClientRegex:
    """`pattern` (a client's regex) compiled with RE2, or `bad_option` naming `what`, the reason and `help`."""
    if not isinstance(pattern, str) or not pattern:
        raise fail("bad_option", f"{what} must be a non-empty string, got {show(pattern)}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise fail("bad_option", f"{what} is {len(pattern)} characters, above the limit of {MAX_PATTERN_CHARS}; "
                                  f"{help}")
    if re2 is None:
        raise fail("bad_option", f"this server cannot check {what} (google-re2 is not installed); {help}")
    options = re2.Options()
    options.log_errors = False
    options.max_mem = _RE2_MAX_MEM
    try:
        return re2.compile(pattern, options)
    except Exception as exc:  # noqa: BLE001 - re2.error, or text RE2 cannot encode (lone surrogates)
        reason = exc.args[0] if exc.args else type(exc).__name__
        if isinstance(reason, bytes):
            reason = reason.decode("utf-8", "replace")
        raise fail("bad_option", f"{what} {show(pattern)} is not a supported regular expression "
                                  f"({show(str(reason), 80)}): {help}") from None


def _layers_to_transform(config: Mapping) -> int | list[int] | None:
    value = config.get("layers_to_transform")
    if value is None:
        return None
    ok_int = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0  # noqa: E731
    if ok_int(value) or (isinstance(value, list) and all(ok_int(v) for v in value)):
        return value
    raise fail("bad_option", f"layers_to_transform must be a layer index or a list of layer indices, got "
                              f"{show(value)}")


def _layers_patterns(config: Mapping) -> list | None:
    value = config.get("layers_pattern")
    if value is None or value == "" or value == []:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(p, str) for p in items) or len(items) > 64:
        raise fail("bad_option", f"layers_pattern must be a string or a list of strings, got {show(value)}")
    # PEFT pastes each into `(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.` unescaped, and so do we.
    return [compile_client_regex(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", f"layers_pattern {show(p)}") for p in items]


def check_selection_options(config: Mapping) -> None:
    """The config-only checks of the options read here (PEFT's LoraConfig raises on the same)."""
    targets = config.get("target_modules")
    if isinstance(targets, str):
        for key in ("layers_to_transform", "layers_pattern"):
            if config.get(key) is not None:
                raise fail("bad_option", f"{key} cannot be used with a target_modules regex string (PEFT refuses "
                                          "it too): select the layers in the regex, or list the module names")
    if config.get("layers_pattern") not in (None, "", []) and config.get("layers_to_transform") is None:
        raise fail("bad_option", "layers_pattern is set without layers_to_transform (PEFT refuses it too): give "
                                  "the layer indices in layers_to_transform")
    _layers_to_transform(config)
    _layers_patterns(config)
    _exclusion(config)
    for key, check in (("rank_pattern", _rank_value), ("alpha_pattern", _alpha_value)):
        _pattern_entries(config, key, check)


def _exclusion(config: Mapping):
    value = config.get("exclude_modules")
    if value is None or value == [] or value == "":
        return None
    if isinstance(value, str):
        compiled = compile_client_regex(value, "exclude_modules")
        return lambda name: compiled.fullmatch(name) is not None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return lambda name: name in value or any(name.endswith(f".{v}") for v in value)
    raise fail("bad_option", f"exclude_modules must be a list of module names or a regex string, got {show(value)}")


def _layer_index(name: str, patterns: list | None) -> int | None:
    if patterns is None:
        match = _DEFAULT_LAYER_INDEX.match(name)
    else:
        match = None
        for pattern in patterns:
            match = pattern.match(name)
            if match is not None:
                break
    if match is None:
        return None
    index = match.groupdict().get("idx")
    return None if index is None else int(index)


def _declared_targets(config: Mapping):
    targets = config.get("target_modules")
    if targets is None and config.get("target_parameters"):
        return []  # PEFT: a config may target parameters only (the routed experts; see `experts`)
    return targets


def select_modules(config: Mapping, names: Mapping[K, str]) -> list[K]:
    """The keys of `names` ((layer, target) -> module name, or any key) whose modules PEFT targets, in `names`'
    order."""
    check_selection_options(config)
    excluded = _exclusion(config)
    targets = _declared_targets(config)
    deadline = _cpu_clock() + _DEADLINE_S
    if isinstance(targets, str):
        if targets.lower() == "all-linear":
            matches = lambda name: True  # noqa: E731 - every projection; the LM head is never in `names`
        else:
            compiled = compile_client_regex(targets, "target_modules")
            matches = lambda name: compiled.fullmatch(name) is not None  # noqa: E731
    else:
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise fail("bad_option", f"target_modules must be a list of module names or a regex string, got "
                                      f"{show(targets)}")
        layers, patterns = _layers_to_transform(config), _layers_patterns(config)
        using_layers = layers is not None and (len(layers) != 0 if isinstance(layers, list) else True)

        def matches(name: str) -> bool:
            if name in targets:
                return True
            if not any(name.endswith(f".{t}") for t in targets):
                return False
            if not using_layers:
                return True
            index = _layer_index(name, patterns)
            assert layers is not None  # using_layers
            return index is not None and (index == layers if isinstance(layers, int) else index in layers)
    selected = []
    for key, name in names.items():
        if _cpu_clock() > deadline:
            raise fail("bad_option", f"target_modules / exclude_modules / layers_pattern took too long to match; "
                                      f"{_HELP}")
        if excluded is not None and excluded(name):
            continue
        if matches(name):
            selected.append(key)
    return selected


def _rank_value(key: str, value, max_rank: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise fail("bad_rank", f"rank_pattern[{show(key)}] must be a positive integer, got {show(value)}")
    if max_rank is not None and value > max_rank:
        raise fail("rank_out_of_range", f"rank_pattern[{show(key)}] = {value} is above this server's maximum LoRA "
                                         f"rank {max_rank}")


def _alpha_value(key: str, value, max_rank: int | None) -> None:
    finite = isinstance(value, (int, float)) and not isinstance(value, bool)
    try:
        finite = finite and math.isfinite(value) and value > 0
    except OverflowError:
        finite = False
    if not finite:
        raise fail("bad_alpha", f"alpha_pattern[{show(key)}] must be a positive number, got {show(value)}")


def _pattern_entries(config: Mapping, field: str, check, max_rank: int | None = None) -> list[tuple[str, object, int]]:
    value = config.get(field)
    if value is None:
        return []
    if not isinstance(value, dict):
        raise fail("bad_option", f"{field} must be an object mapping module names or regexes to values, got "
                                  f"{show(value)}")
    if len(value) > MAX_PATTERN_KEYS:
        raise fail("bad_option", f"{field} has {len(value)} entries, above the limit of {MAX_PATTERN_KEYS}")
    entries = []
    for key, item in value.items():
        check(key, item, max_rank)
        entries.append((key, compile_client_regex(rf"(.*\.)?({key})$", f"{field} key {show(key)}"), item))
    return entries


def check_pattern_values(config: Mapping, max_rank: int | None) -> None:
    """rank_pattern values within `max_rank` (and well-formed patterns): a config-only check."""
    _pattern_entries(config, "rank_pattern", _rank_value, max_rank)
    _pattern_entries(config, "alpha_pattern", _alpha_value)


def module_rank_alpha(config: Mapping, names: Mapping[K, str]) -> dict[K, tuple[int, float]]:
    """(r, lora_alpha) of every module in `names`, by PEFT's `get_pattern_key` (see the module docstring)."""
    rank, alpha = config["r"], config["lora_alpha"]
    rank_keys = _pattern_entries(config, "rank_pattern", _rank_value)
    alpha_keys = _pattern_entries(config, "alpha_pattern", _alpha_value)
    deadline = _cpu_clock() + _DEADLINE_S
    out = {}
    for key, name in names.items():
        if _cpu_clock() > deadline:
            raise fail("bad_option", f"rank_pattern / alpha_pattern took too long to match; {_HELP}")
        out[key] = (_first_match(rank_keys, name, rank), _first_match(alpha_keys, name, alpha))
    return out


def _first_match(entries, name: str, default):
    for _, compiled, value in entries:
        if compiled.match(name) is not None:
            return value
    return default


def scale_of(rank: int, alpha: float, use_rslora: bool) -> float:
    """PEFT's scaling of one module: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return alpha / (math.sqrt(rank) if use_rslora else rank)


__all__ = ["check_pattern_values", "check_selection_options",
           "compile_client_regex", "module_rank_alpha", "scale_of", "select_modules"]
