"""Listening TCP sockets: which socket inodes listen on a port, and at which address; bound Unix
sockets, by path and by inode.

Asked through the kernel's sock_diag netlink interface (what `ss -lnt` uses), for listening
sockets only: the kernel then walks only its listening table. Reading /proc/net/tcp and tcp6
walks every connection's hash bucket too, which cost 9 ms per look on a 2-core VM; that file is
the fallback where netlink is refused.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_TCP_LISTEN = 10
_NLMSGHDR = struct.Struct("=IHHII")
# inet_diag_req_v2: family, protocol, ext, pad, states; then inet_diag_sockid (48 bytes)
_REQ = struct.Struct("=BBBxI48x")
# inet_diag_msg: family, state, timer, retrans; sockid: sport, dport (big-endian), src, dst
# (16 bytes each), if, cookie (2 x u32); then expires, rqueue, wqueue, uid, inode
_MSG = struct.Struct("=BBBB2s2s16s16sI8sIIIII")


def listening_inodes(port: int) -> dict[int, Address]:
    """Socket inode -> local address, for sockets listening on TCP `port` (IPv4 or IPv6) in
    this network namespace."""
    return {inode: listener.address for inode, listener in listening(port).items()}


@dataclass(frozen=True)
class Listener:
    address: Address
    uid: int  # its owner: the user whose process made it
    family: int


def listening(port: int) -> dict[int, Listener]:
    """Socket inode -> the listener, for sockets listening on TCP `port` (IPv4 or IPv6) in
    this network namespace."""
    try:
        out: dict[int, Listener] = {}
        for family in (socket.AF_INET, socket.AF_INET6):
            out.update(_diag(family, port))
        return out
    except (OSError, struct.error, ValueError):  # refused (some sandboxes) or not understood
        return _from_proc(port)


def _diag(family: int, port: int) -> dict[int, Listener]:
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as s:
        s.settimeout(2.0)
        req = _REQ.pack(family, socket.IPPROTO_TCP, 0, 1 << _TCP_LISTEN)
        hdr = _NLMSGHDR.pack(
            _NLMSGHDR.size + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0
        )
        s.sendall(hdr + req)
        out: dict[int, Listener] = {}
        while True:
            data = s.recv(65536)
            offset = 0
            while offset + _NLMSGHDR.size <= len(data):
                length, kind, _flags, _seq, _pid = _NLMSGHDR.unpack_from(data, offset)
                if kind == _NLMSG_DONE:
                    return out
                if kind == _NLMSG_ERROR:
                    errno = -struct.unpack_from("=i", data, offset + _NLMSGHDR.size)[0]
                    raise OSError(errno, os.strerror(errno))
                msg = _MSG.unpack_from(data, offset + _NLMSGHDR.size)
                fam, state, sport, src, uid, inode = (msg[0], msg[1], msg[4], msg[6], msg[13],
                                                      msg[14])  # fmt: skip
                if state == _TCP_LISTEN and int.from_bytes(sport, "big") == port:
                    raw = src[:4] if fam == socket.AF_INET else src
                    out[inode] = Listener(_unmapped(ipaddress.ip_address(raw)), uid, fam)
                if length <= 0:
                    return out
                offset += (length + 3) & ~3


def _unmapped(addr: Address) -> Address:
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        return addr.ipv4_mapped
    return addr


def _proc_rows() -> Iterator[tuple[int, list[str]]]:
    """The family and columns of each socket in /proc/net/tcp and tcp6 (netlink's fallback)."""
    for family, table in ((socket.AF_INET, "tcp"), (socket.AF_INET6, "tcp6")):
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            yield family, line.split()


def _from_proc(port: int) -> dict[int, Listener]:
    out: dict[int, Listener] = {}
    for family, cols in _proc_rows():
        local, state, uid, inode = cols[1], cols[3], int(cols[7]), int(cols[9])
        addr, _, port_hex = local.rpartition(":")
        if state == "0A" and int(port_hex, 16) == port:  # 0A = LISTEN
            out[inode] = Listener(_proc_address(addr), uid, family)
    return out


def _proc_address(hex_addr: str) -> Address:
    """/proc/net/tcp's local address: 32-bit words in host (little-endian) byte order."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return _unmapped(ipaddress.ip_address(words))


def bound_unix_paths(proc_net_unix: Path = Path("/proc/net/unix")) -> set[str]:
    """Paths that a live Unix socket is bound to (in this network namespace). A socket file
    whose process died stays on disk but leaves this list: nothing can connect to it."""
    out = set()
    try:
        with open(proc_net_unix, encoding="utf-8", errors="replace") as f:
            next(f, None)  # the header
            for line in f:
                parts = line.split(None, 7)
                if len(parts) == 8 and parts[7].startswith("/"):
                    out.add(parts[7].rstrip("\n"))
    except FileNotFoundError:
        pass
    return out


def unix_paths_by_inode(proc_net_unix: Path = Path("/proc/net/unix")) -> dict[int, str]:
    """Socket inode -> the path it is bound to, for every bound Unix socket in this network
    namespace (a listener's accepted sockets show its path too). The path is as the binder
    named it, in its own view of the files."""
    out: dict[int, str] = {}
    try:
        with open(proc_net_unix, encoding="utf-8", errors="replace") as f:
            next(f, None)  # the header
            for line in f:
                parts = line.split(None, 7)
                if len(parts) == 8 and parts[7].startswith("/") and parts[6].isdigit():
                    out[int(parts[6])] = parts[7].rstrip("\n")
    except FileNotFoundError:
        pass
    return out


def peer_uid(sock: socket.socket) -> int | None:
    """The uid that owns the listener `sock` (a TCP connection to a local address) reached: the
    listening socket on the peer's port that the kernel gives that address to, the one bound
    to it exactly, else a wildcard. The listener, never the connection's other end: a listener
    that defers its accept (TCP_DEFER_ACCEPT) leaves a request socket there, which sock_diag
    says is root's. None where it cannot be told (no such listener, listeners of several uids
    for one address, netlink and /proc/net refused): never a guess."""
    try:
        theirs = sock.getpeername()[:2]
    except OSError:
        return None
    peer, port = _unmapped(ipaddress.ip_address(theirs[0])), int(theirs[1])
    found = list(listening(port).values())
    exact = [x for x in found if x.address == peer]
    # A wildcard of the peer's own family first ([::] serves IPv4 too, unless IPV6_V6ONLY).
    same = socket.AF_INET if isinstance(peer, ipaddress.IPv4Address) else socket.AF_INET6
    wild = [x for x in found if x.address.is_unspecified]
    for group in (exact, [x for x in wild if x.family == same], wild):
        uids = {x.uid for x in group}
        if uids:
            return uids.pop() if len(uids) == 1 else None
    return None
