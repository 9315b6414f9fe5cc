"""Text that every layer can store, encode and send: valid Unicode, no lone surrogates."""
from __future__ import annotations


def reject_lone_surrogates(value):
    """Raise ValueError if a string in `value` (nested in lists and dicts too) is not valid Unicode text.

    JSON may carry escapes such as `\\ud800` that decode to a lone surrogate: no character, not
    encodable as UTF-8. The tokenizer, the database drivers and JSON responses all fail on one (a 500),
    so request bodies refuse them at the door (422)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("must be valid Unicode text: a lone surrogate (\\ud800-\\udfff) is no character") from None
    elif isinstance(value, (list, tuple)):
        for item in value:
            reject_lone_surrogates(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            reject_lone_surrogates(key)
            reject_lone_surrogates(item)
    return value
