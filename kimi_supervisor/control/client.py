"""The client side of the control socket: connect, send one request, read answer lines.
Imports nothing heavy (no pystemd, no pynvml): `kimi-mode` starts fast."""

from __future__ import annotations

import errno
import json
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from kimi_supervisor.control.protocol import PROTOCOL_VERSION


class Unreachable(Exception):
    """The daemon cannot be reached, or it refused us; the message says what to do."""


class TimedOut(Exception):
    pass


class NotUnderstood(Unreachable):
    """The daemon answered with what this client cannot read (not JSON, a line past
    MAX_ANSWER_BYTES, a message or a status of another shape): most likely a daemon of another
    version, one still running the old code after an upgrade. Said in one line, with what to do;
    its exit is unreachable's (nothing that was asked can be known)."""

    def __init__(self, what: str, detail: object = "") -> None:
        said = " ".join(str(detail).split())
        said = said if len(said) <= 120 else said[:117] + "..."
        super().__init__(
            f"the daemon's answer was not understood ({what}{': ' + said if said else ''}): a "
            "daemon of another version? After an upgrade restart it (`systemctl restart "
            "kimi-supervisor`); `kimi-mode --version` and `kimi-supervisor --version` say which"
        )


# The longest answer line read (a status, a history of 10,000 records): a longer one is not
# this protocol's, and is not read into memory whole.
MAX_ANSWER_BYTES = 64 * 1024 * 1024
# The first answer to any request comes at once (the daemon's loop never waits on I/O): a
# daemon that accepted the connection and said nothing for this long is wedged, whatever the
# request's own timeout (none: a wait that never returns, an outside review).
FIRST_ANSWER_S = 30.0
# The answers' types: anything else is another protocol's.
ANSWER_TYPES = ("reply", "event", "end")


def parse_answer(line: bytes) -> dict[str, Any]:
    """One answer line as the protocol has it (an object with a known `type`, a reply's and an
    end's `ok` a boolean), else NotUnderstood."""
    try:
        msg = json.loads(line)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise NotUnderstood("not JSON", e) from None
    if not isinstance(msg, dict) or msg.get("type") not in ANSWER_TYPES:
        kind = msg.get("type") if isinstance(msg, dict) else type(msg).__name__
        raise NotUnderstood(f"a message of type {kind!r}") from None
    if msg["type"] != "event" and not isinstance(msg.get("ok"), bool):
        raise NotUnderstood(f"a {msg['type']} without `ok`")
    if not isinstance(msg.get("data", {}), dict):
        raise NotUnderstood(f"a {msg['type']} whose `data` is not an object")
    return msg


def connect(path: Path, timeout_s: float = 5.0) -> socket.socket:
    """Connect within `timeout_s`. A Unix socket whose listen queue is full refuses a
    non-blocking connect with EAGAIN at once (a flood of other clients): tried again until the
    deadline, instead of failing."""
    import time

    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(path))
            return sock
        except BlockingIOError:
            sock.close()
            if time.monotonic() + pause >= deadline:
                raise Unreachable(
                    f"{path}: the daemon's connection queue stayed full for {timeout_s:g} s"
                ) from None
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        except OSError as e:
            sock.close()
            raise _unreachable(path, e) from None


def socket_group(path: Path) -> str | None:
    """The control group, as the socket (or, unreadable, its folder) is owned by it (the
    daemon gives the socket to control.group); None where neither says (root's, or no name)."""
    import grp

    for p in (path, path.parent):
        try:
            gid = os.stat(p).st_gid
        except OSError:
            continue
        if gid == 0:
            continue
        try:
            return grp.getgrgid(gid).gr_name
        except KeyError:
            return None
    return None


def _unreachable(path: Path, e: OSError) -> Unreachable:
    if e.errno in (errno.ENOENT, errno.ECONNREFUSED):
        return Unreachable(
            f"kimi-supervisor is not running (no daemon at {path}): "
            "`systemctl start kimi-supervisor`, or pass --socket"
        )
    if e.errno == errno.EACCES:
        group = socket_group(path)
        if group is None:
            return Unreachable(
                f"permission denied on {path}: be root or a member of the daemon's control "
                "group (control.group in its config: `sudo usermod -aG GROUP $USER`, then log "
                "in again)"
            )
        return Unreachable(
            f"permission denied on {path}: be root or a member of the group `{group}` "
            f"(`sudo usermod -aG {group} $USER`, then log in again)"
        )
    return Unreachable(f"cannot connect to {path}: {e.strerror or e}")


