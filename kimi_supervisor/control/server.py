"""The control socket: a Unix stream socket the daemon listens on, one thread per connection.

Safety first: one daemon per socket (an flock on SOCKET.lock, released by the kernel when the
daemon dies, so a stale socket from a crash is replaced and a live daemon is never displaced);
the socket's directory must be writable by its owner only; the socket is 0660 root:GROUP; each
peer's credentials (SO_PEERCRED) are checked again before anything is read, and refusals are
logged. Lines are capped; a request must arrive whole within `idle_timeout_s` (a total
deadline, so a client trickling a byte a second is dropped too), and a client that does not read
what it is sent for that long is dropped. Slots are shared out per user: no user other than root
(and the daemon's own) may hold more than half of the slots, and the last ROOT_RESERVE slots are
root's, so group members cannot lock root out. A client that goes away mid-stream only ends its
own thread. Nothing here changes the daemon's state: requests go to `handle`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import os
import select
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kimi_supervisor.control.peers import Peer, Slots, allowed, peer_of
from kimi_supervisor.control.protocol import (
    ProtocolError,
    Reply,
    encode,
    parse_request,
)


class ControlError(Exception):
    """The socket cannot be set up; the message says why and what to do."""


# accept(2) errors that say the daemon is out of a resource: retried after a doubling wait.
OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_BACKOFF_S = 0.01
ACCEPT_BACKOFF_MAX_S = 1.0


class Connection:
    """One client. `send` never raises: a client that went away just makes `alive` False."""

    def __init__(self, sock: socket.socket, peer: Peer) -> None:
        self.sock = sock
        self.peer = peer
        self.alive = True
        self._lock = threading.Lock()
        # Descriptors the client passed with its request (SCM_RIGHTS); closed when the
        # connection ends unless a handler took one.
        self.fds: list[int] = []

    def take_fd(self) -> int | None:
        """The descriptor the client passed, now the caller's to close; None if none."""
        return self.fds.pop(0) if self.fds else None

    def close_fds(self) -> None:
        while self.fds:
            with contextlib.suppress(OSError):
                os.close(self.fds.pop())

    def send(self, msg: Any) -> bool:
        data = encode(msg)
        with self._lock:
            if not self.alive:
                return False
            try:
                self.sock.sendall(data)
            except OSError:
                self.alive = False
        return self.alive

    def send_parts(self, parts: Iterable[bytes]) -> bool:
        """One message sent in pieces, none of them joined in memory (a long history)."""
        with self._lock:
            if not self.alive:
                return False
            try:
                for part in parts:
                    self.sock.sendall(part)
            except OSError:
                self.alive = False
        return self.alive

    def hung_up(self) -> bool:
        """True once the client has closed its end (checked without blocking)."""
        if not self.alive:
            return True
        try:
            if not select.select([self.sock], [], [], 0)[0]:
                return False  # nothing to read, not even the end: still there
            data = self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, TimeoutError):
            return False
        except OSError:
            self.alive = False
            return True
        if data == b"":
            self.alive = False
        return not self.alive


def lock_path(socket_path: Path) -> Path:
    """SOCKET.lock: held (flock) by the daemon that owns SOCKET."""
    return socket_path.with_name(socket_path.name + ".lock")


