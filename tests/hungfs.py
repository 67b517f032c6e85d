"""A tiny FUSE file system whose reads never return: a hung NFS or object-store mount, for the
tests. It speaks the kernel's FUSE protocol on /dev/fuse itself (no libfuse, no fusermount:
Debian 12's base has neither, and the protocol needs a dozen messages), read-only, from a tree
given as JSON.

    python -m tests.hungfs --mount DIR --tree TREE.json [--mntns-of PID] [--hang MODE]

TREE.json maps a path to a file's content (a string), null for a folder, {"link": target} for
a symbolic link, or {"hang": size} for a file of `size` bytes whose reads never return. MODE
says how a read never returns:
- `stalled` (the default): once such a file is opened, the server reads no more requests, as a
  FUSE daemon stuck on a dead network does. A request the server has not read can be given up
  by a fatal signal (the kernel waits killably), like a hard NFS mount's (TASK_KILLABLE).
- `taken`: the server reads every request and never answers the hung file's reads. The kernel
  then waits uninterruptibly ("the request is in userspace: wait it out"): not even SIGKILL
  ends the reading thread until the server answers or the connection is aborted.

It prints "ready" once the mount answers, and serves until SIGTERM or until the mount goes
away; exiting closes /dev/fuse, which fails every request still waiting (ENOTCONN). With
--mntns-of PID the mount is made in that process's mount namespace (the daemon's unit has its
own: PrivateMounts=yes), and goes away with it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import json
import os
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

# Opcodes (linux/fuse.h).
LOOKUP, FORGET, GETATTR, READLINK, OPEN, READ, STATFS, RELEASE = 1, 2, 3, 5, 14, 15, 17, 18
FLUSH, INIT, OPENDIR, READDIR, RELEASEDIR, INTERRUPT, DESTROY = 25, 26, 27, 28, 29, 36, 38
BATCH_FORGET = 42
NO_REPLY = {FORGET, BATCH_FORGET, INTERRUPT}
IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid extlen pad
OUT_HEADER = struct.Struct("<IiQ")  # len error unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr, 88 bytes
FOPEN_DIRECT_IO = 1
CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4


@dataclass
class Node:
    ino: int
    mode: int
    data: bytes = b""
    size: int = 0
    hang: bool = False
    target: bytes = b""
    children: dict[bytes, int] = field(default_factory=dict)


def build(tree: dict[str, object]) -> dict[int, Node]:
    nodes = {1: Node(1, stat.S_IFDIR | 0o755)}
    by_path = {"": 1}

    def folder(path: str) -> int:
        if path in by_path:
            return by_path[path]
        parent = folder(os.path.dirname(path))
        ino = len(nodes) + 1
        nodes[ino] = Node(ino, stat.S_IFDIR | 0o755)
        nodes[parent].children[os.path.basename(path).encode()] = ino
        by_path[path] = ino
        return ino

    for path, spec in sorted(tree.items()):
        path = path.strip("/")
        if spec is None:
            folder(path)
            continue
        parent = folder(os.path.dirname(path))
        ino = len(nodes) + 1
        if isinstance(spec, str):
            node = Node(ino, stat.S_IFREG | 0o644, spec.encode(), len(spec.encode()))
        elif isinstance(spec, dict) and "link" in spec:
            target = str(spec["link"]).encode()
            node = Node(ino, stat.S_IFLNK | 0o777, target=target, size=len(target))
        elif isinstance(spec, dict) and "hang" in spec:
            node = Node(ino, stat.S_IFREG | 0o644, size=int(spec["hang"]), hang=True)
        else:
            raise ValueError(f"{path}: {spec!r}")
        nodes[ino] = node
        nodes[parent].children[os.path.basename(path).encode()] = ino
    return nodes


def attr(n: Node) -> bytes:
    nlink = 2 if stat.S_ISDIR(n.mode) else 1
    return ATTR.pack(n.ino, n.size, (n.size + 511) // 512, 0, 0, 0, 0, 0, 0, n.mode, nlink,
                     0, 0, 0, 4096, 0)  # fmt: skip


class Server:
    def __init__(self, fd: int, nodes: dict[int, Node], hang: str) -> None:
        self.fd, self.nodes, self.hang = fd, nodes, hang
        self.stalled = threading.Event()

    def reply(self, unique: int, body: bytes = b"", error: int = 0) -> None:
        try:
            os.write(self.fd, OUT_HEADER.pack(OUT_HEADER.size + len(body), -error, unique) + body)
        except OSError as e:
            if e.errno != errno.ENOENT:  # the request was interrupted meanwhile
                raise

    def entry(self, n: Node) -> bytes:
        # Valid for an hour: the kernel asks again as little as it can.
        return struct.pack("<QQQQII", n.ino, 0, 3600, 3600, 0, 0) + attr(n)

    def serve(self) -> None:
        while not self.stalled.is_set():
            try:
                raw = os.read(self.fd, 1 << 20)
            except OSError as e:
                if e.errno in (errno.ENODEV, errno.EBADF):  # unmounted
                    return
                if e.errno in (errno.EINTR, errno.ENOENT, errno.EAGAIN):
                    continue
                raise
            self.handle(raw)

    def handle(self, raw: bytes) -> None:
        _len, op, unique, nodeid, *_ = IN_HEADER.unpack_from(raw)
        body = raw[IN_HEADER.size :]
        node = self.nodes.get(nodeid)
        if op in NO_REPLY:
            return
        if op == INIT:
            readahead = struct.unpack_from("<IIII", body)[2]
            out = struct.pack("<IIIIHHIIHHIIH", 7, 31, readahead, 0, 16, 12, 1 << 17, 1, 32,
                              0, 0, 0, 0)  # fmt: skip
            self.reply(unique, out.ljust(64, b"\0"))
        elif op == DESTROY:
            self.reply(unique)
        elif node is None:
            self.reply(unique, error=errno.ENOENT)
        elif op == LOOKUP:
            name = body.split(b"\0", 1)[0]
            child = node.children.get(name)
            if child is None:
                self.reply(unique, error=errno.ENOENT)
            else:
                self.reply(unique, self.entry(self.nodes[child]))
        elif op == GETATTR:
            self.reply(unique, struct.pack("<QII", 3600, 0, 0) + attr(node))
        elif op == READLINK:
            self.reply(unique, node.target)
        elif op in (OPEN, OPENDIR):
            # Direct I/O: every read of a hung file reaches the server, none is served from a
            # page the kernel kept.
            flags = FOPEN_DIRECT_IO if node.hang else 0
            self.reply(unique, struct.pack("<QIi", 0, flags, 0))
            if node.hang and self.hang == "stalled":
                self.stalled.set()  # stuck from here on: read no more requests
        elif op == READ:
            _fh, offset, size = struct.unpack_from("<QQI", body)
            if node.hang:
                return  # taken, never answered
            self.reply(unique, node.data[offset : offset + size])
        elif op == READDIR:
            _fh, offset, size = struct.unpack_from("<QQI", body)
            entries = [(b".", node.ino), (b"..", 1), *node.children.items()]
            out = b""
            for i, (name, ino) in enumerate(entries[offset:], start=offset + 1):
                kind = (self.nodes[ino].mode & 0o170000) >> 12
                d = struct.pack("<QQII", ino, i, len(name), kind) + name
                d += b"\0" * (-len(d) % 8)
                if len(out) + len(d) > size:
                    break
                out += d
            self.reply(unique, out)
        elif op == STATFS:
            self.reply(unique, struct.pack("<QQQQQIIII", 0, 0, 0, 0, 0, 4096, 255, 4096, 0)
                       .ljust(80, b"\0"))  # fmt: skip
        elif op in (RELEASE, RELEASEDIR, FLUSH):
            self.reply(unique)
        else:
            self.reply(unique, error=errno.ENOSYS)


def mount(target: str, fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    data = f"fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other,default_permissions"
    flags = MS_RDONLY | MS_NOSUID | MS_NODEV
    if libc.mount(b"hungfs", target.encode(), b"fuse.hungfs", flags, data.encode()) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {target}: {os.strerror(e)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mount", required=True)
    p.add_argument("--tree", required=True)
    p.add_argument("--mntns-of", type=int)
    p.add_argument("--hang", choices=("stalled", "taken"), default="stalled")
    args = p.parse_args(argv)
    with open(args.tree) as f:
        nodes = build(json.load(f))
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    if args.mntns_of:
        ns = os.open(f"/proc/{args.mntns_of}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(ns, CLONE_NEWNS) != 0:  # os.setns is Python 3.12's
            raise OSError(ctypes.get_errno(), "setns")
        os.close(ns)
    mount(args.mount, fd)
    server = Server(fd, nodes, args.hang)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    t = threading.Thread(target=server.serve, daemon=True)
    t.start()
    os.stat(args.mount)  # answered once INIT is: the mount works
    print("ready", os.getpid(), flush=True)
    t.join()
    # Stalled: it never serves again, but stays (its mount hangs) until told to go.
    signal.pause()
    return 0


@contextlib.contextmanager
def mounted(
    mountpoint: os.PathLike[str] | str,
    tree: dict[str, object],
    mntns_of: int | None = None,
    hang: str = "stalled",
) -> Iterator[subprocess.Popen[bytes]]:
    """The file system mounted at `mountpoint` (made if missing) for the `with` block; then its
    server is ended (every request still waiting fails: a stuck reader returns) and the mount
    goes, whatever happened inside."""
    os.makedirs(mountpoint, exist_ok=True)
    spec = Path(tempfile.mkdtemp(prefix="hungfs-")) / "tree.json"
    spec.write_text(json.dumps(tree))
    args = [sys.executable, "-m", "tests.hungfs", "--mount", str(mountpoint), "--tree", str(spec),
            "--hang", hang]  # fmt: skip
    if mntns_of:
        args += ["--mntns-of", str(mntns_of)]
    server = subprocess.Popen(args, stdout=subprocess.PIPE, start_new_session=True,
                              cwd=Path(__file__).resolve().parent.parent)  # fmt: skip
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        if not line.startswith(b"ready"):
            raise RuntimeError(f"the FUSE server did not start: {line!r}")
        yield server
    finally:
        server.kill()
        server.wait()
        umount = ["umount", "-l", str(mountpoint)]
        if mntns_of:
            umount = ["nsenter", "-t", str(mntns_of), "-m", *umount]
        subprocess.run(umount, stderr=subprocess.DEVNULL, check=False)
        spec.unlink()
        spec.parent.rmdir()


def unavailable() -> str:
    """Why no FUSE file system can be mounted here ("" if one can)."""
    if os.geteuid() != 0:
        return "mounting FUSE without fusermount needs root"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse (the fuse module is not loaded)"
    try:
        with open("/proc/filesystems") as f:
            if "fuse" not in f.read().split():
                return "the kernel has no fuse file system"
    except OSError:
        pass
    return ""


if __name__ == "__main__":
    sys.exit(main())
