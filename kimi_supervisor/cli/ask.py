"""One question to the daemon and its one answer (status, history), shared by the commands
that ask: kimi-mode's and doctor's. An answer this kimi-mode cannot read (another version's)
is NotUnderstood, said in one line, never a traceback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kimi_supervisor.control.client import NotUnderstood, TimedOut, Unreachable, exchange


def one_reply(
    sock: Path, req: dict[str, Any], timeout_s: float = 10.0
) -> tuple[bytes, dict[str, Any]]:
    try:
        for raw, msg in exchange(sock, req, timeout_s=timeout_s):
            return raw, msg
    except TimedOut:
        raise Unreachable(f"the daemon did not answer within {timeout_s:g} s") from None
    raise Unreachable("the daemon closed the connection without answering")


@contextmanager
def understood(what: str) -> Iterator[None]:
    """Reading the daemon's `what`: a field missing or of another kind there (KeyError,
    TypeError, ValueError, pydantic's ValidationError among them) is an answer of another
    version, NotUnderstood."""
    try:
        yield
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        errors = getattr(e, "errors", None)  # pydantic's: the fields, not its essay
        if callable(errors):
            fields = sorted({".".join(map(str, x["loc"])) for x in errors()})
            raise NotUnderstood(what, f"{', '.join(fields)} missing or of another kind") from None
        raise NotUnderstood(what, f"{type(e).__name__}: {e}") from None


def checked_status(data: Any) -> dict[str, Any]:
    """The daemon's status, as this kimi-mode reads it (kimi_supervisor/status.py), else
    NotUnderstood: a field missing or of another shape (an older or newer daemon)."""
    from kimi_supervisor.status import Status

    with understood("its status"):
        Status.model_validate(data)
    checked: dict[str, Any] = data
    return checked


def status(sock: Path, timeout_s: float = 10.0) -> dict[str, Any]:
    _raw, msg = one_reply(sock, {"cmd": "status"}, timeout_s)
    if not msg["ok"]:
        raise Unreachable(str(msg.get("message", "")))
    return checked_status(msg.get("data"))


def history(sock: Path, n: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The reply to `history` and its records (each an object with a `kind`), else
    NotUnderstood."""
    _raw, msg = one_reply(sock, {"cmd": "history", "n": n})
    if not msg["ok"]:
        return msg, []
    with understood("its history"):
        entries = msg["data"]["entries"]
        if not all(isinstance(e, dict) and isinstance(e["kind"], str) for e in entries):
            raise ValueError("a record that is not an object with a `kind`")
    return msg, list(entries)
