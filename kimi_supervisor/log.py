"""structlog set-up: one event per entry, in the form its reader wants.

- **The journal** (stdout is the stream named by $JOURNAL_STREAM, as under a systemd unit):
  each event is one journal entry sent by the native protocol (pystemd.journal.sendv, that is
  libsystemd's sd_journal_sendv), with a readable MESSAGE, its PRIORITY (`journalctl -p warning
  -u kimi-supervisor` shows warnings and errors only; a STUCK teardown is an error), and its
  data as journal fields: KIMI_EVENT, KIMI_TRANSITION, KIMI_MODE, KIMI_STATE, KIMI_PID (a kill's
  or an exit's) and KIMI_<KEY> for every other key, so that `journalctl KIMI_EVENT=stuck` works.
- **A terminal:** a readable console line (colours unless NO_COLOR is set or TERM=dumb).
- **Anything else** (a file, a pipe): plain JSON lines.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import structlog

# syslog(3) priorities by structlog level name.
PRIORITY = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2, "exception": 3}
IDENTIFIER = "kimi-supervisor"
MAX_FIELD = 64 * 1024  # bytes of one field's value sent to the journal

# The fields every event may have, under the names an operator filters on.
_PROMOTED = {
    "KIMI_TRANSITION": ("transition", "transition_id"),
    "KIMI_MODE": ("mode", "target", "desired"),
    "KIMI_STATE": ("state",),
    "KIMI_PID": ("pid", "main_pid"),
}


def _is_journal(stream: Any, env: Mapping[str, str]) -> bool:
    """Whether `stream` is the journal stream systemd connected (JOURNAL_STREAM=DEV:INO)."""
    want = env.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return False
    return want == f"{st.st_dev}:{st.st_ino}"


def _field_name(key: str) -> str:
    """A journal field name: upper-case letters, digits and underscores, starting KIMI_."""
    return "KIMI_" + re.sub(r"[^A-Z0-9_]", "_", key.upper())[:58]


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool | int | float) or value is None:
        return json.dumps(value)
    return json.dumps(value, default=str, separators=(",", ":"))


def _readable(event: str, data: Mapping[str, Any]) -> str:
    """MESSAGE: what a person reads in `journalctl -u kimi-supervisor`, no braces. The event's
    own message if it has one, else its scalar data as key=value; nested data stays in the
    fields (a kill: who, on what evidence)."""
    if "message" in data:
        return f"{event}: {data['message']}"
    parts = []
    proc = data.get("process")
    if isinstance(proc, Mapping) and "pid" in proc:
        parts.append(f"PID {proc['pid']} ({proc.get('comm', '?')})")
    for k, v in data.items():
        if isinstance(v, Mapping | list | tuple) or v is None:
            continue
        text = str(v)
        parts.append(f"{k}={json.dumps(text) if (' ' in text or not text) else text}")
    return " ".join([event, *parts])


def journal_fields(_logger: Any, name: str, event: MutableMapping[str, Any]) -> dict[str, str]:
    """structlog's last processor for the journal: the event as journal fields."""
    data = dict(event)
    level = str(data.pop("level", name))
    data.pop("timestamp", None)
    what = str(data.pop("event", ""))
    fields = {
        "MESSAGE": _readable(what, data),
        "PRIORITY": str(PRIORITY.get(level, 6)),
        "SYSLOG_IDENTIFIER": IDENTIFIER,
        "KIMI_EVENT": what,
    }
    for key, value in data.items():
        if key != "message":  # it is in MESSAGE
            fields[_field_name(key)] = _text(value)[:MAX_FIELD]
    proc = data.get("process")
    if isinstance(proc, Mapping) and "pid" in proc:
        fields["KIMI_PID"] = str(proc["pid"])
    for field, keys in _PROMOTED.items():
        for k in keys:
            if data.get(k) is not None and field not in fields:
                fields[field] = _text(data[k])
    return fields


def _sendv(fields: Mapping[str, str]) -> None:
    import pystemd.journal

    pystemd.journal.sendv(*(f"{k}={v}" for k, v in fields.items()))


class JournalLogger:
    """structlog's logger for the journal: each event's fields, as one entry."""

    def __init__(self, send: Callable[[Mapping[str, str]], None] = _sendv) -> None:
        self.send = send

    def msg(self, **fields: str) -> None:
        self.send(fields)

    debug = info = warning = warn = error = critical = exception = fatal = log = msg


def renderer(stream: Any, env: Mapping[str, str]) -> Any:
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    if tty:
        colors = "NO_COLOR" not in env and env.get("TERM", "") != "dumb"
        return structlog.dev.ConsoleRenderer(colors=colors)
    return structlog.processors.JSONRenderer()


def configure(
    level: str = "info",
    stream: Any = None,
    env: Mapping[str, str] | None = None,
    *,
    send: Callable[[Mapping[str, str]], None] | None = None,
) -> None:
    """`send`: where journal entries go (the tests'); by default the native journal protocol."""
    out = stream or sys.stdout
    env = os.environ if env is None else env
    journal = _is_journal(out, env)
    factory: Any = (
        (lambda *_a: JournalLogger(send or _sendv))
        if journal
        else structlog.PrintLoggerFactory(out)
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks,
            journal_fields if journal else renderer(out, env),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper(), logging.INFO)
        ),
        logger_factory=factory,
        cache_logger_on_first_use=False,
    )


def get(name: str = "kimi-supervisor") -> Any:
    return structlog.get_logger(name)
