"""structlog set-up: JSON lines on stdout (the journal keeps them), one event per line."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def configure(level: str = "info", stream: Any = None) -> None:
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stdout),
        cache_logger_on_first_use=False,
    )


def get(name: str = "kimi-supervisor") -> Any:
    return structlog.get_logger(name)
