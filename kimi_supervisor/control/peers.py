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


class PerUser:
    """Something held per uid (connections, history reads): `refuse` says whether `uid` may
    take one more, given how many it and everyone hold; `take` records it if so."""

    def __init__(self) -> None:
        self._held: dict[int, int] = {}
        self._lock = threading.Lock()

    def refuse(self, uid: int, mine: int, everyone: int) -> str | None:
        raise NotImplementedError

    def take(self, uid: int) -> str | None:
        """None if `uid` got one; else why not."""
        with self._lock:
            mine = self._held.get(uid, 0)
            why = self.refuse(uid, mine, sum(self._held.values()))
            if why is None:
                self._held[uid] = mine + 1
            return why

    def give_back(self, uid: int) -> None:
        with self._lock:
            self._held[uid] -= 1
            if not self._held[uid]:
                del self._held[uid]


class Slots(PerUser):
    """Connections held, in all and per user: who may take one more."""

    def __init__(self, total: int) -> None:
        super().__init__()
        self.total = total
        self.reserve = min(ROOT_RESERVE, max(total // 4, 1)) if total > 1 else 0
        self.per_user = max((total - self.reserve) // 2, 1)

    def refuse(self, uid: int, mine: int, everyone: int) -> str | None:
        privileged = uid in (0, os.geteuid())
        if everyone >= self.total:
            return f"all {self.total} connections are in use"
        if not privileged and everyone >= self.total - self.reserve:
            return f"the last {self.reserve} connections are kept for root"
        if not privileged and mine >= self.per_user:
            return f"uid {uid} already holds {mine} connections (at most {self.per_user})"
        return None


class Readers(PerUser):
    """How many history reads run at once: `per_user` per uid (root: twice that), `total` in
    all (root is never refused for the total). A flood from one member then costs a few
    readers' memory, and root's requests their time."""

    def __init__(self, per_user: int = 1, total: int = 4) -> None:
        super().__init__()
        self.per_user, self.total = per_user, total

    def refuse(self, uid: int, mine: int, everyone: int) -> str | None:
        if mine >= (self.per_user * 2 if uid == 0 else self.per_user):
            return f"uid {uid} already has {mine} history read(s) running; ask again"
        if everyone >= self.total and uid != 0:
            return f"{everyone} history reads are running; ask again in a moment"
        return None
