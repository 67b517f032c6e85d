"""inotify for the tests, through ctypes (the standard library has none): watch files for
IN_OPEN and say whether anyone opened them. An open with O_PATH opens nothing and reports
nothing; any real open of the watched inode does, whoever made it.

    python -m tests.inotify PATH...   prints "ready", then one line per IN_OPEN seen, until
                                      killed (a watcher running as another user, or as root)
"""

from __future__ import annotations

import ctypes
import os
import select
import struct
import sys
import time

IN_OPEN = 0x00000020
IN_DONT_FOLLOW = 0x02000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
EVENT = struct.Struct("iIII")  # wd mask cookie len

_libc = ctypes.CDLL(None, use_errno=True)


class Watch:
    """IN_OPEN on each path (the path's own inode: a link is not followed)."""

    def __init__(self, *paths: str | os.PathLike[str]) -> None:
        self.fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.names: dict[int, str] = {}
        for p in paths:
            wd = _libc.inotify_add_watch(self.fd, os.fsencode(p), IN_OPEN | IN_DONT_FOLLOW)
            if wd < 0:
                e = ctypes.get_errno()
                raise OSError(e, f"inotify_add_watch {p}: {os.strerror(e)}")
            self.names[wd] = str(p)

    def opened(self, wait_s: float = 0.0) -> list[str]:
        """The watched paths opened since the last call (waiting up to `wait_s` for one)."""
        out: list[str] = []
        deadline = time.monotonic() + wait_s
        while True:
            wait = 0.0 if out else max(deadline - time.monotonic(), 0.0)
            ready, _, _ = select.select([self.fd], [], [], wait)
            if not ready:
                return out
            raw = os.read(self.fd, 65536)
            at = 0
            while at < len(raw):
                wd, mask, _cookie, length = EVENT.unpack_from(raw, at)
                at += EVENT.size + length
                if mask & IN_OPEN and wd in self.names:
                    out.append(self.names[wd])

    def close(self) -> None:
        os.close(self.fd)


def main() -> int:
    w = Watch(*sys.argv[1:])
    print("ready", flush=True)
    while True:
        for name in w.opened(3600):
            print(f"opened {name}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
