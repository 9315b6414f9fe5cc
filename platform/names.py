"""Names that users choose (tenants, adapters) and the reserved model alias, shared by tenancy and the registry."""
from __future__ import annotations

import re

BASE_MODEL_ALIAS = "base"  # always the base model, never an adapter name
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class InvalidNameError(ValueError):
    """A tenant or adapter name (or another user-chosen value) that is not allowed; the message says why."""


def check_name(name: str, what: str = "adapter") -> str:
    """Return `name` if it is a valid `what` name ("adapter" or "tenant"), else raise InvalidNameError."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidNameError(f"{what} name {name!r} is invalid: use 1-128 letters, digits, '.', '_' or '-', "
                               "starting with a letter or digit")
    if what == "adapter" and (name == BASE_MODEL_ALIAS or name.startswith("ad_")):
        raise InvalidNameError(f"adapter name {name!r} is reserved ('base' and the 'ad_' prefix of ids)")
    return name
