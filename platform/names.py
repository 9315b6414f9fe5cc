"""Names users choose (tenants, adapters, tiers) and the reserved model alias, shared by tenancy and the registry."""
from __future__ import annotations

import re
from pathlib import Path

BASE_MODEL_ALIAS = "base"  # always the base model, never an adapter name
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # used with fullmatch: no trailing newline
_MAX_CHARS = {"tier": 32}  # tiers.name is a String(32) column; every other name may have 128 characters


class InvalidNameError(ValueError):
    """A tenant or adapter name (or another user-chosen value) that is not allowed; the message says why."""


def check_name(name: str, what: str = "adapter") -> str:
    """Return `name` if it is a valid `what` name ("adapter", "tenant" or "tier"), else raise InvalidNameError."""
    limit = _MAX_CHARS.get(what, 128)
    if not isinstance(name, str) or not _NAME.fullmatch(name) or len(name) > limit:
        raise InvalidNameError(f"{what} name {name!r} is invalid: use 1-{limit} letters, digits, '.', '_' or '-', "
                               "starting with a letter or digit")
    if what == "adapter" and (name == BASE_MODEL_ALIAS or name.startswith("ad_")):
        raise InvalidNameError(f"adapter name {name!r} is reserved ('base' and the 'ad_' prefix of ids)")
    return name


def base_model_id(model: str) -> str:
    """The base model's short name as adapters record it: the last path component, without .gguf."""
    name = Path(str(model).rstrip("/")).name
    return name[:-5] if name.endswith(".gguf") else name
