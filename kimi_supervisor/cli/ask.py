"""One question to the daemon and its one answer (status, history), shared by the commands
that ask: kimi-mode's and doctor's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kimi_supervisor.control.client import TimedOut, Unreachable, exchange


def one_reply(
    sock: Path, req: dict[str, Any], timeout_s: float = 10.0
) -> tuple[bytes, dict[str, Any]]:
    try:
        for raw, msg in exchange(sock, req, timeout_s=timeout_s):
            return raw, msg
    except TimedOut:
        raise Unreachable(f"the daemon did not answer within {timeout_s:g} s") from None
    raise Unreachable("the daemon closed the connection without answering")


def status(sock: Path, timeout_s: float = 10.0) -> dict[str, Any]:
    _raw, msg = one_reply(sock, {"cmd": "status"}, timeout_s)
    if not msg["ok"]:
        raise Unreachable(msg["message"])
    data: dict[str, Any] = msg["data"]
    return data
