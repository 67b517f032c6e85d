"""Who is on the other end of the control socket, whether they may ask, and how many
connections each user may hold (so that group members cannot lock root out)."""

from __future__ import annotations

import os
import socket
import struct
import threading
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int

    def describe(self) -> str:
        return f"PID {self.pid}, uid {self.uid}, gid {self.gid}"


def peer_of(sock: socket.socket) -> Peer:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return Peer(*struct.unpack("3i", raw))


def _groups_of(pid: int) -> set[int]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                return {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return set()


def allowed(peer: Peer, group_gid: int | None) -> bool:
    """Root, the daemon's own user, or a member of the control group (primary or supplementary)."""
    if peer.uid in (0, os.geteuid()):
        return True
    if group_gid is None:
        return False
    return peer.gid == group_gid or group_gid in _groups_of(peer.pid)


# Slots that only root (and the daemon's own user) may take.
ROOT_RESERVE = 8


class Slots:
    """Connections held, in all and per user: who may take one more."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.reserve = min(ROOT_RESERVE, max(total // 4, 1)) if total > 1 else 0
        self.per_user = max((total - self.reserve) // 2, 1)
        self._held: dict[int, int] = {}
        self._lock = threading.Lock()

    def take(self, uid: int) -> str | None:
        """None if `uid` got a slot; else why not."""
        with self._lock:
            n = sum(self._held.values())
            mine = self._held.get(uid, 0)
            privileged = uid in (0, os.geteuid())
            if n >= self.total:
                return f"all {self.total} connections are in use"
            if not privileged and n >= self.total - self.reserve:
                return f"the last {self.reserve} connections are kept for root"
            if not privileged and mine >= self.per_user:
                return f"uid {uid} already holds {mine} connections (at most {self.per_user})"
            self._held[uid] = mine + 1
            return None

    def give_back(self, uid: int) -> None:
        with self._lock:
            self._held[uid] -= 1
            if not self._held[uid]:
                del self._held[uid]
