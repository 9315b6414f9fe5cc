"""A request's tags: labels for tag budgets and spend reports, from the `X-Loramux-Tags` header (comma-separated)
and the body's `metadata.tags` (a list of strings, or one comma-separated string), merged in that order."""
from __future__ import annotations

from typing import Any

from loramux.billing.budgets import MAX_TAGS, BudgetError, parse_tags
from loramux.server.http.errors import ApiError

TAGS_HEADER = "X-Loramux-Tags"
MAX_METADATA_KEYS = 16  # OpenAI's bounds on `metadata`
MAX_METADATA_VALUE = 512


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def request_tags(header: str | None, metadata: dict[str, Any] | None) -> list[str]:
    """The request's tags (at most MAX_TAGS, each 1-64 of letters, digits and `_.:-`), or a 400 saying what is
    wrong and where."""
    values: list[str] = []
    where = TAGS_HEADER
    try:
        if header:
            values += _split(header)
        if metadata is not None:
            where = "metadata"
            check_metadata(metadata)
            tags = metadata.get("tags")
            where = "metadata.tags"
            if isinstance(tags, str):
                values += _split(tags)
            elif isinstance(tags, list) and all(isinstance(t, str) for t in tags):
                values += tags
            elif tags is not None:
                raise BudgetError("metadata.tags must be a list of strings or a comma-separated string")
        return parse_tags(values)
    except BudgetError as exc:
        raise ApiError(400, f"{where}: {exc}", code="invalid_tags",
                       param=None if where == TAGS_HEADER else where) from None


def check_metadata(metadata: dict[str, Any]) -> None:
    """OpenAI's `metadata`: at most 16 keys of at most 64 characters, string values of at most 512 characters
    (`tags` may also be a list, checked as tags)."""
    if len(metadata) > MAX_METADATA_KEYS:
        raise BudgetError(f"at most {MAX_METADATA_KEYS} keys, got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > 64:
            raise BudgetError(f"key {key[:64]!r}... is longer than 64 characters")
        if key == "tags":
            if isinstance(value, list) and len(value) > 4 * MAX_TAGS:
                raise BudgetError(f"at most {MAX_TAGS} tags")
            continue
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
            raise BudgetError(f"{key!r} must be a string of at most {MAX_METADATA_VALUE} characters")
