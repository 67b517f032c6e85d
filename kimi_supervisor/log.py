"""structlog set-up: one event per line, in the form its reader wants.

- **The journal** (stdout is the stream named by $JOURNAL_STREAM, as under a systemd unit): JSON
  lines behind a syslog `<N>` priority prefix, which journald takes as the entry's PRIORITY and
  strips. `journalctl -p warning -u kimi-supervisor` then shows warnings and errors only (a
  STUCK teardown is an error), and the structured fields stay in the message.
- **A terminal:** a readable console line (colours unless NO_COLOR is set or TERM=dumb).
- **Anything else** (a file, a pipe): plain JSON lines.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

import structlog

# syslog(3) priorities by structlog level name.
PRIORITY = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2, "exception": 3}


def _is_journal(stream: Any, env: Mapping[str, str]) -> bool:
    """Whether `stream` is the journal stream systemd connected (JOURNAL_STREAM=DEV:INO)."""
    want = env.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return False
    return want == f"{st.st_dev}:{st.st_ino}"


class _JournalPriority:
    """Puts the event's syslog priority in front of the rendered line."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, logger: Any, name: str, event: dict[str, Any]) -> str:
        priority = PRIORITY.get(str(event.get("level", "info")), 6)
        return f"<{priority}>{self.inner(logger, name, event)}"


def renderer(stream: Any, env: Mapping[str, str]) -> Any:
    if _is_journal(stream, env):
        return _JournalPriority(structlog.processors.JSONRenderer())
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    if tty:
        colors = "NO_COLOR" not in env and env.get("TERM", "") != "dumb"
        return structlog.dev.ConsoleRenderer(colors=colors)
    return structlog.processors.JSONRenderer()


def configure(
    level: str = "info", stream: Any = None, env: Mapping[str, str] | None = None
) -> None:
    out = stream or sys.stdout
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks,
            renderer(out, os.environ if env is None else env),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )


def get(name: str = "kimi-supervisor") -> Any:
    return structlog.get_logger(name)
