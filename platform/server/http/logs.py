"""Structured logs: one JSON object per line, tagged with the id of the request being served.

The server sets `request_id_var` when it takes a request (`token = request_id_var.set(rid)` ...
`request_id_var.reset(token)`); every record logged in that context, including from threads started
with `contextvars.copy_context()` (Starlette's `run_in_threadpool` does this), carries the id. A record
may also name its own: `log.info("...", extra={"request_id": rid})`, which wins over the context.
"""
from __future__ import annotations

import contextvars
import json
import logging
import math
import sys
from datetime import datetime, timezone

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("loramux_request_id", default=None)

NOISY_LOGGERS: tuple[str, ...] = ("alembic.runtime.plugins", "alembic.runtime.migration", "httpx", "httpcore",
                                  "botocore", "boto3", "s3transfer", "urllib3", "werkzeug")

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_RECORD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message", "asctime", "taskName", "request_id"}
_CORE_KEYS = ("ts", "level", "logger", "msg", "request_id", "exc", "stack")


def current_request_id(record: logging.LogRecord | None = None) -> str | None:
    """The record's own `request_id` if it has one, else the one in the current context."""
    rid = getattr(record, "request_id", None) if record is not None else None
    return rid if rid is not None else request_id_var.get()


def _jsonable(value):
    """`value` if `json.dumps` takes it as strict JSON, else `str(value)`."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, OverflowError, RecursionError):
        return str(value)
    return value


class JsonFormatter(logging.Formatter):
    """Formats a record as one line of JSON: ts (ISO 8601 UTC), level, logger, msg, request_id, the
    record's `extra=` fields (non-JSON values as `str()`), and `exc` / `stack` text when present."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict = {
            "ts": datetime.fromtimestamp(record.created, tz=timezone.utc).isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "request_id": current_request_id(record),
        }
        for key, value in record.__dict__.items():
            if key in _RECORD_ATTRS or key.startswith("_"):
                continue
            out[f"extra_{key}" if key in _CORE_KEYS else key] = _jsonable(value)
        if record.exc_info:
            if not record.exc_text:
                record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str)


class _PlainFormatter(logging.Formatter):
    """Human-readable lines for local runs: `ts LEVEL logger [request_id] msg`."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        had = "request_id" in record.__dict__
        original = record.__dict__.get("request_id")
        record.request_id = current_request_id(record) or "-"
        try:
            return super().format(record)
        finally:
            if had:
                record.request_id = original
            else:
                del record.request_id


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at emit time (so redirection and test capture just work)."""

    _loramux = True

    def __init__(self, level: int = logging.NOTSET):
        logging.Handler.__init__(self, level)

    @property
    def stream(self):
        return sys.stderr


def configure_logging(json_logs: bool = True, level: str | int = "INFO") -> None:
    """Make the root logger write one stream to stderr: JSON lines (default) or plain text.

    Replaces the root logger's handlers with a single stderr handler (calling it again just swaps
    that handler: idempotent), sets the root level, and turns chatty libraries down to WARNING.
    """
    if isinstance(level, str):
        name = level.strip().upper()
        numeric = logging.getLevelName(name)
        if not isinstance(numeric, int):
            raise ValueError(f"unknown log level {level!r}")
        level = numeric
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        if getattr(handler, "_loramux", False):
            handler.close()  # only our own; handlers installed by others are theirs to close
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter() if json_logs else _PlainFormatter())
    root.addHandler(handler)
    root.setLevel(level)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
