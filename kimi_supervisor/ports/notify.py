"""sd_notify: READY, STATUS, WATCHDOG and EXTEND_TIMEOUT_USEC to the service manager, through
libsystemd's own sd_notify (pystemd.daemon.notify), which knows every form $NOTIFY_SOCKET takes
(a path, an abstract socket, vsock). Without the variable (run by hand, or in tests) every call is
a no-op.
"""

from __future__ import annotations

import os
import time

from kimi_supervisor.model import printable


class Notifier:
    def __init__(self, enabled: bool | None = None) -> None:
        """`enabled`: None (the default) when systemd gave the daemon $NOTIFY_SOCKET."""
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET")) if enabled is None else enabled
        usec = os.environ.get("WATCHDOG_USEC", "")
        pid = os.environ.get("WATCHDOG_PID", "")
        on = usec.isdigit() and (not pid or pid == str(os.getpid()))
        # Ping at a third of the interval: two missed pings still leave time for a third.
        self.watchdog_interval_s = int(usec) / 1e6 / 3 if on else 0.0

    def send(self, **fields: str | int) -> None:
        if not self.enabled:
            return
        import pystemd.daemon

        # unset_environment=0: the re-executed daemon (a reload) notifies too. sd_notify returns
        # a negative errno when the manager went away: nothing to tell then.
        # A text that is not UTF-8 (a file's name another user chose) has its odd bytes
        # escaped: sd_notify carries bytes, and an encoding error would end the daemon.
        # Each field is one line: a newline in a value (a process's name another user chose)
        # would add a field of its own, and the manager believes root (MAINPID=, STOPPING=).
        safe = {
            k: printable(v.encode("utf-8", "backslashreplace").decode())
            if isinstance(v, str)
            else v
            for k, v in fields.items()
        }
        pystemd.daemon.notify(0, **safe)

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
