"""The HTTP port: vLLM's /health, /metrics, profiler and completion endpoints on localhost.
Plain http.client, short timeouts; every failure becomes a status code or a message, never an
exception upwards.

`timeout_s` is one deadline for the whole exchange: the connect, the request sent, the status
line and headers, and the body read. Each wait on the socket is cut to what is left of it, so a
server that trickles a byte a second (or a vLLM whose API server wedged mid-answer) holds the
caller no longer than `timeout_s`: the loop calls /health on its own thread. A per-wait timeout,
as urllib's, never ends while bytes keep coming. The host's name is resolved before the deadline
counts (vLLM's URL is the one literal address config.py resolved `vllm.host` to: a name that
resolves to several could reach another user's listener on one of them).
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from kimi_supervisor.ports import sockets

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

# At most this much of an error's body is kept (vLLM's JSON error, a proxy's page).
ERROR_BODY_BYTES = 4096
INTRUDER = "not vLLM"


@dataclass(frozen=True)
class HttpResult:
    status: int  # 0: no answer (refused, timed out, reset)
    body: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def intruder(self) -> bool:
        """The peer was not vLLM's unit's user's: nothing was sent, nothing believed."""
        return self.status == 0 and self.error.startswith(INTRUDER)

    @property
    def timed_out(self) -> bool:
        """No answer within the timeout: slow, which alone says nothing of a hang."""
        return self.status == 0 and "timed out" in self.error


def request(
    url: str,
    method: str = "GET",
    timeout_s: float | None = 2.0,
    *,
    json_body: dict[str, object] | None = None,
    max_bytes: int = 4096,
    headers: dict[str, str] | None = None,
    peer_uid: int | None = None,
) -> HttpResult:
    """`timeout_s` bounds the whole exchange (the module's docstring); None waits as long as the
    server takes (a profiler flush, whose caller bounds it by waiting on its own thread). At
    most `max_bytes` of the answer are read. A timeout's `error` says "timed out".

    `peer_uid`: the uid that must own the socket answering (vLLM's unit's `User=`). Another
    uid's listener gets nothing, not even the request line: the result is status 0 and its
    `intruder` says whose it was (an answer of someone else's is never vLLM's)."""
    data = json.dumps(json_body).encode() if json_body is not None else None
    if data is None and method == "POST":
        data = b""
    headers = {**(headers or {}), "Connection": "close", "User-Agent": "kimi-supervisor"}
    if json_body is not None:
        headers["Content-Type"] = "application/json"
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    conn: _Connection | None = None
    try:
        u = urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            return HttpResult(0, "", f"not an http:// URL: {url}")
        conn = _Connection(u.hostname, u.port or 80, deadline)
        if peer_uid is not None:
            conn.connect()
            assert conn.sock is not None
            owner = sockets.peer_uid(conn.sock)
            if owner != peer_uid:
                who = "cannot be told" if owner is None else f"is uid {owner}'s"
                return HttpResult(
                    0,
                    "",
                    f"{INTRUDER}: the socket answering {u.hostname}:{u.port} {who}, not vLLM's "
                    f"user's (uid {peer_uid}); nothing was sent to it",
                )
        conn.request(method, (u.path or "/") + (f"?{u.query}" if u.query else ""), data, headers)
        r = conn.getresponse()
        if 200 <= r.status < 300:
            return HttpResult(r.status, r.read(max_bytes).decode(errors="replace"))
        body = r.read(ERROR_BODY_BYTES).decode(errors="replace")
        return HttpResult(r.status, body, f"HTTP {r.status}")
    except TimeoutError:
        return HttpResult(0, "", f"timed out: no whole answer within {timeout_s:g} s")
    except (OSError, ValueError, http.client.HTTPException) as e:
        return HttpResult(0, "", str(e) or type(e).__name__)
    finally:
        if conn is not None:
            conn.close()


class _DeadlineSocket(socket.socket):
    """A socket whose every wait is cut to what is left of one deadline (None: no bound)."""

    deadline: float | None = None

    def _cut(self) -> None:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            self.settimeout(left)

    def connect(self, address: Any) -> None:
        self._cut()
        super().connect(address)

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        self._cut()
        return super().recv(bufsize, flags)

    def recv_into(self, buffer: WriteableBuffer, nbytes: int = 0, flags: int = 0) -> int:
        self._cut()  # what the response's reader (socket.makefile) calls
        return super().recv_into(buffer, nbytes, flags)

    def send(self, data: ReadableBuffer, flags: int = 0) -> int:
        self._cut()
        return super().send(data, flags)

    def sendall(self, data: ReadableBuffer, flags: int = 0) -> None:
        self._cut()  # one timeout for the whole call (Python 3.5+), cut to what is left
        super().sendall(data, flags)


class _Connection(http.client.HTTPConnection):
    """http.client's, with every socket wait under one deadline."""

    def __init__(self, host: str, port: int, deadline: float | None) -> None:
        super().__init__(host, port)
        self._deadline = deadline

    def connect(self) -> None:
        error: OSError = OSError(f"cannot resolve {self.host}")
        for family, kind, proto, _, address in socket.getaddrinfo(
            self.host, self.port, type=socket.SOCK_STREAM
        ):
            sock = _DeadlineSocket(family, kind, proto)
            sock.deadline = self._deadline
            try:
                sock.connect(address)
            except OSError as e:
                sock.close()
                error = e
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock = sock
            return
        raise error
