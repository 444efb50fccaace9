"""Structured logs: one JSON object per line (or plain text with --log-format text)."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{k}={v}" for k, v in vars(record).items() if k not in _STANDARD)
        line = f"{self.formatTime(record)} {record.levelname} {record.name}: {record.getMessage()} {fields}".rstrip()
        return line + "\n" + self.formatException(record.exc_info) if record.exc_info else line


def configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class RateLimitedLog:
    """Lines of one kind at most once per `interval` seconds each; the lines held back in between
    are counted in the next one (`suppressed`), so a flood of refused connections stays a trickle."""

    def __init__(self, logger: logging.Logger, interval: float = 1.0):
        self._logger = logger
        self._interval = interval
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def log(self, level: int, kind: str, message: str, **extra: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -self._interval) < self._interval:
                self._held[kind] = self._held.get(kind, 0) + 1
                return
            self._last[kind] = now
            suppressed = self._held.pop(kind, 0)
        self._logger.log(level, message, extra={**extra, "suppressed": suppressed} if suppressed else extra)
