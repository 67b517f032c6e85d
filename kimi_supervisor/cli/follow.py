"""The one loop that follows the daemon's answers to a request until its end: a switch
(cli/switch.py), `wait` (cli/watch.py) and a capture (cli/capture.py) are each a `Follow` whose
hooks say what its reply, its events and its end mean. The loop keeps what they share: in json
mode every line the daemon sends, as sent; a refusal's exit; --timeout as one deadline; Ctrl-C
and a connection the daemon closed, each said once with its exit (cli/exits.py).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kimi_supervisor.cli import ask
from kimi_supervisor.cli.ask import understood
from kimi_supervisor.cli.exits import Exit, refusal_exit
from kimi_supervisor.cli.follower import Follower
from kimi_supervisor.cli.output import Output
from kimi_supervisor.control.client import NotUnderstood, TimedOut, Unreachable, exchange

# How often a live display on a terminal is drawn again when no event comes.
TICK_S = 1.0


@dataclass(frozen=True)
class Again:
    """What `on_reply` says when the reply cannot be judged yet (a status older than an end
    already heard): ask again after `after_s`, under the same deadline."""

    after_s: float


class Follow:
    """One request followed to its end. A subclass says what the reply, the events and the end
    mean (`on_reply`, `on_event`, `on_end`), what goes on in the daemon when it stops following
    (`goes_on`), and what the daemon closing the connection early means (`closed`)."""

    goes_on = ""  # "the switch goes on": said at --timeout and at Ctrl-C
    stopped = "stopped following"  # said at Ctrl-C, before what goes on
    closed = ""  # said when the daemon closes the connection before the end
    # In json mode the reply is printed as the daemon sent it, and is the answer: a refusal is
    # said on stderr only. A command whose reply is not its answer (wait's subscription) prints
    # no reply, and a refusal is an `error` line.
    prints_reply = True
    # How long before --timeout's deadline the request is asked again (a quarter of --timeout
    # at most), for an answer fresh at the end that comes before the deadline; 0: never.
    refresh_s = 0.0
    deadline: float | None = None  # --timeout's, monotonic

    def __init__(self, o: Output, sock: Path, display: Follower | None = None) -> None:
        self.o = o
        self.sock = sock
        self.display = display

    def run(
        self, request: dict[str, Any], timeout_s: float | None = None, fds: Sequence[int] = ()
    ) -> Exit:
        """Send `request` and follow its answers until a hook ends it, until `timeout_s` has
        passed, Ctrl-C, or the daemon closes the connection. An `on_end` that says None asks
        again, with the same request, under the same deadline; an `on_reply` that says Again
        asks again after its pause, under that deadline too."""
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        # Asked again once, this long before the deadline, for an answer fresh at the end.
        refresh = None
        if self.deadline is not None and self.refresh_s:
            refresh = self.deadline - min(self.refresh_s, (timeout_s or 0) / 4)
        try:
            try:
                while True:
                    now = time.monotonic()
                    if self.deadline is not None and now >= self.deadline:
                        raise TimedOut()
                    if refresh is not None and now >= refresh:
                        refresh = None
                    until = refresh if refresh is not None else self.deadline
                    left = None if until is None else until - now
                    pause = 0.0
                    tick = self.on_tick if self.display is not None and self.display.tty else None
                    try:
                        for raw, msg in exchange(
                            self.sock, request, timeout_s=left, fds=fds, tick=tick, tick_s=TICK_S
                        ):
                            kind = msg["type"]
                            if self.o.json and (kind != "reply" or self.prints_reply):
                                self.o.raw(raw)
                            with understood(f"its {msg.get('event') or kind}"):
                                code = self._on(kind, msg)
                            if isinstance(code, Again):
                                pause = code.after_s
                                break
                            if code is not None:
                                return code
                            if kind == "end":
                                break  # not the end awaited: ask again
                        else:
                            closed = self.on_closed()
                            if not isinstance(closed, Again):
                                return closed
                            pause = closed.after_s
                    except TimedOut:
                        if until == self.deadline:
                            raise
                        continue  # the refresh: asked again at once
                    except NotUnderstood:
                        raise  # another version's answers: asking again reads the same
                    except Unreachable as e:
                        lost = self.on_unreachable(e)
                        if not isinstance(lost, Again):
                            return lost
                        pause = lost.after_s
                    if pause:
                        left = None if until is None else until - time.monotonic()
                        time.sleep(pause if left is None else max(min(pause, left), 0.0))
            except TimedOut:
                self._finish()
                assert timeout_s is not None
                return self.on_timeout(timeout_s)
        except KeyboardInterrupt:  # at any point, the end's own lines too: said, never silent
            self._finish()
            return self.on_interrupt()

    def _on(self, kind: str, msg: dict[str, Any]) -> Exit | Again | None:
        """One message to its hook: an exit to end with, Again, or None to read on."""
        if kind == "event":
            self.on_event(msg)
        elif kind == "reply":
            return self.on_reply(msg) if msg["ok"] else self.refused(msg)
        elif kind == "end":
            return self.on_end(msg)
        return None

    def on_tick(self) -> None:
        """Each second on a terminal, events or not: the live display's clock moves, and its
        bars and vLLM's progress follow the status the daemon published (asked for once; the
        clock moves on without it)."""
        assert self.display is not None
        limit = TICK_S if self.deadline is None else min(TICK_S, self.deadline - time.monotonic())
        status = None
        if limit > 0:  # a read bounded by what is left of --timeout
            with contextlib.suppress(Unreachable, TimedOut):
                status = ask.status(self.sock, timeout_s=limit)
        self.display.tick(status)

    def refused(self, msg: dict[str, Any]) -> Exit | Again:
        """The daemon refused the request: why, and what that means as an exit (Again: a
        refusal that passes, asked again after its pause)."""
        code, said = refusal_exit(str(msg.get("code"))), str(msg.get("message", ""))
        if self.prints_reply:
            print(f"kimi-mode: {said}", file=sys.stderr)
            return code
        return self.o.fail(code, said)

    def on_reply(self, msg: dict[str, Any]) -> Exit | Again | None:
        """A reply that accepts the request: an exit to end here, None to follow on, or Again
        to ask again after a pause."""
        return None

    def on_event(self, msg: dict[str, Any]) -> None:
        """An event on the way (in json mode too: its line is already printed)."""

    def on_end(self, msg: dict[str, Any]) -> Exit | None:
        """The end: its exit, or None to ask again (a rollback or a retry may follow)."""
        raise NotImplementedError

    def on_timeout(self, timeout_s: float) -> Exit:
        """--timeout ran out: said, with what goes on."""
        return self.o.fail(Exit.TIMEOUT, f"timed out after {timeout_s:g} s waiting; {self.goes_on}")

    def on_interrupt(self) -> Exit:
        """Ctrl-C: said, with what goes on and what was seen last."""
        seen = self.display.seen() if self.display is not None else ""
        return self.o.fail(
            Exit.INTERRUPTED,
            f"{self.stopped}; {self.goes_on}" + (f"; last seen: {seen}" if seen else ""),
        )

    def on_closed(self) -> Exit | Again:
        """The daemon closed the connection before the end: an exit, or Again to ask again."""
        return self.o.fail(Exit.UNREACHABLE, self.closed)

    def on_unreachable(self, e: Unreachable) -> Exit | Again:
        """No daemon to ask (any more): Again to ask again after a pause, an exit to end with
        (said), else raised."""
        raise e

    def _finish(self) -> None:
        if self.display is not None:
            self.display.finish()