def exchange(
    path: Path,
    request: dict[str, Any],
    timeout_s: float | None = None,
    *,
    fds: Sequence[int] = (),
    tick: Callable[[], None] | None = None,
    tick_s: float = 1.0,
) -> Iterator[tuple[bytes, dict[str, Any]]]:
    """Send `request` and yield each answer line (raw, parsed) until the daemon closes.
    `timeout_s` bounds the whole exchange (TimedOut); None waits as long as it takes. `fds`
    travel with the request's first bytes (SCM_RIGHTS): a directory opened here, as the user,
    so that the daemon writes into what the user reached, in the user's view of the files.
    `tick` is called every `tick_s` while the exchange lasts, whether lines come or not (a live
    display's clock)."""
    import time

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    next_tick = time.monotonic() + tick_s
    first_by = time.monotonic() + FIRST_ANSWER_S
    sock = connect(path, 5.0 if timeout_s is None else min(5.0, timeout_s))
    with sock:
        data = json.dumps({"v": PROTOCOL_VERSION, **request}).encode() + b"\n"
        # A daemon that refuses the peer (not in the control group, too many connections)
        # answers and closes without reading: the send may then fail (EPIPE) with the answer
        # already waiting to be read. The answer is what the user is told.
        unsent: OSError | None = None
        try:
            if fds:
                data = data[socket.send_fds(sock, [data], list(fds)) :]
            sock.sendall(data)
        except OSError as e:
            unsent = e
        buf, answered, seen = bytearray(), False, 0  # seen: bytes of buf with no newline
        while True:
            while (end := buf.find(b"\n", seen)) >= 0:
                if end > MAX_ANSWER_BYTES:
                    raise NotUnderstood(f"an answer line of more than {MAX_ANSWER_BYTES} bytes")
                line = bytes(buf[:end])
                del buf[: end + 1]
                seen = 0
                if line.strip():
                    answered = True
                    yield line, parse_answer(line)
            seen = len(buf)
            if seen > MAX_ANSWER_BYTES:  # not read on: a line that long is no answer of ours
                raise NotUnderstood(f"an answer line of more than {MAX_ANSWER_BYTES} bytes")
            now = time.monotonic()
            if tick is not None and now >= next_tick:
                tick()
                now = time.monotonic()
                next_tick = max(next_tick + tick_s, now + tick_s / 2)
            wait_s = min(next_tick - now, 1.0) if tick is not None else 1.0
            if not answered and not buf and now >= first_by:
                raise Unreachable(
                    f"the daemon took the connection but answered nothing in "
                    f"{FIRST_ANSWER_S:g} s (it answers once its state is read, and at once "
                    "after): `systemctl status kimi-supervisor` says what it waits for"
                )
            if deadline is not None:
                left = deadline - now
                if left <= 0:
                    raise TimedOut()
                wait_s = min(left, wait_s)
            sock.settimeout(max(wait_s, 0.001))
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError as e:
                # The daemon refused without reading the request (forbidden, too many clients)
                # and closed: the kernel then resets the connection after the answer, whether
                # the send failed or went into the daemon's unread buffer. What it answered
                # (read above, whole) is all there is: no loss of the connection.
                if unsent is not None or (answered and not buf and e.errno == errno.ECONNRESET):
                    break
                raise Unreachable(f"lost the connection to the daemon: {e}") from None
            if not chunk:
                break
            buf += chunk
        if unsent is not None and not answered:
            raise Unreachable(f"the daemon closed the connection: {unsent}")
        if buf.strip():  # every answer ends with a newline: this one was cut short
            raise Unreachable(
                f"the daemon closed the connection in the middle of an answer ({len(buf)} "
                "bytes of it came); see `journalctl -u kimi-supervisor`"
            )
