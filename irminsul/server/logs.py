"""A log that cannot flood: each repeated warning or error is written at most `limit` times a minute.

A burst of bad connections or failing requests repeats the same few lines (uvicorn's "Invalid HTTP
request received.", an unhandled error's traceback) as fast as clients can send; written in full
they fill the disk. Records are grouped by logger, level and message template (the text before
its arguments are filled in), so the same complaint about a thousand clients is one group.
"""

from __future__ import annotations

import logging
import threading
import time

MAX_GROUPS = 1024  # distinct messages tracked at once; beyond it, every new one shares a group


class RepeatFilter(logging.Filter):
    """Lets a warning or error through at most `limit` times per `interval` seconds per message
    template, and one more that says the rest is left out; the first one let through in a new
    interval says how many were.
    Records below WARNING (access lines, progress) always pass."""

    def __init__(self, limit: int = 10, interval: float = 60.0, clock=time.monotonic):
        super().__init__()
        self.limit, self.interval, self.clock = limit, interval, clock
        self._groups: dict[tuple, list] = {}  # key -> [interval start, let through, left out]
        self._lock = threading.Lock()  # records arrive from every thread

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        verdict = getattr(record, "_irminsul_repeat", None)
        if verdict is not None:  # (the same record reaching a second handler)
            return verdict
        key = (record.name, record.levelno, str(record.msg)[:500])
        now = self.clock()
        with self._lock:
            group = self._groups.get(key)
            if group is None and len(self._groups) >= MAX_GROUPS:
                self._groups = {k: g for k, g in self._groups.items() if now - g[0] < self.interval}
                if len(self._groups) >= MAX_GROUPS:
                    key = ("", 0, "")
                    group = self._groups.get(key)
            if group is None or now - group[0] >= self.interval:
                left_out = group[2] if group is not None else 0
                self._groups[key] = [now, 1, 0]
                if left_out:
                    record.msg = f"{record.getMessage()} [{left_out} more like this were not logged since the last one]"
                    record.args = None
                verdict = True
            elif group[1] < self.limit:
                group[1] += 1
                verdict = True
            elif group[1] == self.limit:  # the last one this interval says that the rest is left out
                group[1] += 1
                record.msg = (
                    f"{record.getMessage()} [logged {self.limit + 1} times in {self.interval:.0f} s; "
                    f"more like it are left out until that time has passed]"
                )
                record.args = None
                verdict = True
            else:
                group[2] += 1
                verdict = False
        record._irminsul_repeat = verdict
        return verdict


def install(limit: int, interval: float = 60.0) -> RepeatFilter:
    """Put one RepeatFilter on every handler of the root logger and uvicorn's loggers (call after
    uvicorn has configured logging)."""
    flt = RepeatFilter(limit, interval)
    for name in (None, "uvicorn", "uvicorn.error", "uvicorn.access"):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(flt)
    return flt
