"""The leftovers step's rule by owner (teardown/leftovers.py): vLLM's files are its own user's,
and no other program's; vLLM run as root is judged by what its processes held.

The rule's table is read on synthetic `lstat` results; then real files in a scratch folder and
real processes (a tree that maps, opens or binds, as vLLM's workers do), with the bystanders'
files and processes checked after each removal. Planting another user's files needs root."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kimi_supervisor.config import TeardownConfig
from kimi_supervisor.ports import processes
from kimi_supervisor.ports.processes import ProcessRef
from kimi_supervisor.teardown import leftovers
from kimi_supervisor.teardown.events import LeftoverKept, LeftoversUnlisted
from kimi_supervisor.teardown.leftovers import ROOTS_RULE, Owner

VLLM = 64_321  # vLLM's own user (the package's kimi-vllm), as a uid
OTHER = 65_534  # another user on the host
START = 1_000_000.0  # when vLLM's unit last left inactive
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="planting another user's files needs root"
)


def lstat(
    uid: int, ctime: float = START + 5, kind: int = stat.S_IFREG, ino: int = 7, dev: int = 41
) -> os.stat_result:
    # st_mode, st_ino, st_dev, st_nlink, st_uid, st_gid, st_size, st_atime, st_mtime, st_ctime
    return os.stat_result((kind | 0o600, ino, dev, 1, uid, uid, 0, ctime, ctime, ctime))


# -- the rule, row by row ------------------------------------------------------------------------
SHM, TMP, CACHE = Path("/dev/shm"), Path("/tmp"), Path("/dev/shm/vllm-cache")
SOCKET = "0d49a536-9d4c-4f01-ad55-3291091f7f92"  # a ZMQ socket's name: a UUID
OLD = START - 60
AS_ITS_USER = Owner(frozenset({VLLM}), START, pids=frozenset({4321}))
FROM_ITS_UNIT = Owner.of([], activated_at=START, unit_uid=VLLM)  # no vLLM process running
UNKNOWN_USER = Owner.of([], activated_at=START, unit_uid=None)
AS_ROOT = Owner(  # vLLM run as root: its tree held inode 100 and 11, bound SOCKET
    frozenset({0}),
    START,
    pids=frozenset({4321}),
    held=frozenset({(1, 41, 100), (1, 41, 11)}),
    bound=frozenset({f"/tmp/{SOCKET}"}),
)
BOTH = Owner(frozenset({0, VLLM}), START, pids=frozenset({1234}))  # root until its next start
ITS_DIR, DIR_AS_ROOT = lstat(VLLM, kind=stat.S_IFDIR), lstat(0, kind=stat.S_IFDIR)
NOT_VLLMS = f"owned by uid 0, not vLLM's user ({VLLM})"

# owner, the entry, its lstat, what is inside it (a directory), and why it is kept (None: it is
# vLLM's, removed once unused). A reason is matched as a part of what the rule says.
RULE = [
    pytest.param(AS_ITS_USER, SHM / "psm_3f2a9c", lstat(VLLM), None, None,
                 id="a file of vLLM's own user made since its start is vLLM's"),
    pytest.param(AS_ITS_USER, SHM / "sem.mp-x1", lstat(VLLM), None, None,
                 id="a semaphore of vLLM's own user made since its start is vLLM's"),
    *[pytest.param(AS_ITS_USER, SHM / name, lstat(0), None, NOT_VLLMS,
                   id=f"a root program's {name} is never vLLM's when vLLM runs as its own user")
      for name in ("psm_3f2a9c", "sem.mp-abc", "vllm-cache", "nccl-x")],
    pytest.param(AS_ITS_USER, SHM / "psm_t2", lstat(OTHER), None, "uid 65534",
                 id="another user's file is never vLLM's"),
    pytest.param(FROM_ITS_UNIT, SHM / "psm_1", lstat(VLLM), None, None,
                 id="with no vLLM running its unit's user still owns its leftovers"),
    pytest.param(FROM_ITS_UNIT, SHM / "psm_2", lstat(0), None, "owned by uid 0",
                 id="with no vLLM running a root file is not vLLM's"),
    pytest.param(UNKNOWN_USER, SHM / "psm_1", lstat(VLLM), None, "vLLM's user is unknown",
                 id="a vLLM user that cannot be named makes nothing vLLM's and says so"),
    pytest.param(AS_ITS_USER, SHM / "psm_1", lstat(VLLM, ctime=OLD), None,
                 "older than vLLM's start", id="a file older than vLLM's start is kept"),
    pytest.param(AS_ITS_USER, SHM / "4321-tp:0-0-cpushm_0", lstat(VLLM, ctime=OLD), None, None,
                 id="an older file whose name begins with a pid of vLLM's tree is vLLM's"),
    pytest.param(AS_ROOT, SHM / "psm_held", lstat(0, ino=100), None, None,
                 id="vLLM as root loses a file its tree held"),
    pytest.param(AS_ROOT, SHM / "psm_other", lstat(0, ino=101), None, ROOTS_RULE,
                 id="vLLM as root keeps every root file its tree did not hold"),
    pytest.param(AS_ROOT, SHM / "psm_x", lstat(0, ino=100, dev=42), None, ROOTS_RULE,
                 id="vLLM as root keeps the same inode number on another file system"),
    pytest.param(AS_ROOT, SHM / "4321-tp:0-0-cpushm_0", lstat(0, ino=102), None, None,
                 id="vLLM as root loses a file whose name begins with one of its pids"),
    pytest.param(AS_ROOT, TMP / SOCKET, lstat(0, kind=stat.S_IFSOCK, ino=103), None, None,
                 id="vLLM as root loses a socket its tree bound"),
    pytest.param(AS_ROOT, TMP / "34903d81-8cd4-4f43-9f89-6453bccef842",
                 lstat(0, kind=stat.S_IFSOCK, ino=104), None, ROOTS_RULE,
                 id="vLLM as root keeps a socket its tree did not bind"),
    pytest.param(AS_ROOT, SHM / "psm_held", lstat(0, START - 1, ino=100), None, "older",
                 id="vLLM as root keeps what its tree held from before its start"),
    pytest.param(BOTH, SHM / "psm_a1234b", lstat(0), None, ROOTS_RULE,
                 id="digits inside a name never name a pid of vLLM's tree"),
    pytest.param(BOTH, SHM / "sem.mp-1234", lstat(VLLM, ctime=OLD), None, "older",
                 id="digits after a semaphore's prefix never name a pid of vLLM's tree"),
    pytest.param(BOTH, SHM / "1234-tp:0-0-cpushm_0", lstat(0), None, None,
                 id="only a name that begins with a pid of vLLM's tree names it"),
    pytest.param(AS_ITS_USER, CACHE, ITS_DIR, [(CACHE / "kv.bin", lstat(VLLM, ino=9))], None,
                 id="a directory of vLLM's user with everything inside it vLLM's is vLLM's"),
    pytest.param(AS_ITS_USER, CACHE, ITS_DIR,
                 [(CACHE / "kv.bin", lstat(VLLM, ino=9)), (CACHE / "root.bin", lstat(0, ino=10))],
                 f"{CACHE / 'root.bin'} inside it is owned by uid 0",
                 id="a directory of vLLM's user with a root file inside it is kept"),
    pytest.param(AS_ROOT, CACHE, DIR_AS_ROOT, [(CACHE / "kv.bin", lstat(0, ino=11))], None,
                 id="vLLM as root loses a directory its tree held something in"),
    pytest.param(AS_ROOT, CACHE, DIR_AS_ROOT, [(CACHE / "kv.bin", lstat(0, ino=12))], ROOTS_RULE,
                 id="vLLM as root keeps a directory of which its tree held nothing"),
]  # fmt: skip


@pytest.mark.parametrize(("owner", "path", "st", "inside", "kept_because"), RULE)
def test_the_leftovers_rule_removes_only_what_is_provably_vllms(
    owner: Owner,
    path: Path,
    st: os.stat_result,
    inside: list[tuple[Path, os.stat_result]] | None,
    kept_because: str | None,
) -> None:
    why = owner.why_not(path, st, inside)
    if kept_because is None:
        assert why is None, f"{path} kept: {why}"
    else:
        assert why is not None and kept_because in why, f"{path}: {why}"


def test_vllms_user_is_its_units_user_and_none_when_that_cannot_be_named() -> None:
    assert FROM_ITS_UNIT.uids == {VLLM}
    assert UNKNOWN_USER.uids == frozenset()


def test_the_owner_is_the_units_user_and_every_user_vllms_processes_run_as() -> None:
    """A vLLM started before its unit got `User=` (an upgrade) runs as root until its next
    start: both users count, and root's files by the stricter rule."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ref = processes.ref_of(proc.pid)
        assert ref is not None
        owner = Owner.of([ref], activated_at=START, unit_uid=VLLM)
        assert owner.uids == {os.geteuid(), VLLM} and owner.pids == {proc.pid}
    finally:
        proc.kill()
        proc.wait()


