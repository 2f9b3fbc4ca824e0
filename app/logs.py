"""JSON logs, one object per line on stdout (no colour: CloudWatch shows escape codes as text).

The request id of the request being served lives in a context variable, so every line logged while
serving it carries the id that the response returns in `X-Request-Id`.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from contextvars import ContextVar

REQUEST_ID: ContextVar[str | None] = ContextVar("request_id", default=None)

# Attributes every LogRecord has; anything else was passed with `extra=` and is logged as a field
# (except uvicorn's ANSI-coloured duplicate of the message).
_STANDARD_ATTRS = frozenset(vars(logging.makeLogRecord({}))) | {
    "message",
    "asctime",
    "taskName",
    "color_message",
}


class JsonFormatter(logging.Formatter):
    def __init__(self, fields: Mapping[str, object] | None = None) -> None:
        """`fields`: logged on every line (which front process wrote it)."""
        super().__init__()
        self.fields = dict(fields or {})

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **self.fields,
        }
        request_id = REQUEST_ID.get()
        if request_id is not None:
            entry["request_id"] = request_id
        entry.update((k, v) for k, v in vars(record).items() if k not in _STANDARD_ATTRS)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str, fields: Mapping[str, object] | None = None) -> None:
    """Route every logger (uvicorn's included) to one JSON handler on stdout; `fields` go on every line."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonFormatter(fields))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
