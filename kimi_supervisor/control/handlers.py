"""What each request does, run in the connection's thread. Reads come from the daemon's
published snapshot and the history file; anything that changes state becomes a typed command
(kimi_supervisor/loop/inbox.py) in the loop's inbox, and waits for the loop's reply."""

from __future__ import annotations

import functools
import os
import pwd
from collections.abc import Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kimi_supervisor.control.peers import Readers
from kimi_supervisor.control.protocol import (
    CaptureRequest,
    CaptureStopRequest,
    End,
    HistoryRequest,
    Reply,
    StatusRequest,
    SubscribeRequest,
    SwitchRequest,
    encode,
)
from kimi_supervisor.control.server import Connection
from kimi_supervisor.loop.inbox import CaptureStart, CaptureStop, Request
from kimi_supervisor.loop.inbox import Switch as SwitchCommand
from kimi_supervisor.model import Mode
from kimi_supervisor.store import history

if TYPE_CHECKING:
    from kimi_supervisor.loop.daemon import Daemon

# How long a switch request waits for the loop to take it (it answers within one poll
# interval mid-teardown; a /health probe or a systemd call can hold it for a few seconds).
LOOP_REPLY_TIMEOUT_S = 60.0


def _who(conn: Connection) -> str:
    try:
        name = pwd.getpwuid(conn.peer.uid).pw_name
    except KeyError:
        name = f"uid {conn.peer.uid}"
    return f"{name} (PID {conn.peer.pid})"


# A history reply carries the newest records up to this many bytes (`truncated` says so).
HISTORY_MAX_BYTES = 16 * 2**20


class Handlers:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.readers = Readers()

    def __call__(self, request: Any, conn: Connection) -> None:
        if isinstance(request, StatusRequest):
            conn.send(Reply(ok=True, code="status", data=self.daemon.snapshot()))
        elif isinstance(request, HistoryRequest):
            self._history(request, conn)
        elif isinstance(request, SubscribeRequest):
            sub = self.daemon.bus.subscribe()
            try:
                conn.send(Reply(ok=True, code="subscribed", data=self.daemon.snapshot()))
                while conn.alive and not sub.overflowed:
                    msg = sub.get(1.0)
                    if msg is None:
                        if conn.hung_up():
                            return
                        continue
                    conn.send(msg)
            finally:
                sub.close()
        elif isinstance(request, SwitchRequest):
            self._switch(request, conn)
        elif isinstance(request, CaptureRequest):
            self._capture(request, conn)
        elif isinstance(request, CaptureStopRequest):
            conn.send(self._ask(CaptureStop(by=_who(conn))))

    def _history(self, request: HistoryRequest, conn: Connection) -> None:
        """The last `n` records, streamed as their own JSON lines (at most HISTORY_MAX_BYTES),
        by a bounded number of readers: one at a time per user (two for root), four in all."""
        why = self.readers.take(conn.peer.uid)
        if why is not None:
            conn.send(Reply(ok=False, code="busy", message=f"not reading the history now: {why}"))
            return
        try:
            # On the daemon's history reader (a process of its own): a frozen state folder
            # holds this client's answer, never a thread of the daemon's in the kernel.
            try:
                lines, cut = self.daemon.reads.call(
                    functools.partial(
                        history.read_lines,
                        self.daemon.config.state.dir, request.n, HISTORY_MAX_BYTES,
                    ),
                    "reading the history",
                )  # fmt: skip
            except TimeoutError as e:
                conn.send(Reply(ok=False, code="busy", message=f"not reading the history now: {e}"))
                return
            head, tail = encode(
                Reply(ok=True, code="history", data={"entries": [], "truncated": cut})
            ).split(b'"entries":[]', 1)

            def parts() -> Iterator[bytes]:
                yield head + b'"entries":['
                for i, line in enumerate(lines):
                    yield line if i == 0 else b"," + line
                yield b"]" + tail

            conn.send_parts(parts())
        finally:
            self.readers.give_back(conn.peer.uid)

    def _ask(self, command: Request) -> Reply:
        """Hand a command to the loop and wait for its answer."""
        self.daemon.ask(command)  # type: ignore[arg-type]
        try:
            return command.reply.result(timeout=LOOP_REPLY_TIMEOUT_S)
        except FutureTimeout:
            return Reply(
                ok=False,
                code="internal",
                message=f"the daemon's loop did not answer within {LOOP_REPLY_TIMEOUT_S:g} s "
                "(see `journalctl -u kimi-supervisor`)",
            )

    def _capture(self, request: CaptureRequest, conn: Connection) -> None:
        out_fd = conn.take_fd()
        if request.out and out_fd is None:
            conn.send(
                Reply(
                    ok=False,
                    code="bad_request",
                    message=f"--out {request.out}: the directory's descriptor must come with the "
                    "request (SCM_RIGHTS), opened by the asker; kimi-mode does this",
                )
            )
            return
        sub = self.daemon.bus.subscribe()
        try:
            reply = self._ask(
                CaptureStart(
                    by=_who(conn),
                    seconds=request.seconds,
                    then=request.then,
                    out=Path(request.out) if request.out else None,
                    out_fd=out_fd if request.out else None,
                    uid=conn.peer.uid,
                    gid=conn.peer.gid,
                )
            )
            conn.send(reply)
            if not reply.ok:
                return
            cid = reply.data["capture"]["capture"]
            while conn.alive and not sub.overflowed:
                msg = sub.get(1.0)
                if msg is None:
                    if conn.hung_up():
                        return  # the capture goes on without its follower
                    continue
                if msg.data.get("capture") == cid:
                    conn.send(msg)
                    if isinstance(msg, End):
                        return
        finally:
            sub.close()
            if out_fd is not None:
                os.close(out_fd)  # the capture holds its own copy

    def _switch(self, request: SwitchRequest, conn: Connection) -> None:
        # Subscribe before asking, so no event of the switch is missed.
        sub = self.daemon.bus.subscribe() if request.follow else None
        try:
            reply = self._ask(
                SwitchCommand(
                    mode=Mode(request.mode),
                    by=_who(conn),
                    force=request.force,
                    for_s=request.for_s,
                    apply=request.apply,
                )
            )
            conn.send(reply)
            if sub is None or not reply.ok or reply.code not in ("accepted", "joined"):
                return
            # The reply names the transition this switch is (or joined): follow it alone.
            follow = reply.data.get("transition_id")
            while conn.alive and not sub.overflowed:
                msg = sub.get(1.0)
                if msg is None:
                    if conn.hung_up():
                        return  # Ctrl-C on the client: the switch goes on
                    continue
                if isinstance(msg, End):
                    if msg.data.get("transition") == follow:
                        conn.send(msg)
                        return
                    continue
                if msg.transition == follow or msg.transition is None:
                    conn.send(msg)
        finally:
            if sub is not None:
                sub.close()
