"""Structured logs: one JSON object per line, carrying the request id of the call being
served. The id travels in gRPC metadata (`x-request-id`) from the client through the
coordinator to both workers, so one request's lines can be found on every service."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

REQUEST_ID_KEY = "x-request-id"
request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


_base_factory = logging.getLogRecordFactory()


def _stamped_record(*args, **kwargs) -> logging.LogRecord:
    """Every log record carries the request id of the context that emitted it."""
    record = _base_factory(*args, **kwargs)
    record.request_id = request_id.get()
    return record


logging.setLogRecordFactory(_stamped_record)


def metadata_request_id(metadata) -> str:
    for key, value in metadata or ():
        if key == REQUEST_ID_KEY and isinstance(value, str):
            return value[:64]
    return ""


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", None) or request_id.get()
        if rid:
            entry["request_id"] = rid
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(fmt: str, level: int, service: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
