"""The agent's log lines: text or JSON, one line per record, on stderr."""

from __future__ import annotations

import json
import logging


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, msg and any ``extra`` fields."""

    RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S%z"), "level": record.levelname.lower(),
                "logger": record.name, "msg": record.getMessage()}
        line.update({k: v for k, v in vars(record).items() if k not in self.RESERVED})
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    """``time level msg key=value ...`` with the ``extra`` fields appended."""

    def format(self, record: logging.LogRecord) -> str:
        extra = " ".join(f"{k}={v}" for k, v in vars(record).items() if k not in JsonFormatter.RESERVED)
        text = f"{self.formatTime(record, '%Y-%m-%dT%H:%M:%S')} {record.levelname.lower()} {record.getMessage()}"
        text = f"{text} {extra}" if extra else text
        return text + ("\n" + self.formatException(record.exc_info) if record.exc_info else "")


def setup_logging(fmt: str, level: str) -> None:
    """Send the ``nftpolicy`` loggers to stderr in ``text`` or ``json`` format."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("nftpolicy")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