def running_daemon(path: Path) -> int | None:
    """The PID of the daemon that holds `path`'s lock (SOCKET.lock), or None if none runs."""
    try:
        fd = os.open(lock_path(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        return int(text) if text.isdigit() else -1
    finally:
        os.close(fd)
    return None


Handler = Callable[[Any, Connection], None]
Logger = Callable[..., None]


class ControlServer:
    def __init__(
        self,
        path: Path,
        group: str,
        handle: Handler,
        *,
        log: Logger,
        max_clients: int = 128,
        max_line_bytes: int = 64 * 1024,
        idle_timeout_s: float = 10.0,
    ) -> None:
        self.path = path
        self.group = group
        self.handle = handle
        self.log = log
        self.max_line_bytes = max_line_bytes
        self.idle_timeout_s = idle_timeout_s
        self._slots = Slots(max_clients)
        self._sock: socket.socket | None = None
        self._lock_fd: int | None = None
        self.group_gid: int | None = None
        self._closing = False
        self._stopped = threading.Event()  # set by close: ends a backoff at once

    # -- set-up --
    def _check_directory(self) -> None:
        d = self.path.parent
        try:
            d.mkdir(mode=0o755, parents=True, exist_ok=True)
            st = os.stat(d)
        except OSError as e:
            raise ControlError(f"cannot create the socket directory {d}: {e}") from e
        if st.st_uid != os.geteuid():
            raise ControlError(
                f"{d} belongs to uid {st.st_uid}, not to the daemon's uid {os.geteuid()}: "
                "another user could replace the socket; use a directory the daemon owns"
            )
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            os.chmod(d, stat.S_IMODE(st.st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))

    def _take_lock(self) -> None:
        fd = os.open(
            lock_path(self.path), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
        )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ControlError(
                f"another kimi-supervisor is running (PID {holder}) and owns {self.path}: "
                "stop it first (systemctl stop kimi-supervisor)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def start(self) -> None:
        self.listen()
        self.serve()

    def listen(self) -> None:
        """Take the daemon's lock and listen: a second daemon stops here, and a client that
        connects from now on waits in the kernel's queue until `serve` (the daemon answers
        nothing before it has read its state)."""
        self._check_directory()
        self._take_lock()
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(st.st_mode):
                raise ControlError(
                    f"{self.path} exists and is not a socket: move it away, the daemon does not "
                    "delete files it did not create"
                )
            # We hold the lock, so no daemon is behind this socket: a crash left it.
            self.log("control_socket_stale_replaced", path=str(self.path))
            os.unlink(self.path)
        try:
            self.group_gid = grp.getgrnam(self.group).gr_gid
        except KeyError:
            self.group_gid = None
            self.log(
                "control_group_missing",
                level="warning",
                group=self.group,
                message=f"group {self.group!r} does not exist: only root may use the socket "
                f"(create it: groupadd {self.group})",
            )
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old)
        os.chown(self.path, -1, self.group_gid if self.group_gid is not None else -1)
        os.chmod(self.path, 0o660 if self.group_gid is not None else 0o600)
        sock.listen(512)  # a burst of clients waits in the kernel's queue, not refused
        self._sock = sock

    def serve(self) -> None:
        """Answer clients, on a thread of its own."""
        threading.Thread(target=self._accept_loop, daemon=True, name="control-accept").start()

    def close(self) -> None:
        self._closing = True
        self._stopped.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
            self._sock = None
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- serving --
    def _accept_loop(self) -> None:
        backoff = 0.0
        while not self._closing and self._sock is not None:
            try:
                conn, _ = self._sock.accept()
            except OSError as e:
                if self._closing:
                    return
                if e.errno not in OUT_OF_RESOURCES:
                    continue
                # Out of descriptors or memory: the client stays queued and accept fails at
                # once again, so retrying at once spins a core. Wait, doubling, until it works.
                if not backoff:
                    self.log("control_accept_failed", level="error", error=str(e))
                backoff = min(max(backoff * 2, ACCEPT_BACKOFF_S), ACCEPT_BACKOFF_MAX_S)
                self._stopped.wait(backoff)
                continue
            if backoff:
                self.log("control_accept_recovered")
                backoff = 0.0
            try:
                peer = peer_of(conn)
            except OSError:
                conn.close()
                continue
            refused = self._slots.take(peer.uid)
            if refused:
                with contextlib.suppress(OSError):
                    conn.setblocking(False)
                    conn.send(
                        encode(
                            Reply(
                                ok=False,
                                code="too_many_clients",
                                message=f"too many clients: {refused}; try again later",
                            )
                        )
                    )
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True).start()

    def _serve(self, sock: socket.socket, peer: Peer) -> None:
        conn: Connection | None = None
        try:
            conn = Connection(sock, peer)
            if not allowed(peer, self.group_gid):
                self.log("control_refused", level="warning", peer=peer.describe())
                conn.send(
                    Reply(
                        ok=False,
                        code="forbidden",
                        message=f"uid {peer.uid} may not control kimi-supervisor: be root or a "
                        f"member of group {self.group!r}",
                    )
                )
                return
            try:
                line = self._read_line(conn)
                request = parse_request(line)
            except ProtocolError as e:
                self.log("control_bad_request", level="warning", peer=peer.describe(), code=e.code)
                conn.send(Reply(ok=False, code=e.code, message=str(e)))
                return
            # From here on a client that reads nothing for idle_timeout_s is dropped: sends time
            # out (Connection.send marks it gone), and its thread ends.
            sock.settimeout(self.idle_timeout_s)
            try:
                self.handle(request, conn)
            except Exception as e:
                self.log("control_handler_failed", level="error", error=repr(e))
                conn.send(Reply(ok=False, code="internal", message=f"internal error: {e}"))
        except OSError:
            pass  # the client went away
        finally:
            if conn is not None:
                conn.close_fds()
            with contextlib.suppress(OSError):
                sock.close()
            self._slots.give_back(peer.uid)

    def _read_line(self, conn: Connection) -> bytes:
        """The request line, and into `conn.fds` the first descriptor that came with it (the
        kernel drops any more in one message; later messages' are closed at once)."""
        sock = conn.sock
        deadline = time.monotonic() + self.idle_timeout_s
        buf = b""
        while b"\n" not in buf:
            try:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                chunk, fds, _flags, _addr = socket.recv_fds(sock, 65536, 1, socket.MSG_CMSG_CLOEXEC)
                for fd in fds:  # one per request: a client sending more per chunk is not kept
                    if conn.fds:
                        os.close(fd)
                    else:
                        conn.fds.append(fd)
            except TimeoutError:
                raise ProtocolError(
                    "idle", f"no whole request within {self.idle_timeout_s:g} s; closing"
                ) from None
            if not chunk:
                if buf.strip():
                    break  # a last line without its newline still counts
                raise ProtocolError("bad_request", "the connection closed before a request")
            buf += chunk
            if len(buf) > self.max_line_bytes:
                raise ProtocolError(
                    "too_long", f"request longer than {self.max_line_bytes} bytes; closing"
                )
        line = buf.split(b"\n", 1)[0]
        if len(line) > self.max_line_bytes:
            raise ProtocolError("too_long", f"request longer than {self.max_line_bytes} bytes")
        return line
