"""Run a command behind its own /dev, as a container runtime does: a private mount namespace in
which a fresh tmpfs covers the device directory and holds new nodes with the same numbers.

    python -m kimi_supervisor.sandbox.owndev --dev DIR [--dev DIR ...] -- COMMAND ...

Docker and podman with the NVIDIA container toolkit, systemd-nspawn and a chroot with its own
/dev all give a process `/dev/nvidia*` nodes that are other inodes with the device numbers of the
host's. For each DIR, every character device at its top level is made again with
`mknod` (same number, same mode), every stamped simulated node is copied (rule 8 of
sandbox/simgpu.py), symlinks are copied, and subdirectories become empty tmpfs mounts (a
container's /dev/shm is its own too). Nothing outside the new namespace changes.

As root it needs only CAP_SYS_ADMIN (and CAP_MKNOD for real nodes). Without root it first enters
a user namespace of its own, where it can mount but not make real device nodes: enough for the
simulated host, whose nodes are files.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import stat
import sys
from dataclasses import dataclass

from kimi_supervisor.sandbox.simreader import NODE_MAGIC

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_NOSUID = 0x2
MS_REC = 0x4000
MS_PRIVATE = 1 << 18


@dataclass(frozen=True)
class Entry:
    name: str
    st: os.stat_result
    link: str = ""
    data: bytes = b""


def read_dir(path: str) -> list[Entry]:
    """What DIR holds at its top level, read before it is covered."""
    out = []
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        st = os.lstat(full)
        if stat.S_ISLNK(st.st_mode):
            out.append(Entry(name, st, link=os.readlink(full)))
        elif stat.S_ISREG(st.st_mode):
            with open(full, "rb") as f:
                head = f.read(len(NODE_MAGIC))
                if head == NODE_MAGIC:
                    out.append(Entry(name, st, data=head + f.read()))
        elif stat.S_ISCHR(st.st_mode) or stat.S_ISDIR(st.st_mode):
            out.append(Entry(name, st))
    return out


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _unshare(flags: int) -> None:
    """unshare(2) (os.unshare exists only from Python 3.12)."""
    if _libc().unshare(ctypes.c_int(flags)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, *, flags: int, data: str) -> None:
    libc = _libc()
    enc = [None if x is None else x.encode() for x in (source, target, fstype)]
    if libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), data.encode() or None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype or ''} on {target}: {os.strerror(err)}")


def enter_namespace() -> None:
    """A mount namespace of our own, its mounts propagating nowhere."""
    if os.geteuid() == 0:
        _unshare(CLONE_NEWNS)
    else:
        uid, gid = os.getuid(), os.getgid()
        _unshare(CLONE_NEWUSER | CLONE_NEWNS)
        for name, text in (
            ("uid_map", f"0 {uid} 1"),
            ("setgroups", "deny"),
            ("gid_map", f"0 {gid} 1"),
        ):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    _mount(None, "/", None, flags=MS_REC | MS_PRIVATE, data="")


def remake(path: str, entries: list[Entry]) -> None:
    """A fresh tmpfs over `path`, holding new nodes for `entries`."""
    _mount("tmpfs", path, "tmpfs", flags=MS_NOSUID, data="mode=0755")
    for e in entries:
        full = os.path.join(path, e.name)
        mode = stat.S_IMODE(e.st.st_mode)
        if e.link:
            os.symlink(e.link, full)
        elif stat.S_ISCHR(e.st.st_mode):
            os.mknod(full, stat.S_IFCHR | mode, e.st.st_rdev)
            os.chmod(full, mode)
        elif stat.S_ISDIR(e.st.st_mode):
            os.mkdir(full, mode)
            _mount("tmpfs", full, "tmpfs", flags=MS_NOSUID, data=f"mode={mode:o}")
        else:
            with open(full, "wb") as f:
                f.write(e.data)
            os.chmod(full, mode)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="owndev", description=__doc__.splitlines()[0])
    p.add_argument("--dev", action="append", required=True, help="a device directory to remake")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    dirs = [os.path.abspath(d) for d in args.dev]
    read = [(d, read_dir(d)) for d in dirs]  # before any of them is covered
    enter_namespace()
    for d, entries in read:
        remake(d, entries)
    exe = shutil.which(command[0]) or command[0]
    sys.stdout.flush()
    os.execv(exe, command)


if __name__ == "__main__":
    main()
