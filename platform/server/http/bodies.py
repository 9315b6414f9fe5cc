"""Request body validation shared by every API (tenant, native, admin)."""
from __future__ import annotations

from pydantic import BaseModel, field_validator

from loramux.text import reject_lone_surrogates


class RequestBody(BaseModel):
    """Base of the request bodies (and their nested parts): every string in them is valid Unicode."""

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value):
        return reject_lone_surrogates(value)
