"""Logging set-up for the command line: one event a line, as text or as JSON objects."""

from __future__ import annotations

import json
import logging
import logging.handlers
import re
import sys
import time
from collections.abc import Callable

# Context fields a log call may pass through ``extra=``; they are printed when present.
CONTEXT = ("node", "rank", "round", "step")


_ROUND_IN_MESSAGE = re.compile(r"\bround (\d+)\b")


class AgentContext(logging.Filter):
    """Gives every record of an agent process its node (the node id, never an address) and the
    round it is about: the first "round N" of the message (a decision about round N is logged
    while the agent's own round is still N-1), else the agent's current round."""

    def __init__(self, node_id: str, current_round: Callable[[], int]) -> None:
        super().__init__()
        self._node_id = node_id
        self._current_round = current_round

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "node"):
            record.node = self._node_id
        if not hasattr(record, "round"):
            about = _ROUND_IN_MESSAGE.search(record.getMessage())
            try:
                record.round = int(about.group(1)) if about else self._current_round()
            except Exception:  # a broken round source must not lose the line
                pass
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        event = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in CONTEXT:
            if hasattr(record, key):
                event[key] = getattr(record, key)
        if record.exc_info:
            event["exc"] = self.formatException(record.exc_info)
        return json.dumps(event, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ctx = " ".join(f"{k}={getattr(record, k)}" for k in CONTEXT if hasattr(record, k))
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        line = f"{stamp} {record.levelname[0]} {record.name}: {record.getMessage()}"
        line = f"{line} [{ctx}]" if ctx else line
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup(level: str = "info", fmt: str = "text", file: str | None = None, max_bytes: int = 64 << 20,
          backups: int = 4) -> None:
    """Log to stderr (journald keeps and rotates it under systemd), or to ``file``, rotated at
    ``max_bytes`` with ``backups`` old files kept: a daemon that runs for months must not fill
    its disk with its own log."""
    handler: logging.Handler
    if file:
        if max_bytes < 1 or backups < 1:
            raise ValueError(f"log rotation needs max_bytes >= 1 and backups >= 1, got {max_bytes} and {backups}")
        handler = logging.handlers.RotatingFileHandler(file, maxBytes=max_bytes, backupCount=backups)
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
