"""Log setup: plain text, or one JSON object per line (`SHARDFLOW_LOG_FORMAT=json`).

The fields of the work at hand (workflow id, step path, task, attempt) live in a context
variable: `bind()` sets them for the current asyncio task and the tasks it starts, so a
handler's own log lines carry them too, and a filter copies them onto every record.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any

from pythonjsonlogger.json import JsonFormatter

TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_bound: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "shardflow_log_fields", default=None
)


def bind(**fields: Any) -> None:
    """Add fields (workflow_id, step, task, attempt, shard; None leaves one out) to the log
    records of this asyncio task, and of the tasks it starts, from now on."""
    current = _bound.get() or {}
    _bound.set({**current, **{k: v for k, v in fields.items() if v is not None}})


def scope(**fields: Any) -> None:
    """Set the fields of the log records of this asyncio task (and the tasks it starts) to
    just these: the work at hand changed (the next of a bundle's tasks), and a field of the
    work before (its workflow id, its task) must not stay on lines about this one."""
    _bound.set({k: v for k, v in fields.items() if v is not None})


class _Fields(logging.Filter):
    """Copies the bound fields onto each record (an `extra=` of the same name wins)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in (_bound.get() or {}).items():
            if not hasattr(record, name):
                setattr(record, name, value)
        return True


def configure(level: str, log_format: str) -> None:
    """Log to stderr at `level`; `json` gives one object per line, anything else text (the
    settings refuse other values right after, with a proper message)."""
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(
            JsonFormatter(
                "%(levelname)s %(name)s %(message)s",
                rename_fields={"levelname": "level", "name": "logger"},
                timestamp="time",  # ISO 8601, UTC
            )
        )
    else:
        handler.setFormatter(logging.Formatter(TEXT))
    handler.addFilter(_Fields())
    logging.basicConfig(level=level.upper(), handlers=[handler])
