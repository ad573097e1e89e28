"""Structured logs to stderr: one JSON object per line, journald-friendly.

``EDGE_APPLIANCE_LOG_STREAM=stdout`` sends them to stdout instead: the OCI image sets it, since
a container's log collector reads JSON lines from stdout (the few plain lines for a person,
"listening on", "ready", a start-up error, stay on stderr).

Under systemd (``JOURNAL_STREAM`` set) no timestamp is written, since journald adds its
own; elsewhere each line carries ``ts``. Extra fields given with ``extra=`` (model,
version, event, request id) become keys of the object.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JSONFormatter(logging.Formatter):
    def __init__(self, with_time: bool):
        super().__init__()
        self.with_time = with_time

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, object] = {}
        if self.with_time:
            data["ts"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        data.update(level=record.levelname.lower(), logger=record.name, msg=record.getMessage())
        for key, value in vars(record).items():
            if key not in _STANDARD and value is not None:
                data[key] = value
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)


STREAM_ENV = "EDGE_APPLIANCE_LOG_STREAM"


def setup(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stdout if os.environ.get(STREAM_ENV) == "stdout" else sys.stderr)
    handler.setFormatter(JSONFormatter(with_time=not os.environ.get("JOURNAL_STREAM")))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