@needs_root
def test_a_process_that_is_not_dumpable_is_still_counted_as_its_own_user() -> None:
    """The files in /proc/PID of a process that is not dumpable are root's, whoever it runs
    as: vLLM's user is read from /proc/PID/status (its filesystem uid), never from them."""
    code = (
        "import ctypes, time; ctypes.CDLL(None).prctl(4, 0, 0, 0, 0); "  # PR_SET_DUMPABLE 0
        "print('ready', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen(
        ["/usr/bin/python3", "-c", code], stdout=subprocess.PIPE, user=VLLM, group=VLLM
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith(b"ready")
        assert os.stat(f"/proc/{proc.pid}/status").st_uid == 0  # not dumpable: root's files
        assert processes.uid_of(proc.pid) == VLLM
        ref = processes.ref_of(proc.pid)
        assert ref is not None and Owner.of([ref], activated_at=START).uids == {VLLM}
    finally:
        proc.kill()
        proc.wait()


# -- the step, on real files and processes -------------------------------------------------------
def _config(shm: Path, tmp: Path | None = None) -> TeardownConfig:
    return TeardownConfig(shm_dir=shm, tmp_dir=tmp)


def _plant(path: Path, uid: int, kind: str = "file") -> Path:
    if kind == "dir":
        path.mkdir()
    else:
        path.write_bytes(b"x")
    os.chown(path, uid, uid)
    return path


def _remove(config: TeardownConfig, owner: Owner) -> tuple[list[str], dict[str, str], str]:
    removed: list[str] = []
    kept: dict[str, str] = {}

    def on_event(e: object) -> None:
        if isinstance(e, LeftoverKept):
            kept[e.path] = e.error

    note = leftovers.remove(config, removed, on_event, owner=owner)
    return removed, kept, note


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts; each one still running is ended after it, by its own PID."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _start(procs: list[subprocess.Popen[bytes]], code: str, *args: str) -> ProcessRef:
    p = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    procs.append(p)
    assert p.stdout is not None
    assert p.stdout.readline().startswith(b"ready"), "the process did not start"
    ref = processes.ref_of(p.pid)
    assert ref is not None
    return ref


MAPS = (
    "import mmap, sys, time\n"
    "f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); f.close()\n"
    "g = open(sys.argv[2], 'rb')\n"
    "import socket; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[3]); s.listen()\n"
    "print('ready', flush=True); time.sleep(600)\n"
)
SLEEPS = "import time; print('ready', flush=True); time.sleep(600)"


@needs_root
def test_a_switch_removes_vllms_users_leftovers_and_keeps_every_root_programs_look_alike(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    since = time.time() - 1  # vLLM's unit started; everything below is made after it
    bystander = _start(spawned, SLEEPS)  # a root program beside vLLM, holding nothing
    vllms = [_plant(shm / "psm_3f2a9c", VLLM), _plant(shm / "sem.mp-ab12", VLLM)]
    vllms.append(_plant(shm / "vllm-dead", VLLM, "dir"))
    _plant(vllms[-1] / "part", VLLM)
    roots = [_plant(shm / "psm_7c1d00", 0), _plant(shm / "sem.mp-cd34", 0)]
    theirs = [_plant(shm / "psm_team2", OTHER)]
    owner = Owner.of([], activated_at=since, unit_uid=VLLM, dirs=[shm])  # vLLM not running
    removed, kept, note = _remove(_config(shm), owner)
    assert sorted(removed) == sorted(map(str, vllms)), kept
    for p in [*roots, *theirs]:
        assert p.exists() and "not vLLM's user" in kept[str(p)], (p, kept)
    assert note == "3 leftover(s) removed; 3 not provably vLLM's, kept"
    assert processes.is_alive(bystander)


def test_a_hundred_foreign_files_in_shm_give_twenty_lines_and_a_count_not_a_hundred_lines(
    tmp_path: Path,
) -> None:
    """As vLLM's CPU build leaves them on a test host: 4 MiB `PID-tp:...-cpushm_N` files of
    root's, from runs long gone, at every teardown."""
    shm = tmp_path / "shm"
    shm.mkdir()
    roots = [_plant(shm / f"psm_{i:04x}", 0) for i in range(99)]
    roots.append(_plant(shm / "psm_zzzz", 0))  # the newest, last by name: listed all the same
    owner = Owner.of([], activated_at=time.time() - 1, unit_uid=VLLM, dirs=[shm])
    events: list[object] = []
    note = leftovers.remove(_config(shm), [], events.append, owner=owner)
    listed = [e for e in events if isinstance(e, LeftoverKept)]
    (unlisted,) = [e for e in events if isinstance(e, LeftoversUnlisted)]
    assert len(listed) == leftovers.FOREIGN_LISTED and unlisted.count == 100 - len(listed)
    assert listed[0].path == str(roots[-1])
    assert note == "0 leftover(s) removed; 100 not provably vLLM's, kept"
    assert all(p.exists() for p in roots)


@needs_root
def test_vllm_run_as_root_loses_only_what_its_tree_held_and_other_root_programs_keep_theirs(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    since = time.time() - 1
    mapped, opened = shm / "psm_3f2a9c", shm / "sem.mp-ab12"
    for p in (mapped, opened):
        p.write_bytes(b"x" * 4096)
    zmq = tmp / "0d49a536-9d4c-4f01-ad55-3291091f7f92"
    worker = _start(spawned, MAPS, str(mapped), str(opened), str(zmq))  # vLLM's tree, as root
    pid_named = _plant(shm / f"{worker.pid}-tp:0-0-cpushm_0", 0)
    # Root programs beside it: their files made since vLLM's start, none of them in use now.
    roots = [_plant(shm / "psm_7c1d00", 0), _plant(shm / "sem.mp-cd34", 0)]
    roots.append(_plant(shm / "psm_a1234b", 0))
    dead = tmp / "34903d81-8cd4-4f43-9f89-6453bccef842"  # a socket its process left
    bind = "import socket, sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])"
    subprocess.run([sys.executable, "-c", bind, str(dead)], check=True)
    roots.append(dead)
    bystander = _start(spawned, SLEEPS)
    owner = Owner.of([worker], activated_at=since, unit_uid=0, dirs=[shm, tmp])
    os.kill(worker.pid, signal.SIGKILL)  # the teardown kills the tree: the files are left
    spawned[0].wait()
    removed, kept, _note = _remove(_config(shm, tmp), owner)
    assert sorted(removed) == sorted(map(str, [mapped, opened, pid_named, zmq])), kept
    for p in roots:
        assert p.exists() and kept[str(p)] == f"not provably vLLM's: {ROOTS_RULE}", (p, kept)
    assert processes.is_alive(bystander)


@needs_root
def test_a_file_of_vllms_user_that_a_live_process_has_open_is_kept(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    since = time.time() - 1
    in_use = _plant(shm / "psm_in_use", VLLM)
    holder = _start(
        spawned, "import sys, time; f = open(sys.argv[1]); print('ready', flush=True); "
        "time.sleep(600)", str(in_use),
    )  # fmt: skip
    owner = Owner.of([], activated_at=since, unit_uid=VLLM, dirs=[shm])
    removed, _kept, note = _remove(_config(shm), owner)
    assert (
        removed == [] and in_use.exists() and note == "0 leftover(s) removed; 1 still in use, kept"
    )
    assert processes.is_alive(holder)


def test_socket_paths_come_from_the_sockets_a_process_has_open(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    """The identity of a bound socket, for vLLM run as root: /proc/PID/fd names it only as
    `socket:[inode]`; /proc/net/unix gives that inode's path."""
    from kimi_supervisor.ports import openfiles
    from kimi_supervisor.ports.sockets import unix_paths_by_inode

    path = tmp_path / "0d49a536-9d4c-4f01-ad55-3291091f7f92"
    data = tmp_path / "psm_x"
    data.write_bytes(b"x" * 4096)
    ref = _start(spawned, MAPS, str(data), str(data), str(path))
    keys, inodes = openfiles.held_under(ref.pid, [str(tmp_path) + "/"])
    st = os.stat(data)
    assert keys == {(1, st.st_dev, st.st_ino)}
    paths = unix_paths_by_inode()
    assert str(path) in {paths[i] for i in inodes if i in paths}
    with socket.socket(socket.AF_UNIX) as s:  # it is bound: this connects
        s.connect(str(path))


def test_a_directory_of_more_than_max_entries_is_kept_and_not_walked_further(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(leftovers, "MAX_ENTRIES", 50)  # the bound's rule, at a size made quickly
    shm = tmp_path / "shm"
    big = shm / "vllm-big"
    big.mkdir(parents=True)
    for i in range(leftovers.MAX_ENTRIES + 1):
        (big / str(i)).touch()
    owner = Owner.of([], activated_at=time.time() - 60, unit_uid=os.geteuid(), dirs=[shm])
    removed, kept, _note = _remove(_config(shm), owner)
    assert removed == [] and big.is_dir() and len(os.listdir(big)) == leftovers.MAX_ENTRIES + 1
    assert (
        kept[str(big)]
        == f"not provably vLLM's: a directory of more than {leftovers.MAX_ENTRIES} entries"
    )
