"""sd_notify: READY, STATUS, WATCHDOG and EXTEND_TIMEOUT_USEC to the service manager.

A datagram to $NOTIFY_SOCKET (an abstract socket if it starts with '@'). Without the variable
(run by hand, or in tests) every call is a no-op.
"""

from __future__ import annotations

import os
import socket
import time


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        addr = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        self.address = "\0" + addr[1:] if addr.startswith("@") else addr
        self._sock: socket.socket | None = None
        usec = os.environ.get("WATCHDOG_USEC", "")
        pid = os.environ.get("WATCHDOG_PID", "")
        on = usec.isdigit() and (not pid or pid == str(os.getpid()))
        # Ping at a third of the interval: two missed pings still leave time for a third.
        self.watchdog_interval_s = int(usec) / 1e6 / 3 if on else 0.0

    def send(self, **fields: str | int) -> None:
        if not self.address:
            return
        msg = "\n".join(f"{k.upper()}={v}" for k, v in fields.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(msg, self.address)
        except OSError:
            pass  # the manager went away: nothing to tell

    def ready(self, status: str) -> None:
        self.send(ready=1, status=status, mainpid=os.getpid())

    def status(self, text: str) -> None:
        self.send(status=text)

    def watchdog(self) -> None:
        self.send(watchdog=1)

    def extend_timeout(self, seconds: float) -> None:
        self.send(extend_timeout_usec=int(seconds * 1e6))

    def reloading(self, status: str) -> None:
        """A reload begins; READY=1 ends it (systemd 253's notify-reload wants MONOTONIC_USEC)."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.send(reloading=1, status=status, monotonic_usec=usec)

    def stopping(self, status: str) -> None:
        self.send(stopping=1, status=status)
